"""FSDP1's API on this package's engine: change ``from torch.distributed.fsdp import ...`` to
``from fully_shard.fsdp1 import ...`` (and ``torch.distributed.fsdp.wrap`` to
``fully_shard.fsdp1.wrap``). See docs/migrating_from_fsdp1.md."""

from . import wrap
from .config import (
    BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig,
    LocalStateDictConfig, MixedPrecision, OptimStateDictConfig, OptimStateKeyType, ShardedOptimStateDictConfig,
    ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType,
)
from .wrapper import FullyShardedDataParallel

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "wrap",
]
