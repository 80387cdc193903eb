"""Quantized weight all-gather (ZeRO++'s qwZ, per row), see docs/extensions.md:

    model.set_all_gather_codec(fully_shard.quant.Int8AllGather())  # weights (2-D+) under model

Int8 values and one float32 scale per dim-0 row travel instead of the weights; each rank
dequantizes what arrived. Shards, gradients and optimizer state stay full precision, so rounding
does not accumulate across steps. Gradients are not quantized (qgZ needs error feedback).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["Int8AllGather"]


class Int8AllGather:
    """An all-gather codec (``FSDPModule.set_all_gather_codec``): int8 values plus one float32
    scale per dim-0 row. Stateless: one instance can serve every parameter."""

    def __repr__(self) -> str:
        return "Int8AllGather()"

    def pre_all_gather(
        self,
        tensor: torch.Tensor,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: Any,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        rows = tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).float()  # any size, zero rows too
        scale = rows.abs().amax(dim=1) / 127.0 if rows.shape[1] else rows.new_ones(rows.shape[0])
        # All-zero rows: any scale works. A NaN or inf scale stays, so the row arrives non-finite.
        scale = torch.where((scale > 0) | ~torch.isfinite(scale), scale, torch.ones_like(scale))
        q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return (q.view(tensor.shape), scale), None

    def post_all_gather(
        self,
        tensor: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> Optional[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        q, scale = outputs  # (W * rows, *rest) int8 and (W * rows,) float32, padding rows included
        q2d = q.reshape(q.shape[0], math.prod(q.shape[1:]))
        if out is None:
            full = torch.empty(q.shape, dtype=param_dtype, device=q.device)
            torch.mul(q2d, scale[:, None], out=full.view(q2d.shape))
            return full, (full,)
        # ``out`` is the unsharded parameter (the first rows of the tensor returned the first time),
        # possibly saved by autograd: the refill must not bump its version.
        n = out.shape[0]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            torch.mul(q2d[:n], scale[:n, None], out=out.view(q2d[:n].shape))
        return None
