"""fully_shard: FSDP2-style sharding of parameters, gradients and optimizer state.

Public names only. Each layer imports only those listed before it (`tests/test_layers.py` checks;
each subpackage's docstring says what it owns): ``layouts/`` (policies, shard arithmetic, meshes),
``runtime/`` (the engine), ``features/`` and ``quant.py`` (optional features and checks), ``api/``
(what users call), ``tools/``, ``debug.py`` and ``plan/`` (traces, memory, the planner), ``fsdp1/``.
"""

from . import debug, quant
from .api.clip import clip_grad_norm_
from .api.discovery import FlatShard, ShardPlacement, flat_where_padded
from .api.module import (
    FSDPModule,
    ReplicateModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .api.sharding import fully_shard, replicate
from .api.spmd import DataParallelMeshDims
from .api.unsharded import unsharded
from .features.finite import NonFinite, NonFiniteGradients
from .features.offload import OffloadPlan, offload_by_budget
from .layouts.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

# `from fully_shard import fully_shard` gives the function: keep `fully_shard.debug.trace()` etc. working.
fully_shard.unsharded = unsharded  # type: ignore[attr-defined]
fully_shard.offload_by_budget = offload_by_budget  # type: ignore[attr-defined]
fully_shard.debug = debug  # type: ignore[attr-defined]
fully_shard.quant = quant  # type: ignore[attr-defined]

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "NonFinite",
    "NonFiniteGradients",
    "OffloadPlan",
    "OffloadPolicy",
    "ReplicateModule",
    "FlatShard",
    "flat_where_padded",
    "ShardPlacement",
    "UnshardHandle",
    "clip_grad_norm_",
    "debug",
    "fully_shard",
    "offload_by_budget",
    "quant",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
    "unsharded",
]
