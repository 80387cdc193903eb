"""Optimizer state of `FlatShard` parameters, shown in the default layout's form.

The optimizer steps a flat-sharded parameter as the 1-D DTensor it is between steps, so its state
(AdamW's ``exp_avg``, ...) is 1-D too. ``optimizer.state_dict()`` shows each such tensor as the
default layout would hold it (the parameter's own shape, ``Shard(0)``) and
``optimizer.load_state_dict()`` takes that form back (or a full tensor, or the 1-D form), so
optimizer checkpoints (``get_optimizer_state_dict`` / DCP / ``set_optimizer_state_dict``)
interchange with the default layout and across world sizes, as the model's do (`layouts.flat`).

The hooks go on each optimizer at its first step (the global step pre-hook of `traps` sees every
optimizer; torch's ``get/set_optimizer_state_dict`` step a fresh optimizer first). State loaded
before that first step, in the default layout's form, is taken to the flat form there. Each
conversion gathers the parameter's state tensor once: with flat-sharded parameters,
``optimizer.state_dict()`` and ``load_state_dict()`` are collectives (call them on every rank).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..layouts import flat
from ..runtime.state import flat_param, is_flat

# optimizers whose state dicts convert (their hooks are installed)
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def adopt(optimizer: torch.optim.Optimizer, managed: list[Any]) -> None:
    """Called with the managed parameters an optimizer steps, at its first step (and when its
    parameter count changes): install the conversions if any is flat-sharded, and take state
    loaded in the default layout's form to the flat one."""
    flats = [fp for fp in managed if is_flat(fp)]
    if not flats:
        return
    if optimizer not in _hooked:
        optimizer.register_state_dict_post_hook(_saving)
        optimizer.register_load_state_dict_pre_hook(_loading)
        _hooked.add(optimizer)
    for fp in flats:
        state = optimizer.state.get(fp.sharded_param)
        if state:
            for key, value in list(state.items()):
                state[key] = flat.convert_value(value, fp, saving=False)


def _saving(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    return flat.convert_optimizer_state(optimizer, state_dict, flat_param, saving=True)


def _loading(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    return flat.convert_optimizer_state(optimizer, state_dict, flat_param, saving=False)
