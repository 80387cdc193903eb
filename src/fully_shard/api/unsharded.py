"""``unsharded(model, writeback=...)``: every parameter full-size inside a ``with`` block (FSDP1's
``summon_full_params``), for evaluation, EMA updates and weight surgery."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.collective import Reason
from ..runtime.param import FSDPParam
from ..runtime.state import FSDPState, fsdp_states


def _states(model: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        state = model.__dict__.get("_fsdp_state")
        if not isinstance(state, FSDPState):
            raise ValueError(
                f"unsharded(recurse=False) got a {type(model).__name__}, which fully_shard was not applied "
                "to; pass a module returned by fully_shard (or recurse=True for every one under it)."
            )
        return [state]
    states = list(fsdp_states([model]))
    if not states:
        raise ValueError(
            f"unsharded() got a {type(model).__name__} with no fully_shard module inside; apply fully_shard "
            "first."
        )
    return states


@contextlib.contextmanager
def unsharded(model: nn.Module, *, writeback: bool = False, recurse: bool = True) -> Iterator[nn.Module]:
    """All-gather every group under ``model`` for the block (``recurse=False``: only ``model``'s own).

    ``writeback=True`` copies the full parameters back into the shards on exit (not if the block
    raises); otherwise changes are dropped. Blocks nest: a group already unsharded when a block
    began stays so. Use under ``torch.no_grad()``: gradients inside the block are not reduced.
    """
    if not isinstance(writeback, bool):
        raise ValueError(f"unsharded(writeback=...) must be True or False, got {writeback!r}.")
    states = _states(model, recurse)
    for state in states:
        state.root_context().attach_active_observers()
    groups = list({id(g): g for s in states for g in s.groups}.values())  # tied groups once
    kept = {id(g) for g in groups if g.is_unsharded and not g.is_stale()}  # unsharded before: stay so
    for group in groups:
        group.unshard(Reason.UNSHARDED_CONTEXT)
    for group in groups:
        group.wait_for_unshard()
        group.pins += 1  # a forward inside the block keeps them unsharded
    gathered = {id(p): _lossy_chunk(p) for g in groups for p in g.params} if writeback else {}
    completed = False
    try:
        yield model
        completed = True
    finally:
        with torch.no_grad():
            for group in groups:
                group.pins -= 1
                if writeback and completed:
                    for p in group.params:
                        _write_back(p, gathered[id(p)])
                if id(group) not in kept:
                    group.reshard()


def _own_chunk(p: FSDPParam) -> torch.Tensor:
    """This rank's chunk of the unsharded parameter (a view)."""
    unsharded = p.unsharded_param
    assert unsharded is not None
    full = unsharded.detach()
    if isinstance(full, DTensor):  # tensor parallel: this rank's TP-local tensor
        full = full.to_local()
    return p.local_chunk(full)


def _lossy_chunk(p: FSDPParam) -> Optional[torch.Tensor]:
    """A copy of this rank's chunk as gathered, where it is not the shard's exact value (a lower
    ``param_dtype``, an extension such as the int8 all-gather); else None."""
    chunk = _own_chunk(p)
    if chunk.dtype == p.local_shard.dtype and p.ext is None:
        return None
    return chunk.clone()


def _write_back(p: FSDPParam, gathered: Optional[torch.Tensor]) -> None:
    """Copy this rank's chunk into the shard; where the gather was lossy (``gathered``), only the
    elements the block changed, so the others keep their exact values."""
    chunk, local = _own_chunk(p), p.local_shard
    if gathered is not None:
        same = (chunk == gathered) | (chunk.isnan() & gathered.isnan())
        chunk = torch.where(same, local, chunk.to(local.dtype))
    # In place, so the version counter moves and no group reuses a copy gathered before the write.
    local.copy_(chunk)
