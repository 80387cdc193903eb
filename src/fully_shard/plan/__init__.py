"""Plan before you launch: simulate a training step of this runtime at any world size on one CPU
(``simulate``), and read what it needs per rank (``Plan``)."""

from .memory import CATEGORIES, LiveBytes, Snapshot
from .simulate import Plan, default_shard_fn, measure, simulate
from .recommend import Option, recommend
from .timing import PRESETS, Cluster, Link, StepTime

__all__ = [
    "CATEGORIES", "PRESETS", "Cluster", "Link", "LiveBytes", "Option", "Plan", "Snapshot", "StepTime", "default_shard_fn",
    "measure", "recommend", "simulate",
]
