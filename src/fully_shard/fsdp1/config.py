"""FSDP1's enums and config dataclasses, with the same names, members, fields and defaults as
PyTorch 2.13's FSDP1 ones, so FSDP1 code keeps working after changing its
import. PyTorch's own objects are accepted wherever ours are (`as_ours`: converted by class
name and fields, never imported).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum, auto
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


class ShardingStrategy(Enum):
    """How FSDP1 shards; here each maps onto `fully_shard` / `replicate`:

    * ``FULL_SHARD``: ``fully_shard`` (reshard after forward, the root excepted, as FSDP1 does);
    * ``SHARD_GRAD_OP``: ``fully_shard(reshard_after_forward=False)``;
    * ``NO_SHARD``: ``replicate`` (gradients all-reduced);
    * ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: HSDP on a ``(replicate, shard)`` mesh, the shard
      dimension within a node, resharding after forward or not.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class StateDictType(Enum):
    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class MixedPrecision:
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    offload_params: bool = False


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig = field(default_factory=OptimStateDictConfig)


def as_ours(value: Any, expected: type, arg: str) -> Any:
    """``value`` as our ``expected`` type: ours as is, PyTorch's FSDP1 equivalent converted (an
    enum by member name, a config by its fields), ``None`` kept; anything else refused, naming
    the argument."""
    if value is None or isinstance(value, expected):
        return value
    name = type(value).__name__
    if name == expected.__name__ and type(value).__module__.startswith("torch.distributed"):
        if issubclass(expected, Enum):
            return expected[value.name]
        return expected(**{f.name: getattr(value, f.name) for f in fields(expected)})
    raise TypeError(
        f"FullyShardedDataParallel({arg}=...) expects a {expected.__name__} (from fully_shard.fsdp1, or "
        f"PyTorch's), got {name}: {value!r}."
    )


__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
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
    "as_ours",
]
