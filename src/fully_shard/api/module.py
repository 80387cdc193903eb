"""`FSDPModule` (the methods a sharded module gains), `UnshardHandle`, `share_comm_ctx`,
`register_fsdp_forward_method`."""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..layouts.mesh import reduce_scatter_group
from ..runtime import comm_buffers, inductor_options, traced
from ..runtime.lifecycle import Event, IterationPhase, TrainingPhase
from ..runtime.param_group import FSDPParamGroup
from ..runtime.registry import class_name
from ..features import finite
from ..runtime.collective import Reason
from ..features.finite import FiniteCheck, NonFinite
from ..runtime.state import FSDPState, SharedComm, fsdp_states


def engine_state(module: nn.Module) -> Optional[FSDPState]:
    """The runtime state of a module ``fully_shard`` / ``replicate`` was applied to, else None: how
    the layers above the API (``fsdp1/``, ``plan/``) reach the engine."""
    state = module.__dict__.get("_fsdp_state")
    return state if isinstance(state, FSDPState) else None


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the unsharded parameters usable."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (``isinstance(m,
    OriginalClass)`` still holds). ``recurse=True`` applies a method to every ``fully_shard`` module
    in this subtree."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing a sharded class builds its original class: a container's slice
        (``self.__class__(...)`` in ``nn.Sequential``) is a plain container of the sharded children.
        With no arguments the object is made here and its class's ``__init__``
        (`_constructing_original`) turns it into the original class; copies and unpickling (no
        ``__init__``) keep the sharded class."""
        if not args and not kwargs:
            return super().__new__(cls)
        original = getattr(cls, "_fsdp_original_class", cls.__bases__[-1])
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> "FSDPModule":
        """An independent sharded module on the same mesh (e.g. an EMA copy; PyTorch refuses). The
        state is copied first, so each parameter is copied its own way (`FSDPParam.__deepcopy__`)."""
        new = super().__new__(type(self))
        memo[id(self)] = new
        state = copy.deepcopy(self.__dict__["_fsdp_state"], memo)
        fields = {k: v for k, v in self.__dict__.items() if k != "_fsdp_state"}
        new.__dict__.update(copy.deepcopy(fields, memo))
        new.__dict__["_fsdp_state"] = state
        return new

    def _get_fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]  # type: ignore[no-any-return]

    def compile(self, *args: Any, collectives: Optional[str] = None, **kwargs: Any) -> None:
        """``nn.Module.compile``, deciding at the first call how: compiled as the whole model (no
        eager step runs around it), the module's own hooks are traced in the same frame as its
        forward (dynamo's ``wrap_top_frame``), so the collectives of its parameters are in that one
        graph too; a block compiled while the eager engine drives the step keeps its hooks outside
        the graph (per-block compile). ``collectives`` (whole model, Inductor): what Inductor may do
        with the graph's collectives, a set of ``torch._inductor.config`` options each, added to
        ``options``: ``"bucket"`` (the default), ``"bucket_all"``, ``"reorder"``, ``"overlap"``
        (GPU), ``"as_traced"`` (none). docs/compile.md."""
        groups = [g for state in self._fsdp_states(True) for g in state.own]
        device_type = self._get_fsdp_state().info.device.type
        whole = inductor_options.compile_options(collectives, kwargs, groups, device_type)
        self._compiled_call_impl = _CompileOnFirstCall(self, args, kwargs, whole)  # type: ignore[assignment]

    def _fsdp_states(self, recurse: bool) -> Iterable[FSDPState]:
        return fsdp_states([self]) if recurse else (self._get_fsdp_state(),)  # type: ignore[list-item]

    def _set_fsdp_settings(self, recurse: bool, **settings: Any) -> None:
        for state in self._fsdp_states(recurse):
            state.update_settings(**settings)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now (the next forward uses them); with ``async_op``
        return a handle to wait on."""
        state = self._get_fsdp_state()
        state.root_context().attach_active_observers()
        for group in state.groups:  # with the groups of tied parameters it uses
            group.unshard(Reason.EXPLICIT)
        handle = UnshardHandle(list(state.groups))
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and point it back at its shards."""
        for group in self._get_fsdp_state().groups:
            group.reshard()

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``to_empty`` / ``to`` / ``cuda`` swap each DTensor's contents in place; then give each new
        local shard padded storage the all-gather can read."""
        self.reshard()
        result = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        for group in self._get_fsdp_state().own:
            with torch.no_grad():
                group.sync_params(adopt_device=True)
            group.needs_sync = True  # extension methods may be set on the new shards before it runs
        return result

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward reduces nothing; gradients accumulate unsharded until a backward with
        ``True`` reduce-scatters them once."""
        value = _check_bool("requires_gradient_sync", requires_gradient_sync)
        self._set_fsdp_settings(recurse, requires_gradient_sync=value)
        if not value:  # what a compiled micro-batch accumulates into (runtime/traced.py)
            for state in self._fsdp_states(recurse):
                traced.prepare_no_sync(state)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: keep the parameters unsharded after backward, so the next forward needs no
        all-gather (until an optimizer step changes them)."""
        value = _check_bool("reshard_after_backward", reshard_after_backward)
        self._set_fsdp_settings(recurse, reshard_after_backward=value)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (see `fully_shard`)."""
        value = _check_bool("reshard_after_forward", reshard_after_forward)
        self._set_fsdp_settings(recurse, reshard_after_forward=value)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False`` (on the root): the coming backward is not the last before the optimizer step,
        so it need not wait for its last reduce-scatter."""
        self._get_fsdp_state().update_settings(
            is_last_backward=_check_bool("is_last_backward", is_last_backward)
        )

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters right after this module's, in its pre-forward."""
        states = _prefetch_states("set_modules_to_forward_prefetch", modules)
        self._get_fsdp_state().update_settings(forward_prefetch=tuple(states))

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters in this module's pre-backward (instead of the
        implicit prefetch)."""
        states = _prefetch_states("set_modules_to_backward_prefetch", modules)
        self._get_fsdp_state().update_settings(backward_prefetch=tuple(states))

    def set_gradient_divide_factor(self, factor: float, *, recurse: bool = True) -> None:
        """Divide reduced gradients by ``factor`` instead of the world size (1.0: plain sum)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise ValueError(
                "set_gradient_divide_factor expects a finite number > 0 (reduced gradients are divided by "
                f"it; 1.0 sums them), got {factor!r}: 0, a negative, inf or NaN would zero, flip or poison "
                "every gradient."
            )
        self._set_fsdp_settings(recurse, gradient_divide_factor=float(factor))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` defers the all-reduce across replicas; the partial sums wait until a
        backward with ``True`` all-reduces them once. No effect on a 1-D mesh."""
        value = _check_bool("requires_all_reduce", requires_all_reduce)
        self._set_fsdp_settings(recurse, requires_all_reduce=value)
        if not value:  # where a compiled backward keeps the deferred sums (runtime/traced.py)
            for state in self._fsdp_states(recurse):
                traced.prepare_deferred_all_reduce(state)

    def set_force_sum_reduction_for_comms(self, enable: bool, *, recurse: bool = True) -> None:
        """``True``: every gradient reduction is a SUM, divided by us before and after (as on backends
        without AVG / PreMulSum). ``False`` (default): NCCL averages fp32 / bf16 in-kernel; gloo
        always sums. Traces record the choice (``CollectiveRecord.reduce_op``)."""
        value = _check_bool("enable", enable)
        self._set_fsdp_settings(recurse, force_sum_reduction=value)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated, as in PyTorch's ``fully_shard``: `set_gradient_divide_factor`."""
        warnings.warn(
            "FSDPModule.set_reduce_scatter_divide_factor is deprecated (as in PyTorch's fully_shard): use "
            "set_gradient_divide_factor.",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters (their input buffers) may be in flight at once; default
        1. With ``k``, a module's reduce-scatter waits for the oldest in flight only once ``k`` are
        pending, so on accelerators an exposed reduce-scatter does not stall the next module's
        backward, at the cost of up to ``k`` gradient buffers alive at once. The root uses the
        largest value among its modules. On CPU the collectives in flight stay bounded by
        `set_collectives_in_flight` (default 0: each completes where it is issued)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers expects an int (how many reduce-scatter input buffers "
                f"may be in flight), got {type(max_input_buffers).__name__}."
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers expects a count >= 1 (1 is the default: one "
                f"reduce-scatter in flight), got {max_input_buffers}."
            )
        if max_input_buffers > 1:
            for state in self._fsdp_states(recurse):
                if any(
                    g.comm_buffers is not None
                    and g.comm_buffers.reduce_scatter is not None
                    and g.comm_buffers.kind == "symm_mem"
                    for g in state.own
                ):
                    raise ValueError(_SYMMETRIC_BUFFERS.format(where=f"'{state.fqn or '<root>'}'"))
        self._set_fsdp_settings(recurse, reduce_scatter_max_input_buffers=max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """``True``: run the gradient reduce-scatters on a process group of their own over the same
        shard ranks, so they can progress beside the all-gathers (a communicator serves its
        collectives one at a time); made here, once per shard group, by its ranks: call it on every
        rank alike. ``False``: back on the shard group. Results are the same to the bit."""
        value = _check_bool("set_separate_reduce_scatter_group(enable)", enable)
        states = list(self._fsdp_states(recurse))
        made = {id(g): reduce_scatter_group(g.info) if value else None for s in states for g in s.own}
        for state in states:  # (every group made first: a failure changes nothing)
            for g in state.own:
                g.separate_rs = made[id(g)]
                if g.comm_buffers is not None:  # its buffers from the reduce-scatter's group now
                    g.comm_buffers = comm_buffers.remake(g.comm_buffers, g.info.group, g.reduce_scatter_group)
            state.update_settings(separate_reduce_scatter=value)

    def set_bucket_bytes(self, nbytes: int) -> None:
        """On the root: consecutive sharded modules share one all-gather and one reduce-scatter while
        what their collectives hold at once (twice the larger of the gathered parameters and the
        gradients to reduce, plus the reduced shard) totals at most ``nbytes``, so a bucket adds at
        most ``nbytes`` to the peak (default 2 MiB; ``0``: off). See docs/design.md, "Bucketing"."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(
                f"set_bucket_bytes expects a byte count >= 0 (0 turns bucketing off), got {nbytes!r}."
            )
        state = self._require_root("set_bucket_bytes")
        state.update_settings(bucket_bytes=nbytes)
        if state.ctx is not None:
            state.ctx.plan_buckets()

    def set_collectives_in_flight(self, n: int) -> None:
        """On the root: how many of its collectives may run at once on CPU backends (gloo), which
        bounds the communication buffers alive together. ``0`` (default): each completes where it
        is issued (least memory). ``1``: a backward all-gather prefetch overlaps compute; each
        collective completes before the next is issued. ``2``: a reduce-scatter also overlaps the
        next module's backward. Accelerators overlap through streams whatever the setting. Roots
        that share a communication context (``share_comm_ctx``) share the limit: set it on each.
        docs/benchmarks.md measures the trade-off (peak memory, step time)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"set_collectives_in_flight expects a count >= 0, got {n!r}.")
        state = self._require_root("set_collectives_in_flight")
        state.update_settings(collectives_in_flight=n)
        if state.ctx is not None:
            state.ctx.comm.set_limit(n)

    def set_grad_finite_check(self, mode: Optional[str]) -> None:
        """On the root. ``"raise"``: if any rank's gradient had a NaN/Inf before the reduction, the
        last backward before the step raises `NonFiniteGradients` on every rank; ``"report"``:
        ``nonfinite_grads()`` lists them instead; ``None``: off (default, unless
        ``FULLY_SHARD_CHECK_FINITE=raise|report``). Costs a pass over each gradient per step."""
        if mode is not None and mode not in ("raise", "report"):
            raise ValueError(f"set_grad_finite_check expects 'raise', 'report' or None (off), got {mode!r}.")
        state = self._require_root("set_grad_finite_check")
        state.update_settings(grad_finite_check="off" if mode is None else mode)
        if state.ctx is not None:
            finite.configure(state.ctx)

    def nonfinite_grads(self) -> list[NonFinite]:
        """On the root, after ``backward()`` with the finite check on: the parameters whose gradients
        had a NaN/Inf, each with its ranks (the same list on every rank; empty when all finite)."""
        state = self._require_root("nonfinite_grads")
        check = state.ctx.gradient_check if state.ctx is not None else None
        if not isinstance(check, FiniteCheck):
            raise RuntimeError(
                "nonfinite_grads(): the finite check is off, so nothing was checked. Fix: call "
                "model.set_grad_finite_check('report') on the root before training (or set "
                "FULLY_SHARD_CHECK_FINITE=report)."
            )
        return list(check.report)

    def _require_root(self, method: str) -> FSDPState:
        state = self._get_fsdp_state()
        if state.ctx is not None and not state.is_root:
            raise ValueError(
                f"{method} on module '{state.fqn}' ({class_name(self)}), which is not a root: it applies to "
                "every module under one root. Fix: call it on the root module "
                f"({class_name(state.ctx.root.modules[0])})."
            )
        return state

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """``True`` (default; PyTorch's is ``False``): reduce every trainable parameter, zeros where
        unused, with a used-count each, so ranks using different parameters (MoE) train exactly.
        ``False``: PyTorch's layout, correct only when every rank uses the same parameters."""
        value = _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        self._set_fsdp_settings(recurse, reduce_unused=value)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Optional[torch.Stream] = None
    ) -> None:
        """Call ``hook(reduce_output)`` after each gradient reduce-scatter (and HSDP all-reduce),
        before the division and accumulation; ``reduce_output`` is this rank's flat gradient shard
        and one used-count per parameter. ``stream`` (accelerator, 1-D mesh): run the hook there."""
        if not callable(hook):
            raise TypeError(
                f"set_all_reduce_hook expects a callable hook(reduce_output), got {type(hook).__name__}."
            )
        state = self._get_fsdp_state()
        groups = self._own_groups("set_all_reduce_hook")
        if stream is not None:
            if state.info.device.type == "cpu":
                raise ValueError(
                    "set_all_reduce_hook(stream=...) needs an accelerator mesh; on CPU there are no streams."
                )
            if any(g.info.is_hsdp for g in groups):
                raise ValueError(
                    "set_all_reduce_hook(stream=...): with HSDP the hook runs where the all-reduce ran; drop "
                    "stream."
                )
        state.update_settings(all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gather this module's parameters with ``comm`` (PyTorch's ``AllGather``: ``allocate(size,
        dtype=, device=)`` and ``__call__(output_tensor=, input_tensor=, group=, async_op=)``)."""
        _check_comm("set_custom_all_gather", comm)
        self._own_groups("set_custom_all_gather")
        self._get_fsdp_state().update_settings(custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (PyTorch's ``ReduceScatter``:
        ``allocate(...)`` and ``__call__(output_tensor=, input_tensor=, group=, op=, async_op=)``)."""
        _check_comm("set_custom_reduce_scatter", comm)
        self._own_groups("set_custom_reduce_scatter")
        self._get_fsdp_state().update_settings(custom_reduce_scatter=comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``True``: this module's all-gather and reduce-scatter staging buffers come from the process
        group backend's own allocator where it has one (NCCL's: zero-copy transfers, e.g. over
        NVLink SHARP); gloo has none, so the caching allocator serves them (said in a warning).
        ``False``: the caching allocator (also undoing `set_symm_mem_for_comm`). Not together with a
        custom all-gather / reduce-scatter. Eager steps: a compiled graph allocates through Inductor."""
        method = "set_allocate_memory_from_process_group_for_comm"
        value = _check_bool(f"{method}(enable)", enable)
        groups = self._own_groups(method)
        state = self._get_fsdp_state()
        if value:
            _refuse_custom(method, state)
        for g in groups:
            rs_group = g.reduce_scatter_group
            g.comm_buffers = comm_buffers.from_process_group(g.info.group, rs_group) if value else None
        state.resolve_schedule()  # a module with a buffer source communicates alone: no bucket
        lacking = sorted({str(g.info.device.type) for g in groups if value and not _has_allocator(g)})
        if lacking:
            backend = dist.get_backend(groups[0].info.group)
            warnings.warn(
                f"fully_shard: {method}(True) on {class_name(self)}: the process group's backend "
                f"({backend}) has no allocator of its own for {', '.join(lacking)} tensors, so the caching "
                "allocator serves the communication buffers, as without it.",
                stacklevel=2,
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Allocate this module's all-gather buffers (and, with `set_force_sum_reduction_for_comms`
        set before, its reduce-scatter's: NCCL's symmetric reduce-scatter only sums) in NCCL
        symmetric memory, registered with every rank of the shard group, for NCCL's symmetric
        all-gather kernels (copy-engine all-gather with ``NCCL_CTA_POLICY=2``). CUDA and NCCL only;
        collective (one barrier): call it on every rank alike. Not together with a custom
        all-gather / reduce-scatter; `set_allocate_memory_from_process_group_for_comm(False)` undoes
        it. Eager steps: a compiled graph allocates through Inductor."""
        method = "set_symm_mem_for_comm"
        if backend != "NCCL":
            raise ValueError(
                f"{method}: the only symmetric memory backend is 'NCCL' (as PyTorch's), got {backend!r}."
            )
        groups = self._own_groups(method)
        state = self._get_fsdp_state()
        _refuse_custom(method, state)
        if state.settings.force_sum_reduction and state.settings.reduce_scatter_max_input_buffers > 1:
            raise ValueError(_SYMMETRIC_BUFFERS.format(where=f"'{state.fqn or '<root>'}'"))
        for g in groups:
            pg_backend = str(dist.get_backend(g.info.group))
            if g.info.device.type != "cuda" or "nccl" not in pg_backend:
                raise ValueError(
                    f"{method} on '{g.fqn or '<root>'}' ({class_name(self)}): symmetric memory needs CUDA "
                    f"devices and an NCCL process group, and this module's mesh is on {g.info.device.type} "
                    f"with {pg_backend}; nothing was changed. Fix: call it only on CUDA/NCCL meshes "
                    "(set_allocate_memory_from_process_group_for_comm works on any backend)."
                )
        for g in groups:
            sum_only = g.settings.force_sum_reduction
            g.comm_buffers = comm_buffers.symmetric(g.info.group, g.reduce_scatter_group, sum_only)
        state.resolve_schedule()  # a module with a buffer source communicates alone: no bucket

    def set_all_gather_codec(
        self,
        codec: Any,
        *,
        params: Optional[Callable[[str, nn.Parameter], bool]] = None,
        recurse: bool = True,
    ) -> list[str]:
        """All-gather chosen parameters through ``codec`` (e.g. `fully_shard.quant.Int8AllGather`), or
        through the plain all-gather again with ``None``; returns the chosen names (relative to self).

        ``codec.pre_all_gather(shard, mesh, outer_size, outer_stride, module, mp_policy)`` returns
        ``(inputs, metadata)``; ``codec.post_all_gather(shard, outputs, metadata, param_dtype, out=None)``
        rebuilds the parameter (docs/extensions.md). A tensor defining ``fsdp_pre/post_all_gather``
        keeps its own. ``params(name, param) -> bool`` chooses (default: floating point, 2+ dims);
        a shard on another dim or a non-float parameter is refused with nothing changed.
        """
        _check_codec_args(codec, params)
        chosen = _codec_choice(self, params, recurse)
        if codec is not None:
            _refuse_codec_misfits([(n, fp) for fp, n, _ in chosen])
        for state in {id(s): s for _, _, s in chosen}.values():
            names = {fp.fqn for fp, _, s in chosen if s is state}
            kept = tuple((n, c) for n, c in state.settings.codecs if n not in names)
            added = tuple((n, codec) for n in sorted(names)) if codec is not None else ()
            state.update_settings(codecs=kept + added)
        return [name for _, name, _ in chosen]

    def _own_groups(self, method: str) -> list[FSDPParamGroup]:
        """This call's groups (one per mesh), refusing a module that manages no parameters."""
        groups = self._get_fsdp_state().own
        if not groups:
            raise ValueError(f"{method} on {class_name(self)}, which manages no parameters of its own.")
        return groups

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not all-gather this module's parameters for backward (for modules whose
        backward does not read them, e.g. an embedding lookup)."""
        value = _check_bool("unshard_in_backward", unshard_in_backward)
        self._get_fsdp_state().update_settings(unshard_in_backward=value)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """On the root, accelerators: the next forward's first all-gather waits for ``event`` (recorded
        after the optimizer step) instead of the whole compute stream. Ignored on CPU."""
        if not isinstance(event, torch.Event):
            raise TypeError(f"set_post_optim_event expects a torch.Event, got {type(event).__name__}.")
        self._get_fsdp_state().post_optim_event = event

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, plus what it cannot see: gradients accumulated unsharded without
        sync and HSDP partial sums deferred by ``set_requires_all_reduce(False)``, which would
        otherwise join the next syncing reduction."""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        for state in self._fsdp_states(recurse=True):
            for g in state.own:
                g.discard_unsharded_grads()
            if state.ctx is not None and state.is_root:
                state.ctx.unsynced_backwards = 0

    def reduce_grads(self) -> None:
        """Finish a backward by hand: reduce-scatter (and, with HSDP, all-reduce) every gradient
        accumulated without sync on the unsharded parameters under this root, whatever
        ``set_requires_gradient_sync`` says, wait for the reductions, and reshard. For loops and
        pipeline schedules that end an accumulation window without one more synced
        ``loss.backward()`` (e.g. a split backward whose weight pass runs outside autograd's
        callbacks; `fully_shard.pipelining.PipelineStage` calls it). Call it on the root after the
        step's last backward, before ``optimizer.step()``; with nothing accumulated it issues no
        collective and only reshards."""
        state = self._get_fsdp_state()
        if state.ctx is None:  # no forward yet: nothing accumulated, nothing gathered
            return
        if not state.is_root:
            raise RuntimeError(
                f"fully_shard: reduce_grads() was called on {state.name()}, which is not a root (its "
                f"root is {state.ctx.root.name()}): a root reduces its whole tree at once. Fix: call "
                "reduce_grads() on the root module."
            )
        ctx = state.root_context()
        inside = "a backward" if ctx.phase in (IterationPhase.BACKWARD, IterationPhase.FINALIZING) else None
        if inside is None and any(s.phase is TrainingPhase.FORWARD for s in ctx.states):
            inside = "a forward"
        if inside is not None:
            raise RuntimeError(
                f"fully_shard: reduce_grads() was called on {ctx.name()} inside {inside}, whose "
                "gradients are not all made yet. Fix: call it after the step's last backward has "
                "returned (after loss.backward(), or the pipeline schedule's step), before optimizer.step()."
            )
        ctx.handle(Event.REDUCE_GRADS)

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: reshard every module under this root and drop
        the failed iteration's unreduced gradients (``.grad`` stays)."""
        state = self._get_fsdp_state()
        if state.ctx is not None:
            state.ctx.handle(Event.RESET)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. one rank's pipeline stages) share one communication context: the
    streams, the CPU collectives in flight (and their limit) and the trace. Call before their first
    forward."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(
            f"share_comm_ctx expects a list of fully_shard root modules, got {type(modules).__name__}."
        )
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"share_comm_ctx got a {class_name(m)}, which fully_shard was not applied to; pass the root "
                "modules."
            )
        state = m._get_fsdp_state()
        if state.ctx is not None:
            raise ValueError(
                f"share_comm_ctx: {class_name(m)} already ran (its communication context exists). Fix: call "
                "share_comm_ctx before the first forward of any of these modules."
            )
        states.append(state)
    shared = SharedComm()
    for state in states:
        state.shared_comm = shared


def _check_comm(method: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} expects a comm object with allocate(size, *, dtype, device) and __call__ (PyTorch's "
            f"FSDP2 AllGather / ReduceScatter comm interface), got {type(comm).__name__}."
        )


def _has_allocator(g: FSDPParamGroup) -> bool:
    return g.info.world_size == 1 or comm_buffers.has_allocator(g.info.group, g.info.device)


def _refuse_custom(method: str, state: FSDPState) -> None:
    s = state.settings
    if s.custom_all_gather is not None or s.custom_reduce_scatter is not None:
        raise ValueError(
            f"{method} on '{state.fqn or '<root>'}': this module has a custom all-gather / reduce-scatter "
            "(set_custom_all_gather / set_custom_reduce_scatter), which allocates its own buffers; the two "
            "cannot be used together (as in PyTorch's fully_shard); nothing was changed. Fix: allocate in "
            "the custom comm's allocate(), or do not set a custom comm on this module."
        )


_SYMMETRIC_BUFFERS = (
    "fully_shard: module {where}: set_reduce_scatter_max_input_buffers(> 1) with a reduce-scatter in NCCL "
    "symmetric memory (set_symm_mem_for_comm with set_force_sum_reduction_for_comms(True)): each buffer "
    "in flight would hold its own symmetric segment, which can exhaust symmetric memory (PyTorch's "
    "fully_shard refuses it too); nothing was changed. Fix: keep max_input_buffers at 1 on this module, "
    "or set symmetric memory without force-sum reductions (the all-gather only)."
)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def _prefetch_states(method: str, modules: list[Any]) -> list[FSDPState]:
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method} got a {type(m).__name__}, which fully_shard was not applied to; pass modules "
                "returned by fully_shard (the ones whose parameters should be all-gathered early)."
            )
        states.append(m._get_fsdp_state())
    return states


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` unshard and reshard like ``forward`` does (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        raise ValueError(
            "register_fsdp_forward_method needs a module fully_shard was applied to, got "
            f"{type(module).__name__}."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method '{method_name}' to register.")
    module.__dict__[method_name] = _ForwardMethod(module, method, module._get_fsdp_state())


class _CompileOnFirstCall:
    """What ``FSDPModule.compile`` installs: compiles ``_call_impl`` at the first call, in the way
    that call needs (`FSDPModule.compile`). An object, so a deepcopy rebinds it to the copy."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, whole_model_kwargs: dict) -> None:
        self.module, self.args, self.kwargs, self.whole_model_kwargs = (
            module,
            args,
            kwargs,
            whole_model_kwargs,
        )
        self.compiled: Optional[Callable[..., Any]] = None
        self.whole = False  # compiled as the whole model (decided at the first call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            import torch._dynamo

            ctx = self.module._get_fsdp_state().ctx  # type: ignore[attr-defined]
            eager_around = ctx is not None and ctx.root.phase is TrainingPhase.FORWARD
            how = self.kwargs if eager_around else self.whole_model_kwargs
            self.whole = not eager_around
            with torch._dynamo.config.patch(wrap_top_frame=not eager_around):
                self.compiled = torch.compile(self.module._call_impl, *self.args, **how)
        if self.whole:  # the whole model traced: refused here, with the message (`traced`; once
            # per grad mode, then a lookup)
            traced.refuse_untraceable_tree(self.module._get_fsdp_state())  # type: ignore[attr-defined]
        try:
            return self.compiled(*args, **kwargs)
        except AssertionError as e:
            traced.explain_saved_state_failure(e, class_name(self.module))
            raise


class _ForwardMethod:
    """A registered method run between the pre- and post-forward hooks. An object, not a closure,
    so ``copy.deepcopy`` rebinds it to the copy's parameters."""

    def __init__(self, module: nn.Module, method: Callable[..., Any], state: FSDPState) -> None:
        self.module = module
        self.method = method
        self.state = state
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.state.pre_forward(self.module, args, kwargs)
        return self.state.post_forward(self.module, args, self.method(*args, **kwargs))


@functools.cache
def _sharded_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):  # a class that carries the methods itself (FSDP1's wrapper)
        return cls
    return _mixed_class("FSDP", FSDPModule, cls)


def _mixed_class(prefix: str, mixin: type, cls: type) -> type:
    name = f"{prefix}{cls.__name__}"
    attrs = {
        "__module__": cls.__module__,
        "_fsdp_original_class": cls,
        "__init__": _constructing_original(cls),
        "forward": _ending_traced_forward(cls, name),
    }
    return type(name, (mixin, cls), attrs)


def _constructing_original(cls: type) -> Callable[..., None]:
    """``__init__`` for the class `fully_shard` gives a ``cls`` module. Python runs it only on an
    object `FSDPModule.__new__` made (a constructor call without arguments, ``type(block)()``; a
    copy or an unpickled module runs none): that object becomes a ``cls`` initialised by ``cls``,
    as with arguments (was: a sharded-class module with no state, whose ``FSDPModule`` methods
    raised ``KeyError: '_fsdp_state'``). On a module that has its state (``module.__init__()``
    called again) it is ``cls.__init__``, as before. ``inspect.signature`` reads ``cls``'s."""

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if "_fsdp_state" not in self.__dict__:
            object.__setattr__(self, "__class__", cls)
        cls.__init__(self, *args, **kwargs)

    functools.update_wrapper(__init__, cls.__init__, updated=())
    return __init__


def _ending_traced_forward(cls: type, name: str) -> Callable[..., Any]:
    """A forward for the class `fully_shard` gives a ``cls`` module: ``cls``'s, then, in a trace,
    `traced.forward_returned`: under ``torch.compile(model)`` the root's hooks and its forward are
    frames of their own, and the parameters its forward gathered, still held on its state when
    that frame ends, would leave the graph as outputs (a DTensor or tensor-subclass one then fails
    AOTAutograd's backward). In the class's namespace, so that a base class wrapping its
    subclasses' forward (transformers' gradient checkpointing layers) wraps this one; a code
    object of its own, so that dynamo keeps each class's compiled frames apart (its cache and
    recompile limit are per code object); ``inspect.signature`` reads ``cls``'s."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = super(FSDPModule, self).forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            traced.forward_returned(self.__dict__["_fsdp_state"])
        return output

    # (``__wrapped__``, name and doc; not ``cls.forward``'s ``__dict__``: dynamo's marks there,
    # ``@torch.compile``'s or ``@torch.compiler.disable``'s, would make it trace past this forward)
    functools.update_wrapper(forward, cls.forward, updated=())
    code = forward.__code__  # (co_qualname: Python 3.11+; replace() makes a new code object either way)
    forward.__code__ = (
        code.replace(co_qualname=f"{name}.forward") if sys.version_info >= (3, 11) else code.replace()
    )
    return forward


class ReplicateModule(FSDPModule):
    """Mixed into the class of every module `replicate` was applied to."""


@functools.cache
def _replicated_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    return _mixed_class("Replicate", ReplicateModule, cls)


def _check_codec_args(codec: Any, params: Any) -> None:
    if codec is not None and not (
        callable(getattr(codec, "pre_all_gather", None)) and callable(getattr(codec, "post_all_gather", None))
    ):
        raise TypeError(
            "set_all_gather_codec expects a codec with pre_all_gather and post_all_gather methods (or "
            f"None), got {type(codec).__name__}. Fix: pass e.g. fully_shard.quant.Int8AllGather()."
        )
    if params is not None and not callable(params):
        raise TypeError(
            f"set_all_gather_codec(params=...) expects a callable (name, param) -> bool, got {params!r}."
        )


def _codec_choice(module: FSDPModule, params: Any, recurse: bool) -> list[tuple[Any, str, FSDPState]]:
    """``(FSDPParam, name relative to module, state)`` for each parameter ``params`` chooses."""
    prefix = {id(p): n for n, p in module.named_parameters()}  # type: ignore[attr-defined]
    chosen: list[tuple[Any, str, FSDPState]] = []
    for state in module._fsdp_states(recurse):
        for fp in (p for g in state.own for p in g.params):
            name = prefix.get(id(fp.sharded_param), fp.fqn)
            if params is None:  # the parameter's own dims (a FlatShard one is 1-D between steps)
                if fp.sharded_param.is_floating_point() and len(fp.shape) >= 2:
                    chosen.append((fp, name, state))
            elif params(name, fp.sharded_param):
                chosen.append((fp, name, state))
    if not chosen:
        raise ValueError(
            f"set_all_gather_codec on {class_name(module)} chose no parameter: "
            + (
                "the params filter accepted none of them. "
                if params is not None
                else "no floating-point parameter with 2 or more dims is managed here. "
            )
            + "Fix: call it on a module whose fully_shard parameters include weights, or pass params=."
        )
    return chosen


def _refuse_codec_misfits(chosen: list[tuple[str, Any]]) -> None:
    """A codec gathers floating-point dim-0 shards: refuse any other chosen parameter, by name."""
    bad = [(n, fp) for n, fp in chosen if fp.shard_dim != 0 or not fp.dtype.is_floating_point]
    if bad:
        name, fp = bad[0]
        why = (
            f"is sharded {'flat' if fp.shard_dim < 0 else f'on dim {fp.shard_dim}'} "
            "(codecs gather dim-0 shards)"
            if fp.shard_dim
            else f"has dtype {fp.dtype}"
        )
        raise ValueError(
            f"set_all_gather_codec: parameter '{name}' {why}; nothing was changed. Fix: leave it out "
            "with params=lambda name, p: ... (the default takes every floating-point parameter of "
            "2+ dims)."
        )
