"""fully_shard: FSDP2-style sharding of parameters, gradients and optimizer state.

Public names only. The package is layered; each layer may import only the ones above it in this
list (`tests/test_layers.py` enforces it), and each subpackage's docstring says what it owns:

* ``layouts/``  - policies, shard layout arithmetic, meshes, tensor-parallel specs (pure descriptions)
* ``runtime/``  - the engine: states, groups, parameters, lifecycles, collectives and where they run
* ``features/`` - optional features and checks built on the runtime (offload choosers, the finite and
  schedule checks, the optimizer traps); ``quant.py`` (a codec) is one too
* ``api/``      - what users call: ``fully_shard``, ``replicate``, ``FSDPModule``, ``unsharded``,
  ``clip_grad_norm_``, and the checks of their arguments
* ``tools/``, ``debug.py``, ``plan/`` - tools: traces, live-byte counting, the planner
* ``fsdp1/``    - FSDP1's API on the engine
"""

from . import debug, quant
from .api.clip import clip_grad_norm_
from .api.discovery import ShardPlacement
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
