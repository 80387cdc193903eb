"""Quantized weight all-gather (ZeRO++'s qwZ, per row): the all-gather carries int8 values and
one scale per row instead of the weights, and each rank dequantizes what arrived.

    from fully_shard.quant import Int8AllGather
    model.set_all_gather_codec(Int8AllGather())   # every FSDP module under model; weights (2-D+)

What changes and what does not:

* Each rank quantizes its own shard just before the all-gather: per dim-0 row ``r``,
  ``scale_r = max|w_r| / 127`` and ``q = round(w / scale_r)`` in int8. The all-gather moves
  ``q`` (1 byte per element) and the scales (4 bytes per row): about 1/4 of float32's bytes,
  1/2 of bfloat16's.
* The unsharded weight forward and backward compute with is ``q * scale`` in the compute dtype
  (``MixedPrecisionPolicy.param_dtype``, else the parameter's): each element is within
  ``scale_r / 2 = max|w_r| / 254`` of the weight.
* Master weights, gradients and optimizer state are untouched: the shard stays full precision,
  the gradient (with respect to the dequantized weight, as ZeRO++ does) is reduce-scattered in
  full precision, and the optimizer updates the full-precision shard. Quantization error does
  not accumulate across steps; it is a fresh rounding of the current weights at each all-gather.
* Biases, norms and other 1-D parameters are left alone by default (a scale per element would
  cost more than it saves).

Gradients are not quantized: a quantized reduce-scatter sums rounding errors over ranks into the
update itself (ZeRO++'s qgZ needs error feedback to converge); use ``set_custom_reduce_scatter``
for experiments with it.
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
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale works
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
        # ``out`` is the unsharded parameter: the first rows of the tensor returned the first time,
        # whose memory fully_shard gave back before this call. Autograd may have saved it, so the
        # refill must not bump its version.
        n = out.shape[0]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            torch.mul(q2d[:n], scale[:n, None], out=out.view(q2d[:n].shape))
        return None
