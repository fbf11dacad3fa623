"""Calls the real libcudart's cudaMalloc N times through ctypes (no GPU: it returns an error code).

usage: python cudart_ctypes.py /path/to/libcudart.so.12 N   -> prints "cudaMalloc N <last return code>"
"""

import ctypes
import sys

lib = ctypes.CDLL(sys.argv[1])
n = int(sys.argv[2])
ptr = ctypes.c_void_p()
rc = 0
for _ in range(n):
    rc = lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
print(f"cudaMalloc {n} {rc}", flush=True)
