"""fully_shard: FSDP2-style sharding of parameters, gradients and optimizer state."""

from . import debug, quant
from .clip import clip_grad_norm_
from .api import (
    FSDPModule, ReplicateModule, UnshardHandle, fully_shard, register_fsdp_forward_method, replicate, share_comm_ctx,
)
from .discovery import ShardPlacement
from .finite import NonFinite, NonFiniteGradients
from .offload import OffloadPlan, offload_by_budget
from .spmd import DataParallelMeshDims
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .unsharded import unsharded

# `from fully_shard import fully_shard` gives the function; these keep the package-style
# spellings (`fully_shard.unsharded(...)`, `fully_shard.debug.trace()`) working on it too.
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
