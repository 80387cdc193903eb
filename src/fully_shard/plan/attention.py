"""Attention in a simulation as the devices run it. ``F.scaled_dot_product_attention`` picks its
kernel by device: a GPU runs a fused one (flash, memory-efficient or cuDNN), and so does a CPU
without dropout, keeping the output and one log-sum-exp per row for backward; the meta device
has only the math path, which materialises the ``S x S`` scores and mask and keeps the
probabilities: at long sequences that is most of the activations (a 2,048-token step of the
example Llama: 2.4x the real peak). Inside `FusedAttentionOnMeta`, attention on meta tensors
runs PyTorch's fused CPU flash kernel instead, whose meta function and backward keep what the
fused kernels keep.

The fused path is taken only for calls a fused kernel takes (4-D query, key and value of one
floating dtype, one head dim, equal batch and heads, a broadcastable mask, not both a mask and
``is_causal``) and while some fused backend is enabled; anything else runs SDPA itself (its math
path, or its error). Grouped-query attention (``enable_gqa``) runs fused on key and value
repeated to the query's heads (a little more than a GQA kernel keeps, far less than ``S x S``);
a boolean mask is converted to the additive float mask SDPA keeps for backward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _sdpa_arguments(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> tuple:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _fused_backend_enabled() -> bool:
    b = torch.backends.cuda
    return b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.cudnn_sdp_enabled()


def _fused_inputs(q: Any, k: Any, v: Any, mask: Any, is_causal: bool, gqa: bool) -> Optional[tuple]:
    """``(key, value, mask)`` as the fused kernel takes them, or None where SDPA itself must run."""
    if not all(type(t) is torch.Tensor and t.is_meta and t.dim() == 4 for t in (q, k, v)):
        return None
    if (
        not q.is_floating_point()
        or not q.dtype == k.dtype == v.dtype
        or not q.size(-1) == k.size(-1) == v.size(-1)
    ):
        return None
    if q.size(0) != k.size(0) or k.shape[:3] != v.shape[:3]:
        return None
    if k.size(1) != q.size(1):
        if not gqa or q.size(1) % k.size(1):
            return None
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if mask is not None:
        if is_causal or type(mask) is not torch.Tensor or not mask.is_meta:
            return None
        try:
            torch.broadcast_shapes(mask.shape, (q.size(0), q.size(1), q.size(2), k.size(2)))
        except RuntimeError:
            return None
        if mask.dtype == torch.bool:  # SDPA keeps the additive float mask for backward
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        elif mask.dtype != q.dtype:
            return None
    return k, v, mask


class FusedAttentionOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors -> the fused flash kernel (see the module
    docstring); any other call runs as it would."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _fused_backend_enabled():
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
            fused = _fused_inputs(q, k, v, mask, is_causal, gqa)
            if fused is not None:
                k, v, mask = fused
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
                )[0]
        return func(*args, **kwargs)
