"""User-facing policies: how parameters are cast and where sharded state lives.

They are frozen dataclasses validated on construction, so a bad policy fails where it was
written, not deep inside the first all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(field: str, value: Optional[torch.dtype]) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        raise ValueError(
            f"MixedPrecisionPolicy.{field}={value!r} is not a floating-point torch.dtype; "
            f"use one of {', '.join(str(d) for d in _FLOAT_DTYPES)} or None (keep the original dtype)."
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gathered parameters, the gradient reduction and the outputs.

    ``None`` everywhere (the default) means: compute and communicate in each parameter's
    original dtype.
    """

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

    ``pin_memory`` pins the CPU shards so host-to-device copies can be non-blocking. It has no
    effect on a CPU-only mesh.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}.")
