"""Silent traps around ``fully_shard``, caught at the first optimizer step.

An optimizer built before ``fully_shard``, or while the parameters are unsharded, holds tensors
the model does not train through (raised; FSDP1's ``use_orig_params=True`` registers its
parameters as rebindable: the optimizer's references are swapped for the sharded ones instead).
One that also holds plain parameters no ``fully_shard`` call manages steps them with each rank's
own gradients, so ranks drift apart (warned once per optimizer). One global step pre-hook looks at
each optimizer again only when its parameter count changes.

An optimizer that writes through ``p.data`` changes the shards below every version counter, so a
group holding an unsharded copy across the step (the root after a forward whose backward never ran,
``reshard_after_backward=False``) would not see it: one global step post-hook marks the copies of
the groups the optimizer steps as stale.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.registry import manager_of, unsharded_owner
from . import flat_state

# optimizer -> (its parameter count when checked, the groups of the managed parameters it steps)
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list]]" = weakref.WeakKeyDictionary()
_ignored: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameters the user asked fully_shard to leave alone
# Parameters an optimizer built before sharding may hold and have swapped for their sharded form
# (FSDP1's use_orig_params=True keeps the original objects working).
_rebindable: WeakIdKeyDictionary = WeakIdKeyDictionary()
_installed = False


def install_optimizer_check() -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        register_optimizer_step_post_hook(_mark_copies_stale)
        _installed = True


def register_ignored(params: Any) -> None:
    for p in params or ():
        _ignored[p] = True


def register_rebindable(params: Any) -> None:
    """An optimizer that holds one of ``params`` (as it was before sharding) and has no state for it
    yet gets it swapped for the sharded parameter at its first step, instead of an error."""
    for p in params:
        _rebindable[p] = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():  # a compiled optimizer step: checked by its eager steps only
        return
    count = 0
    for group in optimizer.param_groups:
        count += len(group["params"])
    if (seen := _checked.get(optimizer)) is not None and seen[0] == count:
        return
    managed, plain = [], []
    for p in rebind(optimizer):
        owner = manager_of(p)
        if owner is not None and owner.sharded_param is not p:
            raise RuntimeError(
                f"{type(optimizer).__name__} holds parameter '{owner.path}' as it was before fully_shard, "
                "which replaced it in the model with a sharded DTensor: this optimizer would never train it "
                "(and ranks would drift). Either the optimizer was built before fully_shard, or a module no "
                "fully_shard call covers still holds the original (a weight tied outside every call, e.g. "
                "lm_head.weight = embed.weight with only embed sharded). Fix: build the optimizer after "
                "fully_shard (e.g. torch.optim.AdamW(model.parameters()) once every call has run; with "
                "FSDP1's FullyShardedDataParallel, use_orig_params=True keeps an earlier one working), and "
                "apply fully_shard to the root so every module sharing the weight is covered."
            )
        if owner is None and (gathered := unsharded_owner(p)) is not None:
            _refuse_unsharded(optimizer, gathered)
        if owner is not None:
            managed.append(owner)
        elif not isinstance(p, DTensor) and p not in _ignored:
            plain.append(p)
    _checked[optimizer] = (count, list({id(m.group): m.group for m in managed}.values()))
    flat_state.adopt(optimizer, managed)
    if plain and any(m.info.data_parallel_size > 1 for m in managed):
        shapes = ", ".join(str(tuple(p.shape)) for p in plain[:4]) + (", ..." if len(plain) > 4 else "")
        warnings.warn(
            f"{type(optimizer).__name__} steps {len(plain)} plain parameter(s) (shapes {shapes}) next to "
            "parameters fully_shard manages. No fully_shard call manages them, so their gradients are never "
            "synchronised: each rank updates them with its own gradients and the ranks drift apart. Fix: "
            "apply fully_shard to the root module too (after its blocks), or pass them in ignored_params if "
            "that is what you want.",
            stacklevel=3,
        )


def rebind(optimizer: Any) -> list[Any]:
    """The optimizer's parameters, each rebindable one held as it was before sharding swapped in its
    param group for the sharded parameter, with its state if it has the sharded layout (loaded
    through FSDP1's ``optim_state_dict_to_load``); one with state of another layout stays (refused).
    The first step does it; FSDP1's optimizer-state conversions call it first too."""
    params = []
    for group in optimizer.param_groups:
        held = group["params"]
        for i, p in enumerate(held):
            owner = manager_of(p) if p in _rebindable else None
            if (
                owner is not None
                and owner.sharded_param is not p
                and _state_fits(optimizer, p, owner.sharded_param)
            ):
                held[i] = new = owner.sharded_param
                if p in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(p)
                p = new
            params.append(p)
    return params


def _state_fits(optimizer: torch.optim.Optimizer, old: Any, sharded: DTensor) -> bool:
    for value in optimizer.state.get(old, {}).values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if not isinstance(value, DTensor) or value.shape != sharded.shape:
                return False
            if value.placements != sharded.placements:
                return False
    return True


def _mark_copies_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    seen = _checked.get(optimizer)
    for group in seen[1] if seen is not None else ():
        if group.holds_copy:
            group.needs_sync = True


def _refuse_unsharded(optimizer: torch.optim.Optimizer, owner: Any) -> None:
    raise RuntimeError(
        f"{type(optimizer).__name__} holds parameter '{owner.path}' in its unsharded form, which "
        "fully_shard frees and rebuilds around each use: this optimizer would never train it. It was built "
        "while the parameters were unsharded: after a forward whose backward has not run (the root keeps "
        "its parameters unsharded for that backward), or inside unshard() / unsharded(). Fix: build the "
        "optimizer before the first forward or after backward, or call model.reshard() before building it."
    )
