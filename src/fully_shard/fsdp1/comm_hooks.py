"""FSDP1's ``register_comm_hook`` with PyTorch's default hooks, mapped onto the engine: the
reduction hooks are the default reduction; the compression hooks reduce in fp16 / bf16 (the
gradient is cast, reduced and cast back, as those hooks do). Any other hook is refused."""

from __future__ import annotations

from typing import Any, Optional

import torch

_DEFAULT_HOOKS = "torch.distributed.algorithms._comm_hooks.default_hooks"
_DTYPES: dict[str, Optional[torch.dtype]] = {
    "allreduce_hook": None,
    "reduce_scatter_hook": None,
    "fp16_compress_hook": torch.float16,
    "bf16_compress_hook": torch.bfloat16,
}


def comm_hook_dtype(hook: Any) -> Optional[torch.dtype]:
    """The reduce dtype a default hook stands for (None: the default reduction)."""
    name = getattr(hook, "__name__", None)
    if getattr(hook, "__module__", None) == _DEFAULT_HOOKS and name in _DTYPES:
        return _DTYPES[name]
    raise TypeError(
        f"register_comm_hook got {hook!r}; only PyTorch's default FSDP hooks ({', '.join(_DTYPES)} from "
        f"{_DEFAULT_HOOKS}) map onto this engine. Fix: for another reduction use the module's "
        "set_custom_reduce_scatter(comm) (the collective) or set_all_reduce_hook(hook) (after it)."
    )
