"""Attention in a simulation as the devices run it. ``F.scaled_dot_product_attention`` picks its
kernel by device: a CPU or GPU runs a fused one (flash, memory-efficient or cuDNN) that keeps
the output and one log-sum-exp per row for backward, while the meta device has only the math
path, which materialises the ``S x S`` scores and mask and keeps the probabilities: at long
sequences that is most of the activations (a 2,048-token step of the example Llama: 2.4x the
real peak). Inside `FusedAttentionOnMeta`, attention on meta tensors runs PyTorch's fused CPU
flash kernel instead, whose meta function and backward keep what the fused kernels keep.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _sdpa_arguments(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> tuple:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class FusedAttentionOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on plain meta tensors -> the fused flash kernel (see the
    module docstring). Anything else (real tensors, DTensors, grouped-query attention that needs
    ``enable_gqa``) runs as it would."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
            plain = all(type(t) is torch.Tensor and t.is_meta and t.dim() == 4 for t in (q, k, v))
            if plain and not gqa and (mask is None or (type(mask) is torch.Tensor and mask.is_meta)):
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
                )[0]
        return func(*args, **kwargs)
