"""The diagnosis catalog's scenario generator: one builder per family, ``builder(Params) -> nodes``.

Each builder writes a realistic recording of one family of GPU trouble (or of a healthy job) for
``Params(seed, magnitude, n_nodes, outlier)``; :mod:`tests.scenarios.expectations` says what explain
must and must not name for it, :mod:`tests.scenarios.ingero_layout` rewrites it to Ingero's layout,
:mod:`tests.scenarios.judge` runs and judges it. Families by module: :mod:`.idle` (the GPU waits on
its thread), :mod:`.slow` (GPU calls slower than steady), :mod:`.memory`, :mod:`.ranks` (multi-rank
and healthy shapes), :mod:`.serving` (serving engines, with their own metrics).
"""

from __future__ import annotations

from collections.abc import Callable

from ingero.demo.synth import SyntheticNode
from tests.scenarios import host, idle, memory, ranks, serving, slow
from tests.scenarios.base import Params

Builder = Callable[[Params], list[SyntheticNode]]
FAMILIES: dict[str, Builder] = {**idle.FAMILIES, **host.FAMILIES, **slow.FAMILIES, **memory.FAMILIES, **ranks.FAMILIES}
FAMILIES |= serving.FAMILIES

__all__ = ["FAMILIES", "Builder", "Params"]
