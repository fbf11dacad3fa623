"""What explain must and must not say: per scenario family of the catalog, per layout, and for the
realistic recordings of :mod:`ingero.demo.realistic`. The expectations live here, in tests/, never in
the package.

Family names are chain-family prefixes (``Chain.family.startswith(prefix)``). Where a cause has more
than one accepted name (today's rule and the ledger's ``idle/<bucket>`` chain), both are listed, once,
in the groups below.

Severity is lost time as a share of wall time (HIGH ≥ 20 %, MEDIUM ≥ 5 %, LOW ≥ 1 %). A scenario's
``magnitude`` is the share its disturbance costs; the family must be named at least at the severity
of ``magnitude x (1 - TOLERANCE)`` and at most at that of ``magnitude x (1 + TOLERANCE)``, LOW at least
(a disturbance of 4 % is not HIGH; LOW chains are allowed anywhere). ``must_not`` prefixes must not
appear at ANY severity, LOW included, on any node of the run. A chain of off-CPU time of unknown kind
(Ingero's layout) counts as the finding only when it names the missing signal (``prev_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ingero.demo import realistic
from ingero.demo.synth import SyntheticNode

SEVERITIES = ("HIGH", "MEDIUM", "LOW")
THRESHOLDS = {"HIGH": 0.20, "MEDIUM": 0.05, "LOW": 0.01}
TOLERANCE = 0.2  # how far explain's measured share may sit from the magnitude built in
# Magnitudes both sides of every threshold; seed k of a family runs MAGNITUDES[k % len(MAGNITUDES)].
MAGNITUDES = (0.26, 0.16, 0.065, 0.04, 0.014, 0.007)
ABOVE, BELOW = 0.26, 0.04  # the fast test's two seeds: above HIGH; below MEDIUM (LOW)

# Accepted names per cause (today's rules, the ledger's idle/<bucket> chains).
CPU_CONTENTION = ("tail/cpu", "drop/cpu", "slow/cpu", "idle/preempted")
OFFCPU_UNKNOWN = ("idle/offcpu_unknown", "tail/offcpu", "drop/offcpu")
WORKERS = ("idle/input", "idle/asleep_workers")
DISK = ("idle/io", "idle/asleep_disk")
NETWORK_WAIT = ("idle/net", "idle/asleep_network")
HOST_CODE = ("idle/host_code",)
HOST_BOUND = ("idle/host_bound",)  # own host code at every step: the loop is CPU-bound
SERVING_CPU = ("serving/cpu-bottleneck",)  # a serving engine's loop: the same host code, told as serving's
HANG = ("hang", "hung", "straggler", "stall")
SLOWER_REGIME = ("drift", "regime", "slow/", "tail/gpu", "tail/slow", "tail/unknown")
MISSING_PREV_STATE = "prev_state"  # what a chain of off-CPU time of unknown kind must say is missing
RECORDED, INGERO = "recorded", "ingero"
LAYOUTS = (RECORDED, INGERO)


def severity_of(share: float) -> str | None:
    return next((s for s in SEVERITIES if share >= THRESHOLDS[s]), None)


def rank(sev: str | None) -> int:
    """HIGH 3, MEDIUM 2, LOW 1, none 0."""
    return 0 if sev is None else 3 - SEVERITIES.index(sev)


@dataclass(frozen=True)
class Expect:
    """One family in one layout."""

    names: tuple[str, ...]  # the outlier node must have a chain of one of these ...
    least: Callable[[float], str | None]  # ... at least this severity for a magnitude (None: nothing required)
    most: Callable[[float], str | None]  # and none of these names above this one
    must_not: tuple[str, ...] = CPU_CONTENTION
    healthy: bool = False  # no HIGH or MEDIUM chain on any node
    peers_clean: bool = True  # the other nodes (healthy runs of the same job) get no HIGH or MEDIUM
    anywhere: bool = False  # the finding may be on any node (the recording cannot tell which one)


def by_loss(m: float) -> str | None:
    return severity_of(m * (1 - TOLERANCE))


def by_loss_most(m: float) -> str:
    """LOW at least: LOW chains are allowed anywhere, even on a healthy node (its own host code, its
    first launches); above LOW only what the magnitude warrants."""
    return severity_of(m * (1 + TOLERANCE)) or "LOW"


def start_up_most(m: float) -> str | None:
    """One-off start-up costs are at most LOW unless they exceed 20 % of the run."""
    return by_loss_most(m) if m * (1 + TOLERANCE) >= THRESHOLDS["HIGH"] else "LOW"


def start_up_least(m: float) -> str | None:
    """Start-up named at least LOW once it loses 1 %, at its lost time's severity only where that is
    surely over 20 % of the run (below, the policy caps it at LOW: asking MEDIUM there contradicts it)."""
    return by_loss(m) if m * (1 - TOLERANCE) >= THRESHOLDS["HIGH"] else ("LOW" if by_loss(m) else None)


def leak_least(m: float) -> str | None:
    """A leak loses no time until memory runs out: named (at least LOW) once it passes the leak rule's
    64 MiB floor with margin; its severity comes from bytes, not lost time."""
    return "LOW" if m * 8 * 1024 >= 1.25 * 64 else None


def high(m: float) -> str | None:
    return "HIGH"


def nothing(m: float) -> str | None:
    return None


def low(m: float) -> str | None:
    return "LOW"


def lost(names: tuple[str, ...], *, must_not: tuple[str, ...] = (), **kw: object) -> Expect:
    return Expect(names, by_loss, by_loss_most, CPU_CONTENTION + must_not, **kw)  # type: ignore[arg-type]


HEALTHY_MUST_NOT = CPU_CONTENTION + WORKERS + DISK + HOST_BOUND + ("transfer", "gpu-leak", "oom", "alloc-churn")
HEALTHY = Expect((), nothing, low, HEALTHY_MUST_NOT, healthy=True)

# family -> layout -> expectation
CATALOG: dict[str, dict[str, Expect]] = {
    "loader-fork": {
        RECORDED: lost(WORKERS, must_not=DISK),
        INGERO: lost(WORKERS + OFFCPU_UNKNOWN, must_not=DISK),  # no wakeups: "kind unknown" is the finding
    },
    "loader-inline": {RECORDED: lost((*HOST_CODE, "idle/input")), INGERO: lost((*HOST_CODE, "idle/input"))},
    "loader-disk": {
        RECORDED: lost(DISK, must_not=WORKERS),
        INGERO: lost(DISK + OFFCPU_UNKNOWN, must_not=WORKERS),  # the thread's own reads are still there
    },
    "serving-host-bound": {RECORDED: lost(HOST_CODE), INGERO: lost(HOST_CODE)},
    "cpu-bound-loop": {layout: lost(HOST_BOUND, must_not=WORKERS + DISK) for layout in LAYOUTS},
    # reads overlapping queued GPU work: only what outlasts the queue is lost (the sync tells how much)
    "loader-overlap": {
        RECORDED: lost(DISK, must_not=WORKERS + HOST_BOUND),
        INGERO: lost(DISK + OFFCPU_UNKNOWN, must_not=WORKERS + HOST_BOUND),
    },
    "tool-call": {
        RECORDED: lost(NETWORK_WAIT, must_not=WORKERS + DISK),
        INGERO: lost(NETWORK_WAIT + OFFCPU_UNKNOWN, must_not=WORKERS + DISK),
    },
    "checkpoint": {
        RECORDED: lost((*DISK, "tail/io"), must_not=WORKERS),
        INGERO: lost((*DISK, "tail/io", *OFFCPU_UNKNOWN), must_not=WORKERS),
    },
    "cpu-contention": {
        RECORDED: Expect(CPU_CONTENTION, by_loss, by_loss_most, ()),
        # contention cannot be told without prev_state: report the lost time, say what is missing, never guess
        INGERO: Expect(OFFCPU_UNKNOWN, by_loss, by_loss_most, CPU_CONTENTION),
    },
    "cpu-bimodal": {
        RECORDED: Expect(CPU_CONTENTION, by_loss, by_loss_most, ()),
        INGERO: Expect(OFFCPU_UNKNOWN, by_loss, by_loss_most, CPU_CONTENTION),
    },
    "kv-pressure": {RECORDED: lost(("alloc-churn",)), INGERO: lost(("alloc-churn",))},
    "noisy-neighbour": {RECORDED: lost(("gpu-contention",)), INGERO: lost(("gpu-contention",))},
    "cold-start": {
        layout: Expect(("cold-start", "first-launch"), start_up_least, start_up_most, CPU_CONTENTION)
        for layout in LAYOUTS
    },
    "pageable-copy": {RECORDED: lost(("transfer",)), INGERO: lost(("transfer",))},
    "kernel-drift": {RECORDED: lost(SLOWER_REGIME), INGERO: lost(SLOWER_REGIME)},
    "leak": {layout: Expect(("gpu-leak",), leak_least, high) for layout in LAYOUTS},
    "oom": {layout: Expect(("oom",), high, high) for layout in LAYOUTS},
    "fragmentation": {layout: lost(("alloc-churn", "oom", "fragment")) for layout in LAYOUTS},
    # the peers wait inside the collective for the late rank: their chains (if any) are not checked
    "late-rank": {
        layout: Expect((*HOST_CODE, "straggler", "late-rank"), by_loss, by_loss_most, peers_clean=False)
        for layout in LAYOUTS
    },
    # after its last GPU call a thread's ledger ends: a hang is told by the calls that never returned
    # (recorded) or by the GPU threads' silence while the recording goes on (both layouts)
    "hung-rank": {
        RECORDED: Expect(HANG, by_loss, high, peers_clean=False),
        # without NCCL rows every rank just falls silent, and so does a job that finished: Ingero's own
        # sample recordings (tests/data/ingero-samples, healthy, no exit rows) stop their GPU calls 1.2 s,
        # 36-40 % of the recording, before it ends. The hang's signal (a call entered, never returned) is
        # missing: nothing is required, and no hang may be claimed above LOW (never guess the cause)
        INGERO: Expect(HANG, nothing, low, peers_clean=False, anywhere=True),
    },
    "healthy-sleeps": {layout: HEALTHY for layout in LAYOUTS},
    "healthy-collective": {layout: HEALTHY for layout in LAYOUTS},
    "healthy-idle-server": {layout: HEALTHY for layout in LAYOUTS},
    "healthy-overlap": {layout: HEALTHY for layout in LAYOUTS},
    # a serving engine's loop CPU-bound at every step while requests wait: serving's chain, not the training one
    "engine-cpu-bound": {
        layout: lost(SERVING_CPU, must_not=HOST_CODE + HOST_BOUND + WORKERS + DISK) for layout in LAYOUTS
    },
    # an engine polling for work at low load: no CPU bottleneck at any severity where its metrics say no
    # request was there; without them (Ingero's layout keeps no engine_metrics) at most LOW, never the training chain
    "healthy-engine-idle": {
        RECORDED: Expect((), nothing, low, HEALTHY_MUST_NOT + HOST_CODE + SERVING_CPU, healthy=True),
        INGERO: Expect((), nothing, low, HEALTHY_MUST_NOT + HOST_CODE, healthy=True),
    },
}
HEALTHY_FAMILIES = tuple(f for f, e in CATALOG.items() if e[RECORDED].healthy)
CPU_FAMILIES = ("cpu-contention", "cpu-bimodal")
MULTI_RANK = ("late-rank", "hung-rank", "healthy-collective")  # at least two nodes, whatever n_nodes says


# --- the realistic recordings of ingero.demo.realistic (tests/test_explain_scenarios.py) ----------


@dataclass(frozen=True)
class Realistic:
    builder: Callable[[int, int], SyntheticNode]
    must_name: tuple[tuple[str, str], ...]  # (chain family, minimum severity)
    must_not_name: tuple[str, ...]  # family prefixes that must not appear at any severity, LOW included
    no_high_or_medium: bool = False


REALISTIC: dict[str, Realistic] = {
    "runqueue-contention": Realistic(realistic.runqueue_contention, (("tail/cpu", "HIGH"),), ("idle/", "tail/io")),
    "disk-bound": Realistic(realistic.disk_bound, (("idle/io", "HIGH"),), ("tail/cpu", "drop/cpu", "idle/input")),
    "recompiling": Realistic(realistic.recompiling, (("recompile", "MEDIUM"),), ("tail/", "drop/", "cold-start")),
    "healthy": Realistic(
        realistic.healthy, (), ("tail/", "drop/", "idle/", "network", "cold-start"), no_high_or_medium=True
    ),
    "dataloader-starved": Realistic(realistic.dataloader_starved, (("idle/input", "HIGH"),), ("tail/cpu", "drop/cpu")),
    "collective-wait": Realistic(realistic.collective_wait, (), ("tail/cpu", "drop/cpu", "tail/offcpu", "network")),
}
