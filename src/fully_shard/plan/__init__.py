"""Plan before you launch: simulate a training step of this runtime at any world size on one CPU
(``simulate``), read what it needs per rank (``Plan``), estimate its time (``Plan.estimate``), let
``recommend`` rank the usual settings, and draw it (``draw``, with matplotlib)."""

from .compute import ComputeRate, measure_flops
from .draw import draw
from ..tools.memory import CATEGORIES, LiveBytes, Snapshot
from .simulate import Plan, default_shard_fn, from_trace, measure, simulate
from .recommend import Candidate, Option, recommend
from .timing import PRESETS, Cluster, Link, StepTime

__all__ = [
    "CATEGORIES",
    "PRESETS",
    "Candidate",
    "Cluster",
    "ComputeRate",
    "Link",
    "LiveBytes",
    "Option",
    "Plan",
    "Snapshot",
    "StepTime",
    "default_shard_fn",
    "draw",
    "from_trace",
    "measure",
    "measure_flops",
    "recommend",
    "simulate",
]
