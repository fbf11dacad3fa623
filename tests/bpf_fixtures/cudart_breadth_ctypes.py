"""Calls the real libcudart's newer probed functions through ctypes (no GPU: each returns an error code).

usage: python cudart_breadth_ctypes.py /path/to/libcudart.so.12 N
prints one "<function> <N> <last return code>" line per function.
"""

import ctypes
import sys

lib = ctypes.CDLL(sys.argv[1])
n = int(sys.argv[2])
p = ctypes.c_void_p()
size = ctypes.c_size_t
calls = {
    "cudaMemcpy2D": lambda: lib.cudaMemcpy2D(None, size(512), None, size(512), size(300), size(20), 1),
    "cudaMemset": lambda: lib.cudaMemset(None, 0, size(1111)),
    "cudaEventQuery": lambda: lib.cudaEventQuery(None),
    "cudaHostAlloc": lambda: lib.cudaHostAlloc(ctypes.byref(p), size(65536), 2),
    "cudaStreamBeginCapture": lambda: lib.cudaStreamBeginCapture(None, 0),
    "cudaGraphLaunch": lambda: lib.cudaGraphLaunch(None, None),
    "cudaMallocAsync": lambda: lib.cudaMallocAsync(ctypes.byref(p), size(4096), None),
    "cudaFreeAsync": lambda: lib.cudaFreeAsync(ctypes.c_void_p(0x1000), None),
}
for name, call in calls.items():
    rc = 0
    for _ in range(n):
        rc = call()
    print(f"{name} {n} {rc}", flush=True)
