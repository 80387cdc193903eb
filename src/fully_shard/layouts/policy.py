"""User-facing policies: how parameters are cast and where sharded state lives. Frozen and
validated on construction, so a bad policy fails where it was written."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(field: str, value: Optional[torch.dtype]) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        raise ValueError(
            f"MixedPrecisionPolicy.{field}={value!r} is not a floating-point torch.dtype; use one of "
            f"{', '.join(str(d) for d in _FLOAT_DTYPES)} or None (keep the original dtype)."
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gathered parameters, the gradient reduction and the outputs; ``None``
    keeps each parameter's original dtype. Raises ``ValueError`` on a non-float dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}."
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; copy a shard to the device for each all-gather.
    ``pin_memory`` pins the CPU shards for non-blocking copies (no effect on a CPU-only mesh)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}.")


def _is_torch_policy(obj: object, name: str) -> bool:
    """PyTorch's own FSDP2 policy class of that name, recognised without importing its package."""
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.split(".")[:2] == ["torch", "distributed"]


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def as_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Ours as is; PyTorch's ``MixedPrecisionPolicy`` converted field by field; else refused."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if _is_torch_policy(policy, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy(**{f.name: getattr(policy, f.name) for f in fields(MixedPrecisionPolicy)})
    raise TypeError(
        "mp_policy must be a fully_shard.MixedPrecisionPolicy (PyTorch's FSDP2 MixedPrecisionPolicy is "
        f"converted too), got {_class_path(policy)}. Fix: pass "
        "fully_shard.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)."
    )


def as_offload_policy(policy: object) -> OffloadPolicy:
    """Ours as is; PyTorch's converted; ``None`` means no offload (as in PyTorch); else refused."""
    if policy is None:
        return OffloadPolicy()
    if isinstance(policy, OffloadPolicy):
        return policy
    if _is_torch_policy(policy, "CPUOffloadPolicy"):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)  # type: ignore[attr-defined]
    if _is_torch_policy(policy, "OffloadPolicy"):
        return OffloadPolicy()
    raise TypeError(
        "offload_policy must be a fully_shard.OffloadPolicy or fully_shard.CPUOffloadPolicy (PyTorch's "
        f"FSDP2 ones are converted too), got {_class_path(policy)}. Fix: pass fully_shard.CPUOffloadPolicy() "
        "to keep shards on the host, or leave it out."
    )
