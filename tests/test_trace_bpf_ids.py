"""The BPF C and the Python that reads its records agree, by construction or by this check.

* Source and op ids are declared once, in :mod:`ingero.store.catalog`: the C gets them as ``-D``
  flags (:func:`ingero.agent.trace.probes.catalog_defines`), defines none itself and passes no bare integer
  where an op id goes.
* ``struct ingero_event`` (``bpf/ingero_common.h``) and ``ringbuf.EVENT_DTYPE`` list the same fields,
  in the same order, with the same sizes; the kernel counters and ``probes.COUNTER_NAMES`` match.
"""

from __future__ import annotations

import re

import numpy as np

from ingero.agent.trace.probes import BPF_DIR, COUNTER_NAMES, catalog_defines
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.store import catalog

SOURCES = {p.name: p.read_text() for p in sorted(BPF_DIR.iterdir()) if p.suffix in (".c", ".h")}
C_TYPES = {"u64": "<u8", "u32": "<u4", "s32": "<i4", "u16": "<u2", "u8": "|u1"}


def _defined() -> dict[str, int]:
    return {k.removeprefix("-D"): int(v) for k, v in (f.split("=") for f in catalog_defines())}


def test_every_catalog_id_is_defined_for_the_c() -> None:
    d = _defined()
    for sid, name, _ in catalog.SOURCES:
        assert d[f"SRC_{name}"] == sid
    for _, op, name, _ in catalog.OPS:
        assert d[f"OP_{name}"] == op
    assert d["OP_NCCL_COMM_INIT"] == catalog.NCCL_COMM_INIT_OP


def test_the_c_declares_no_id_of_its_own() -> None:
    d = _defined()
    for name, text in SOURCES.items():
        code = re.sub(r"//[^\n]*", "", text)
        own = re.findall(r"#define\s+((?:SRC|OP|HOST|IO)_\w+)", code)
        assert not own, f"{name} defines {own}: ids come from ingero/store/catalog.py"
        # a source id followed by a bare number is an op id written by hand
        bare = re.findall(r"\b(SRC_\w+)\s*,\s*(\d+)\b", code) + re.findall(r"nccl_enter\(ctx,\s*(\d+)", code)
        assert not bare, f"{name}: bare op ids {bare}"
        for ident in set(re.findall(r"\b((?:SRC|OP)_\w+)\b", code)):
            assert ident in d, f"{name} uses {ident}, which ingero/store/catalog.py does not declare"


def test_event_record_layout_matches_the_reader() -> None:
    body = re.search(r"struct ingero_event \{(.*?)\};", SOURCES["ingero_common.h"], re.S)
    assert body is not None
    fields = re.findall(r"^\s*(u64|u32|s32|u16|u8)\s+(\w+);", body.group(1), re.M)
    assert [n for _, n in fields] == list(EVENT_DTYPE.names or ())
    for ctype, name in fields:
        assert EVENT_DTYPE[name] == np.dtype(C_TYPES[ctype]), name


def test_kernel_counter_slots_match_their_names() -> None:
    slots = dict(re.findall(r"#define CNT_(\w+) (\d+)", SOURCES["ingero_common.h"]))
    count = int(slots.pop("SLOTS"))
    assert sorted(int(v) for v in slots.values()) == list(range(len(COUNTER_NAMES))) and len(COUNTER_NAMES) <= count
