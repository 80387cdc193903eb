"""FSDP1's ``summon_full_params`` and its training-state rules on the engine: the full parameters
in place inside the block (``fully_shard.unsharded``), the instances inside it marked so that
``named_parameters()`` / ``named_buffers()`` drop the ``_fsdp_wrapped_module.`` segment, and the
errors FSDP1 raises for a summon during forward/backward or inside another summon, and for
``apply()`` inside one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..api.module import engine_state
from ..api.unsharded import unsharded
from ..runtime.lifecycle import IterationPhase, TrainingPhase
from . import state_dict as sd

WRAPPED = "_fsdp_wrapped_module"


def instances(module: nn.Module) -> list[Any]:
    """The FSDP1 instances under ``module`` (itself included)."""
    return [m for m in module.modules() if "_fsdp1_summoning" in m.__dict__]


def busy_with(m: nn.Module) -> str:
    """What FSDP1 would call instance ``m``'s training state, if not IDLE: "" when idle."""
    if m.__dict__["_fsdp1_summoning"]:
        return "SUMMON_FULL_PARAMS"
    state = engine_state(m)
    assert state is not None
    ctx = state.ctx
    if state.phase is not TrainingPhase.IDLE or (
        ctx is not None and ctx.phase in (IterationPhase.BACKWARD, IterationPhase.FINALIZING)
    ):
        return "FORWARD_BACKWARD"
    return ""


def refuse_unless_idle(m: nn.Module, method: str) -> None:
    """FSDP1's ``_assert_state(TrainingState.IDLE)``: a ValueError, in its words, plus the fix."""
    busy = busy_with(m)
    if busy:
        raise ValueError(
            f"expected to be in states [<TrainingState.IDLE: 1>] but current state is TrainingState.{busy}: "
            f"{method}() gathers the full parameters, which is only possible between steps and outside "
            "summon_full_params. Fix: call it after backward, outside the summon_full_params block."
        )


def _refuse_summon(targets: list[nn.Module]) -> None:
    for m in targets:
        busy = busy_with(m)
        if busy == "FORWARD_BACKWARD":
            raise AssertionError(
                "Cannot manually unshard parameters during forward/backward: summon_full_params inside a "
                "forward or a backward hook would free what the step is using. Fix: summon between steps."
            )
        if busy:
            raise AssertionError(
                "Cannot manually unshard parameters when already unsharding parameters: this instance is "
                "already inside a summon_full_params block. Fix: use the outer block's full parameters."
            )


def _roots(module: nn.Module, writeback: bool, rank0_only: bool, offload_to_cpu: bool) -> list[nn.Module]:
    """The instances ``summon_full_params(module, ...)`` gathers (``module`` itself, or the roots
    under it), once its arguments are checked."""
    if rank0_only and writeback:
        raise NotImplementedError(
            "writeback=True and rank0_only=True is not supported yet: parameter shapes differ across ranks "
            "(only rank 0 sees the full ones), so writing them back would leave the ranks inconsistent. "
            "Fix: writeback=False with rank0_only=True."
        )
    found = instances(module)
    roots = [module] if found and found[0] is module else [m for m in found if m.check_is_root()]
    if not roots:
        raise ValueError(
            f"summon_full_params got a {type(module).__name__} with no FullyShardedDataParallel inside."
        )
    if offload_to_cpu and any(p.device.type != "cpu" for r in roots for p in r.parameters()):
        raise ValueError(
            "summon_full_params(offload_to_cpu=True) is not supported on accelerators: the full "
            "parameters stay on the device inside the block. Fix: for a CPU copy, use model.state_dict() "
            "under state_dict_type(FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True))."
        )
    return roots


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """The full parameters in place inside the block (FSDP1's semantics; docs/migrating_from_fsdp1.md)."""
    roots = _roots(module, writeback, rank0_only, offload_to_cpu)
    targets = [m for r in roots for m in (instances(r) if recurse else [r])]
    _refuse_summon(targets)
    with contextlib.ExitStack() as stack:
        if _exposed(targets):  # NO_SHARD: the parameters are the full ones already (FSDP1 shows them)
            for m in targets:  # between forward and backward the places hold the computing copies
                m.reshard()
        elif _mixed_precision(targets):  # FSDP1 shows full precision: gather the shards as they are
            stack.enter_context(_full_precision(targets, writeback, rank0_only, with_grads))
        else:
            for r in roots:
                stack.enter_context(unsharded(r, writeback=writeback, recurse=recurse))
            if rank0_only and dist.get_rank() != 0:  # only rank 0 sees the full parameters
                for m in targets:
                    m.reshard()
            elif with_grads:
                stack.callback(sd.show_full_grads(roots, writeback))
        for m in targets:
            m.__dict__["_fsdp1_summoning"] = True
        try:
            yield
        finally:
            for m in targets:
                m.__dict__["_fsdp1_summoning"] = False


def _params(targets: list[nn.Module]) -> list[Any]:
    """The engine's parameters of ``targets`` (`FSDPParam`), each once, in module order."""
    found: dict[int, Any] = {}
    for m in targets:
        state = engine_state(m)
        assert state is not None
        for group in state.own:
            for p in group.params:
                found.setdefault(id(p), p)
    return list(found.values())


def _exposed(targets: list[nn.Module]) -> bool:
    """NO_SHARD without offload: every parameter is a plain full tensor that the engine computes
    from, so FSDP1 shows it as it is (writes inside are kept, ``writeback`` or not)."""
    return all(p.where.info.plain and not p.where.offload for p in _params(targets))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()  # plain: NO_SHARD's whole tensor


def _mixed_precision(targets: list[nn.Module]) -> bool:
    """Whether some parameter computes in another dtype than it is kept in (not under TP)."""
    params = _params(targets)
    return any(p.dtypes.param != p.dtypes.orig for p in params) and all(p.where.tp is None for p in params)


@contextlib.contextmanager
def _full_precision(
    targets: list[nn.Module], writeback: bool, rank0_only: bool, with_grads: bool
) -> Iterator[None]:
    """Under mixed precision: each parameter all-gathered from its shard in its own dtype and put at
    its places for the block (every rank gathers; with ``rank0_only`` the others keep the shards),
    written back on exit with ``writeback``, the shards put back."""
    for m in targets:
        m.reshard()
    shown = []
    for p in _params(targets):
        sharded = p.sharded_param
        full = nn.Parameter(_full(sharded.detach()), requires_grad=sharded.requires_grad)
        grad = _full(sharded.grad) if with_grads and sharded.grad is not None else None
        if rank0_only and dist.get_rank() != 0:
            continue
        full.grad = grad
        for place in p.places:
            place.set(full)
        shown.append((p, full))
    try:
        yield
    finally:
        for p, full in shown:
            if writeback:
                with torch.no_grad():
                    p.local_shard.copy_(p.local_chunk(full.detach()))
            for place in p.places:
                place.set(p.sharded_param)


def clean_names(m: nn.Module, named: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Inside summon_full_params, names without the ``_fsdp_wrapped_module.`` segments (FSDP1's)."""
    if not m.__dict__.get("_fsdp1_summoning"):
        yield from named
        return
    for name, value in named:
        yield name.replace(WRAPPED + ".", ""), value
