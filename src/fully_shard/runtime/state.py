"""`FSDPState` (one per ``fully_shard`` call) and `RootContext` (one per root, made at its first
forward): the hooks that drive groups through forward and backward.

Each hook reports one event; the tables at the bottom decide what runs (`MODULE` for a module,
`ITERATION` for a root's iteration). Module hooks run eagerly outside ``torch.compile``:

* forward pre-hook  -> `FSDPState.pre_forward`: FORWARD (or RECOMPUTE inside backward)
* forward hook      -> `FSDPState.post_forward`: FORWARD_DONE (or RECOMPUTE_DONE)
* output grad hook  -> `FSDPState.pre_backward`: PRE_BACKWARD
* input grad signal -> `FSDPState.post_backward_signal`: SIGNAL
* engine callback   -> `RootContext.handle(BACKWARD_END)`: every module's BACKWARD_END
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import deque
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from . import watchdog
from .bucket import Bucket, plan_buckets
from .collective import ACTIVE_OBSERVERS, CollectiveObserver, Reason
from .comm import CommContext
from .copying import copy_fields, refuse_busy
from ..layouts.mesh import MeshInfo, post_forward_groups
from ..layouts.policy import MixedPrecisionPolicy
from ..layouts import flat
from .registry import class_name, manager_of, unsharded_owner
from .settings import Settings
from .lifecycle import Entry, Event, IterationPhase, ModuleEvent, Step, TrainingPhase, step_for
from .param_group import FSDPParamGroup, ReduceScatterResult


class StepVerdict(RuntimeError):
    """A check's verdict on a step (e.g. `NonFiniteGradients`), raised once the step's work is done."""


class GradientCheck(Protocol):
    """Sees each gradient before its reduction; concludes (and may raise a `StepVerdict`) at the end
    of the last backward before the optimizer step."""

    def observe(self, p: Any, grad: torch.Tensor) -> None: ...

    def conclude(self) -> None: ...


_EAGER_PHASES = (IterationPhase.BACKWARD, IterationPhase.FINALIZING)


class RootContext:
    """Per-root runtime state shared by every `FSDPState` under one root module."""

    def __init__(self, root: "FSDPState", states: list["FSDPState"], comm: CommContext) -> None:
        self.root = root
        self.states = states
        self.comm = comm
        self.post_forward_order: list[FSDPState] = []
        self.phase = IterationPhase.IDLE
        # An eager step runs around a compiled call: the root's forward is running, or a backward
        # (per-block compile; a recompute). One attribute (`traced.traced_here` reads only it): one
        # guard, the same value in a forward and in a recompute, so a block's graph serves both.
        self.eager_around = False
        # reductions in flight, oldest first: at most the largest `reduce_scatter_max_input_buffers`
        self.pending_reduces: deque[ReduceScatterResult] = deque()
        self.reductions_limit = 1  # how many may be in flight: `note_reductions_limit`
        self.note_reductions_limit()
        self.buckets: list[Bucket] = []
        self.gradient_check: Optional[GradientCheck] = None  # set by the check itself (finite.py)
        self.unsynced_backwards = 0  # backwards run without gradient sync since the last synchronised one

    def name(self) -> str:
        return f"root {class_name(self.root.modules[0])}"

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """The input and output of the reduction in flight ("communication")."""
        return [
            ("communication", t)
            for result in self.pending_reduces
            for part in result.parts
            for t in (*part.pending.keep_alive, part.output)
        ]

    def describe(self) -> list[str]:
        """What this root is doing, for the watchdog."""
        reducing = "".join(f", reduction in flight: {r.parts[0].name}" for r in self.pending_reduces)
        lines = [f"{self.name()}: iteration {self.phase.name}{reducing}"]
        for s in self.states:
            groups = "".join(
                f", group {g.sharded_state.name}"
                + (", all-gather in flight" if g._all_gather is not None else "")
                for g in s.own
            )
            lines.append(f"  module '{s.fqn or '<root>'}': {s.phase.name}{groups}")
        for b in self.buckets:
            if b.holds_grads:
                lines.append(f"  bucket {b.name}: gradients waiting for its reduce-scatter")
        return lines

    def plan_buckets(self) -> None:
        """Cut the groups under this root into buckets by the root's byte budget (bucket.py)."""
        if self.pending_reduces or any(b.holds_grads for b in self.buckets):
            raise RuntimeError(
                f"fully_shard: set_bucket_bytes on {class_name(self.root.modules[0])} while gradients are "
                "being reduced; call it between steps (after backward)."
            )
        owner = {id(s.group): s for s in self.states if s.group is not None}
        lent = {id(g) for s in self.states for g in s.borrowed}
        candidates = [
            s.group if s.may_share_collectives() and id(s.group) not in lent else None for s in self.states
        ]
        self.buckets = plan_buckets(
            candidates, self.root.settings.bucket_bytes, lambda g: owner[id(g)].default_schedule
        )

    def handle(self, event: Event) -> None:
        step = ITERATION.get((self.phase, event))
        if step is None:
            step_for(ITERATION, self.phase, event, self.name)  # raises, naming both
        assert isinstance(step, Step)  # the iteration's table has no guarded entries
        self.phase = step.to
        try:
            if step.action is not None:
                step.action(self)
        except StepVerdict:  # raised once the step's work is done
            if step.then is not None:
                self.phase = step.then
            raise
        finally:
            self.note_phases()
        if step.then is not None:
            self.phase = step.then
            self.note_phases()

    def note_phases(self) -> None:
        """Update `eager_around` from the iteration's phase and the root's."""
        self.eager_around = self.root.phase is TrainingPhase.FORWARD or self.phase in _EAGER_PHASES

    def start_iteration(self) -> None:
        """A root forward starts: notice changes made between steps (`notice_changes`); hook up
        the traces opened around it."""
        for state in self.states:
            for g in state.own:
                g.notice_changes()
        if ACTIVE_OBSERVERS.get():
            self.attach_active_observers()
        for o in self.comm.observers:
            o.begin_step()

    def attach_active_observers(self) -> None:
        """In the user's thread: its open traces (``fully_shard.debug.trace()``) watch this root's
        collectives from now on, on every thread."""
        for o in ACTIVE_OBSERVERS.get():
            if o not in self.comm.observers:
                self.comm.observers.append(o)
            o.attach(self)

    def detach(self, observer: CollectiveObserver) -> None:
        """``observer`` (a trace that ended) stops watching this root."""
        if observer in self.comm.observers:
            self.comm.observers.remove(observer)

    def recover_and_start(self) -> None:
        warnings.warn(
            f"fully_shard: the previous backward through {class_name(self.root.modules[0])} did not finish "
            "(it raised); resetting its state and discarding its unreduced gradients. Gradients it had "
            "already reduced are still in .grad: call optimizer.zero_grad() before the next step (and call "
            "reset_iter_state() yourself after catching such an exception to silence this).",
            stacklevel=4,
        )
        self.reset_failed_backward()
        self.start_iteration()

    def begin_backward(self) -> None:
        """Have autograd call us when this backward ends."""
        Variable._execution_engine.queue_callback(lambda: self.handle(Event.BACKWARD_END))

    def reduce(self, issue: Callable[[], list[ReduceScatterResult]]) -> None:
        """Run ``issue`` (which issues reduce-scatters) once fewer than the limit are in flight, and
        keep what it issued in flight. By default one at a time: the previous one is waited for
        (on accelerators, the compute stream waits for its event) before the next one's input is
        made, so one gradient buffer is in flight while the next module's backward computes.
        `set_reduce_scatter_max_input_buffers(k)`: up to k."""
        pending, limit = self.pending_reduces, self.reductions_limit
        while len(pending) >= limit:
            pending.popleft().finish()
        for result in issue():
            while len(pending) >= limit:  # (a call that issued several)
                pending.popleft().finish()
            pending.append(result)

    def note_reductions_limit(self) -> None:
        """The largest `reduce_scatter_max_input_buffers` of the root's modules (read once per
        change, not per reduction)."""
        self.reductions_limit = max(s.settings.reduce_scatter_max_input_buffers for s in self.states)

    def finish_pending_reduce(self) -> None:
        """Wait for every reduction in flight, oldest first."""
        pending = self.pending_reduces
        while pending:
            pending.popleft().finish()

    def backward_prefetch_target(self, state: "FSDPState") -> Optional["FSDPState"]:
        """The state whose forward ran just before ``state``'s (next in backward). Consumes ``state``'s
        latest entry, so a module run twice in forward prefetches right for each backward."""
        order = self.post_forward_order
        for i in range(len(order) - 1, -1, -1):
            if order[i] is state:
                del order[i]
                return order[i - 1] if i > 0 else None
        return None

    def finish_backward(self) -> None:
        """Reduce what the post-backward signals missed; after the last backward before the
        optimizer step, wait for every reduction."""
        with record_function("FSDP::backward_end"):
            synced = all(s.settings.requires_gradient_sync for s in self.states if s.own)
            self.unsynced_backwards = 0 if synced else self.unsynced_backwards + 1
            for state in self.states:
                state.finish_backward()
            for bucket in self.buckets:  # gradients of members whose bucket-mates did not run
                self.reduce(functools.partial(bucket.flush, Reason.END_OF_BACKWARD))
            # Micro-batching: not the last backward, so leave the last reduce-scatter in flight.
            if self.root.settings.is_last_backward:
                self.conclude_backward()

    def reduce_grads(self) -> None:
        """`FSDPModule.reduce_grads`: what the end of a synced last backward does, without one:
        every module reduces what accumulated on its unsharded parameters and reshards; wait."""
        with record_function("FSDP::reduce_grads"):
            for state in reversed(self.states):  # backward's order: a bucket issues at its last member
                state.reduce_by_hand()
            for bucket in self.buckets:
                self.reduce(functools.partial(bucket.flush, Reason.REDUCE_GRADS))
            self.unsynced_backwards = 0
            self.conclude_backward()

    def conclude_backward(self) -> None:
        """After the last backward before the optimizer step: every reduction landed, low-precision
        and offloaded gradients where the optimizer reads them, the gradient check's verdict."""
        self.finish_pending_reduce()
        self.post_forward_order.clear()
        for state in self.states:
            if state.settings.keep_low_precision_grads:
                for g in state.own:
                    g.lower_grads()
        for state in self.states:  # offloaded .grad must be on the host for the optimizer
            for g in state.own:
                if g.offload_events:
                    g.wait_for_offloaded_grads()
        if self.gradient_check is not None:
            self.gradient_check.conclude()

    def reset_iteration(self) -> None:
        """Forget a forward that raised: reshard everything. It made no gradient, so those of earlier
        micro-batches stay (accumulated without sync, or still being reduced)."""
        self.finish_pending_reduce()
        for state in self.states:
            state.reset()
        self.post_forward_order.clear()

    def reset_failed_backward(self) -> None:
        """Forget a backward that raised: reshard everything and drop every unreduced gradient.
        Autograd had added part of the failed micro-batch's gradients in place to those accumulated
        without sync since the last synchronised backward: they cannot be told apart, so the whole
        accumulation window goes (said in a warning)."""
        while self.pending_reduces:
            for part in self.pending_reduces.popleft().parts:
                part.pending.discard()  # let the collective land before dropping its buffers
        for bucket in self.buckets:
            bucket.discard()
        dropped = False
        for state in self.states:
            state.reset()
            for g in state.own:
                dropped = g.discard_unsharded_grads() or dropped
        self.post_forward_order.clear()
        if self.unsynced_backwards and dropped:
            warnings.warn(
                f"fully_shard: the backward that raised came after {self.unsynced_backwards} backward(s) "
                "whose gradients were accumulated without gradient sync (set_requires_gradient_sync(False)), "
                "and autograd had already added part of its own gradients to theirs: all are dropped, so the "
                "next synchronised backward reduces only the micro-batches from here on. Fix: run the "
                "earlier micro-batches of this step again, or skip the step (optimizer.zero_grad()).",
                stacklevel=5,
            )
        self.unsynced_backwards = 0


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in ``tree`` to ``dtype`` (differentiably)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tree_map_only(torch.Tensor, cast, tree)


class _PostBackwardSignal(torch.autograd.Function):
    """Forward: passes the module's tensor inputs through. Backward: runs once their gradients exist,
    i.e. after all of the module's parameter gradients for this forward; calls
    ``state.post_backward_signal()``."""

    @staticmethod
    def forward(  # type: ignore[override]
        fn_ctx: Any, state: "FSDPState", *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        fn_ctx.state = state
        return inputs

    @staticmethod
    def backward(  # type: ignore[override]
        fn_ctx: Any, *grads: torch.Tensor
    ) -> tuple[Optional[torch.Tensor], ...]:
        fn_ctx.state.post_backward_signal()
        return (None, *grads)


class SharedComm:
    """`share_comm_ctx`: one `CommContext` for several roots (e.g. one rank's pipeline stages)."""

    def __init__(self) -> None:
        self.comm: Optional[CommContext] = None

    def get(self, device: torch.device, limit: int, root: str) -> CommContext:
        """The shared context; the first root to start sets its in-flight limit, the rest match it."""
        if self.comm is None:
            self.comm = CommContext(device)
            self.comm.set_limit(limit)
        elif self.comm.device != device:
            raise RuntimeError(
                f"share_comm_ctx: roots on {self.comm.device} and {device} cannot share streams. Fix: share "
                "only among roots whose meshes are on the same device."
            )
        elif self.comm.limit != limit:
            raise RuntimeError(
                f"share_comm_ctx: {root} asks for set_collectives_in_flight({limit}), but the roots it "
                f"shares a communication context with run with {self.comm.limit}, and they share one limit. "
                "Fix: call "
                "set_collectives_in_flight with the same count on every root passed to share_comm_ctx."
            )
        return self.comm

    def __deepcopy__(self, memo: dict[int, Any]) -> "SharedComm":
        return SharedComm()  # a copied model starts its own


def fsdp_states(tops: Sequence[nn.Module]) -> dict["FSDPState", str]:
    """Every `FSDPState` under ``tops``, once each, in pre-order, with the path of the module it
    was applied to, from the first of ``tops`` that contains it."""
    paths: dict[nn.Module, str] = {}
    for top in tops:
        for name, module in top.named_modules():
            paths.setdefault(module, name)
    found: dict[FSDPState, str] = {}
    for module in paths:
        state = module.__dict__.get("_fsdp_state")
        if isinstance(state, FSDPState) and state not in found:
            found[state] = paths.get(state.modules[0], "")
    return found


def flat_param(param: nn.Parameter) -> Optional[Any]:
    """The `FSDPParam` of a flat-sharded parameter of 2+ dims (1-D ones are laid out as dim 0)."""
    fp = manager_of(param) or unsharded_owner(param)
    return fp if fp is not None and is_flat(fp) else None


def is_flat(fp: Any) -> bool:
    """Whether a managed parameter is flat-sharded and of 2+ dims (its shard in another form)."""
    return fp.where.view is not None and len(fp.where.view) > 1


def _refuse_wrong_shapes(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """PyTorch loads the keys that fit and then raises for the rest; refuse before any is loaded."""
    wrong = []
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        got = state_dict.get(prefix + name)
        fp = flat_param(t) if isinstance(t, nn.Parameter) else None
        shape = t.shape if fp is None or got is None or got.dim() == 1 else fp.shape  # flat: its own
        if isinstance(got, torch.Tensor) and got.shape != shape:
            wrong.append(f"'{prefix + name}' is {tuple(got.shape)}, the model's {tuple(shape)}")
    if wrong:
        raise RuntimeError(
            f"load_state_dict into {class_name(module)}: shapes differ ({'; '.join(wrong)}; global shapes, "
            "whatever the sharding); nothing was loaded. Fix: load a state dict of this architecture, or "
            "drop those keys and pass strict=False."
        )


class FSDPState:
    def __init__(
        self,
        modules: list[nn.Module],
        group: Optional[FSDPParamGroup],
        info: MeshInfo,
        reshard_after_forward: Union[bool, int, None],
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        borrowed: Sequence[FSDPParamGroup] = (),
        extra: Sequence[FSDPParamGroup] = (),
    ) -> None:
        self.modules = modules
        # `group`: on the call's mesh (None if no parameter stayed there); `own` adds one per other
        # mesh shard_placement_fn chose (MoE experts).
        self.group = group
        self.own = ([group] if group is not None else []) + list(extra)
        # Earlier calls' groups whose parameters these modules use too (tied weights): unsharded
        # around this module's forward and backward; their owner reduces and reshards them.
        self.borrowed = list(borrowed)
        self.groups = self.own + self.borrowed
        self.info = info
        self.mp_policy = mp_policy
        self.settings = Settings(reshard_after_forward=reshard_after_forward)
        for g in self.own:
            g.settings = self.settings
        self.post_optim_event: Optional[torch.Event] = None  # the root's next all-gather waits for it
        self.shared_comm: Optional[SharedComm] = None
        self.ctx: Optional[RootContext] = None
        self.is_root = False
        # Under another call's modules (set by that call): what a trace, where no eager root is
        # chosen, reads for the default reshard_after_forward (`resolved_reshard`).
        self.nested = False
        self.fqn = ""
        self.resolve_schedule()
        self.phase = TrainingPhase.IDLE
        self._signals_pending = 0  # post-backward signals attached in forward, not fired yet
        self._members_done: set[int] = set()  # list form: members done since the last unshard
        self.setup_root: Optional[Callable[[RootContext], None]] = None  # api.py: the checks

    def __deepcopy__(self, memo: dict[int, Any]) -> "FSDPState":
        if self.ctx is not None and (self.ctx.pending_reduces or self.ctx.phase is IterationPhase.BACKWARD):
            refuse_busy(f"module {self.fqn or '<root>'}", "is between forward and the end of its backward")
        for group in self.groups:  # before `modules` leads deepcopy to the parameters
            for p in group.params:
                p.precopy(memo)
        # The copy finds its own root at its first forward; the event is on the original's stream.
        return copy_fields(
            self,
            memo,
            ctx=None,
            is_root=False,
            post_optim_event=None,
            _signals_pending=0,
            _members_done=set(),
            phase=TrainingPhase.IDLE,
            _traced=None,  # (the traced path's: tensors of a forward, not the copy's)
            _traced_handles=None,
        )

    # -- state dicts

    def show_sharded(self, module: nn.Module, *unused: Any) -> None:
        """Before (load_)state_dict: show the sharded DTensors, the one form a state dict holds."""
        for g in self.groups:
            g.show_form(unsharded=False)

    def show_unsharded(self, module: nn.Module, *args: Any) -> None:
        """After state_dict (``args``: the state dict, its prefix): flat-sharded parameters shown
        in the default layout (`layouts.flat`); back to the form the group is in."""
        if args:
            flat.convert_entries(module, args[0], args[1], flat_param, saving=True)
        for g in self.groups:
            g.show_form(unsharded=True)

    def before_load(self, module: nn.Module, state_dict: dict, prefix: str, *unused: Any) -> None:
        """Before load_state_dict: show the shards, take flat-sharded parameters' entries to their
        layout, and refuse wrong shapes while nothing is loaded."""
        self.show_sharded(module)
        try:
            flat.convert_entries(module, state_dict, prefix, flat_param, saving=False)
            _refuse_wrong_shapes(module, state_dict, prefix)
        except BaseException:
            self.show_unsharded(module)
            raise

    def after_load(self, module: nn.Module, *unused: Any) -> None:
        """After load_state_dict: back to the group's form; the loaded shards are taken over (and
        gathered again) before the next use."""
        self.show_unsharded(module)
        for g in self.groups:
            g.needs_sync = True

    # -- lazy init

    def lazy_init(self) -> None:
        """Make this state the root of every state under its modules."""
        if self.ctx is not None and self.is_root:
            return
        paths = fsdp_states(self.modules)
        states = list(paths)
        device_types = {s.info.device.type for s in states}
        if len(device_types) > 1:
            raise RuntimeError(
                f"fully_shard modules under one root use meshes on different devices {sorted(device_types)}; "
                "give every fully_shard call a mesh on the same device type."
            )
        shared = self.shared_comm
        limit = self.settings.collectives_in_flight
        if shared is not None:
            comm = shared.get(self.info.device, limit, class_name(self.modules[0]))
        else:
            comm = CommContext(self.info.device)
            comm.set_limit(limit)
        ctx = RootContext(self, states, comm)
        for state in states:
            state._join(ctx, is_root=state is self, fqn=paths[state])
        ctx.plan_buckets()
        watchdog.register_root(ctx)
        if self.setup_root is not None:
            self.setup_root(ctx)

    def _join(self, ctx: RootContext, is_root: bool, fqn: str) -> None:
        self.ctx = ctx
        self.is_root = is_root
        self.take_path(fqn)
        self.resolve_schedule()
        for g in self.own:
            g.comm = ctx.comm
            if type(self.reshard_after_forward) is int:  # not a bool
                g.post_forward = post_forward_groups(g.info, self.reshard_after_forward)

    def take_path(self, fqn: str) -> None:
        """Name this call's module, and so its parameters (`FSDPParam.path`), by its path: from the
        outermost call so far once a call encloses it (api.sharding), from the root at lazy init."""
        self.fqn = fqn
        for g in self.own:
            g.fqn = fqn

    def name(self) -> str:
        return f"module {self.fqn or '<root>'}"

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """What the engine holds for this call, by category (`fully_shard.plan.CATEGORIES`)."""
        out: list[tuple[str, Optional[torch.Tensor]]] = [
            ("buffers", b) for m in self.modules for b in m.buffers()
        ]
        for g in self.own:
            out += g.live_buffers()
        if self.ctx is not None:
            out += self.ctx.live_buffers()
        return out

    def update_settings(self, **changes: Any) -> None:
        """``FSDPModule.set_*``: one new frozen `Settings`, shared with this call's groups."""
        before = self.settings
        self.settings = dataclasses.replace(before, **changes)
        if self.ctx is not None and (
            self.settings.reduce_scatter_max_input_buffers != before.reduce_scatter_max_input_buffers
        ):
            self.ctx.note_reductions_limit()
        for g in self.own:
            g.settings = self.settings
            if self.settings.reduce_dtype != before.reduce_dtype:
                g.derive_dtypes()
            if self.settings.codecs != before.codecs:  # resolved again before the next all-gather
                g.needs_sync = True
            if self.settings.keep_low_precision_grads != before.keep_low_precision_grads:
                for fp in g.params:  # (what a compiled backward needs; eager lowers at its end)
                    fp.lower_grads_once_accumulated(self.settings.keep_low_precision_grads)
        self.resolve_schedule()

    def may_share_collectives(self) -> bool:
        """Whether this module's group may join a bucket: not the root's (gathered first, kept
        through forward), not offloaded, not tensor-parallel."""
        group = self.group
        return (
            group is not None
            and len(self.own) == 1
            and not self.is_root
            and not self.borrowed
            and not any(p.offload or p.tp is not None for p in group.params)
        )

    def follows_default_schedule(self) -> bool:
        """Whether the settings keep the schedule a bucket assumes: reshard after forward and
        backward, unshard in backward, implicit prefetch, plain collectives."""
        s = self.settings
        return (
            self.reshard_after_forward is True
            and s.reshard_after_backward
            and s.unshard_in_backward
            and s.forward_prefetch is None
            and s.backward_prefetch is None
            and all(g.settings.communicates_plainly() and g.comm_buffers is None for g in self.own)
        )

    def resolve_schedule(self) -> None:
        """The reshard_after_forward setting as it applies, and whether the default schedule (which a
        bucket assumes) holds: again after any change of settings or of a group's buffer source."""
        self.reshard_after_forward: Union[bool, int] = self.resolved_reshard(root=self.is_root)
        self.default_schedule = self.follows_default_schedule()

    def resolved_reshard(self, root: bool) -> Union[bool, int]:
        """The reshard_after_forward setting as it applies; the default (None) is "unless root": the
        root's parameters are needed first in backward, so keeping them is free prefetch. Eager asks
        with the root chosen at lazy init (`is_root`), a trace, which has none, with the root of the
        calls (not `nested`)."""
        setting = self.settings.reshard_after_forward
        return (not root) if setting is None else setting

    def root_context(self) -> RootContext:
        """Before any forward (e.g. ``unshard()``) this state lazily becomes a root."""
        if self.ctx is None:
            self.lazy_init()
        assert self.ctx is not None
        return self.ctx

    # -- hooks: each reports one event; the table MODULE decides what runs

    # A running autograd node means backward: activation checkpointing recomputes the module.
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        recompute = torch._C._current_autograd_node() is not None
        return self.handle(ModuleEvent.RECOMPUTE if recompute else ModuleEvent.FORWARD, module, args, kwargs)

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        recompute = torch._C._current_autograd_node() is not None
        return self.handle(
            ModuleEvent.RECOMPUTE_DONE if recompute else ModuleEvent.FORWARD_DONE, module, output
        )

    def pre_backward(self, *unused: Any) -> None:
        self.handle(ModuleEvent.PRE_BACKWARD)

    def post_backward_signal(self) -> None:
        self.handle(ModuleEvent.SIGNAL)

    def finish_backward(self) -> None:
        self.handle(ModuleEvent.BACKWARD_END)

    def reduce_by_hand(self) -> None:
        self.handle(ModuleEvent.REDUCE_GRADS)

    def reset(self) -> None:
        self.handle(ModuleEvent.RESET)

    def handle(self, event: ModuleEvent, *payload: Any) -> Any:
        # step_for's choice, inlined: the hot path enters no extra function.
        step = MODULE.get((self.phase, event))
        if type(step) is tuple:
            for s in step:
                if s.when is None or s.when(self, *payload):
                    step = s
                    break
            else:
                step = None
        if step is None:
            step = step_for(MODULE, self.phase, event, self.name)  # raises, naming the module and both
        assert isinstance(step, Step)
        self.phase = step.to
        try:
            result = step.action(self, *payload) if step.action is not None else None
        finally:
            if self.is_root:
                self.ctx.note_phases()  # type: ignore[union-attr]
        if step.then is not None:
            self.phase = step.then
            if self.is_root:
                self.ctx.note_phases()  # type: ignore[union-attr]
        return result

    # -- forward

    def prepare_inputs(
        self, args: tuple, kwargs: dict, in_backward: bool
    ) -> tuple[tuple, dict, Optional[torch.Event]]:
        """Lazy init; the root moves inputs to the device and reports to its iteration; cast inputs.
        Returns the post-optimizer event the first all-gather waits for."""
        ctx = self.root_context()
        after: Optional[torch.Event] = None
        if self.is_root:
            if self.info.device.type != "cpu":
                args, kwargs = self._move_inputs(args, kwargs)
            ctx.handle(Event.RECOMPUTE if in_backward else Event.ROOT_FORWARD)
            if not in_backward:
                after, self.post_optim_event = self.post_optim_event, None
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs, after

    def unshard_for_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs, after = self.prepare_inputs(args, kwargs, in_backward=False)
        if not self.groups:
            return args, kwargs
        for method, targets in (
            ("set_modules_to_forward_prefetch", self.settings.forward_prefetch),
            ("set_modules_to_backward_prefetch", self.settings.backward_prefetch),
        ):
            for target in targets or ():
                self._check_prefetch_target(target, method)
        with record_function(f"FSDP::pre_forward {self.fqn}"):
            for g in self.groups:
                g.forward_users.add(id(self))
            self._unshard_groups(Reason.FORWARD, after)
            for target in self.settings.forward_prefetch or ():
                for g in target.own:
                    g.unshard(Reason.FORWARD_PREFETCH)
            args, kwargs = self._attach_signal_if_trainable(args, kwargs)
        return args, kwargs

    def _attach_signal_if_trainable(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if torch.is_grad_enabled():
            for g in self.own:
                if g.trainable:
                    return self._attach_post_backward_signal(args, kwargs)
        return args, kwargs

    def _check_prefetch_target(self, target: "FSDPState", method: str) -> None:
        if target.ctx is not self.ctx:
            raise ValueError(
                f"module '{self.fqn}' ({class_name(self.modules[0])}): {method} names a "
                f"{class_name(target.modules[0])} that is not under the same root module, so its parameters "
                "are gathered by another model's schedule (or never). Fix: pass sharded modules of this "
                "model."
            )

    def unshard_for_recompute(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Activation checkpointing recomputes this module. Non-reentrant: the original forward's
        hooks drive backward (the recomputed graph's backward never runs). Reentrant, when no hook of
        the original forward fired (it ran without grad: `recompute_is_tracked`): the recomputed
        graph is the one backpropagated, so it gets the hooks a forward gets."""
        args, kwargs, _ = self.prepare_inputs(args, kwargs, in_backward=True)
        if self.groups:
            with record_function(f"FSDP::pre_recompute {self.fqn}"):
                self._unshard_groups(Reason.BACKWARD)
            if self.recompute_is_tracked():
                args, kwargs = self._attach_signal_if_trainable(args, kwargs)
        return args, kwargs

    def recompute_is_tracked(self) -> bool:
        """Whether this recompute's backward is the one that runs: the iteration is not in backward
        yet (reentrant checkpointing ran the original forward without grad, so nothing of it fired)."""
        assert self.ctx is not None
        return torch.is_grad_enabled() and self.ctx.phase is not IterationPhase.BACKWARD

    def _unshard_groups(self, reason: Reason, after: Optional[torch.Event] = None) -> None:
        """Issue every all-gather (own and borrowed groups) before waiting for any."""
        for g in self.groups:
            g.unshard(reason, after)
        for g in self.groups:
            g.wait_for_unshard()

    def finish_output(self, module: nn.Module, output: Any) -> Any:
        """Cast the output; the root reshards bucket members its forward skipped; hook for backward."""
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if self.is_root and self.ctx is not None:
            for bucket in self.ctx.buckets:
                bucket.reshard_unused()
        if self.groups and torch.is_grad_enabled():
            output = self._hook_outputs_for_backward(output)
        return output

    def finish_member(self, module: nn.Module, output: Any) -> Any:
        self._members_done.add(self._member_index(module))
        return self.finish_output(module, output)

    def after_forward(self, module: nn.Module, output: Any) -> Any:
        """Reshard as the settings say; without grad no backward comes, so keep nothing unsharded."""
        output = self.finish_output(module, output)
        self._members_done.clear()
        grad_enabled = torch.is_grad_enabled()
        with record_function(f"FSDP::post_forward {self.fqn}"):
            for g in self.groups:
                g.forward_users.discard(id(self))
                if g.forward_users or g.pins:
                    continue  # a module still inside its forward uses these parameters (tied weights),
                    # or an ``unsharded()`` block holds them
                if not grad_enabled or self.reshard_after_forward is True:
                    g.reshard()
                elif type(self.reshard_after_forward) is int and g.post_forward is not None:
                    g.reshard_to_post_forward()
            if grad_enabled and self.own:
                self.root_context().post_forward_order.append(self)
        return output

    def after_recompute(self, module: nn.Module, output: Any) -> Any:
        """Cast; backward needs these parameters next, and its post-backward reshards them. A tracked
        recompute (`recompute_is_tracked`) also hooks its outputs, as a forward does."""
        dtype = self.mp_policy.output_dtype
        output = _cast_floats(output, dtype) if dtype is not None else output
        if self.groups and self.recompute_is_tracked():
            output = self._hook_outputs_for_backward(output)
            if self.own:
                self.root_context().post_forward_order.append(self)
        return output

    def members_left(self, module: nn.Module, output: Any) -> bool:
        """Guard: other members of a list-form call have not finished this forward."""
        if len(self.modules) == 1:
            return False
        return len(self._members_done | {self._member_index(module)}) < len(self.modules)

    def is_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Guard: the root's iteration decides what to do with a backward still in flight."""
        return self.is_root

    def _member_index(self, module: nn.Module) -> int:
        return next(i for i, m in enumerate(self.modules) if m is module)

    def _move_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        device = self.info.device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t if t.device == device else t.to(device, non_blocking=True)

        return tree_map_only(torch.Tensor, move, (args, kwargs))

    def _attach_post_backward_signal(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        positions, tensors = [], []
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                positions.append(i)
                tensors.append(x)
        if not positions:
            return args, kwargs  # no signal possible: the end-of-backward callback reduces this group
        outs = _PostBackwardSignal.apply(self, *tensors)
        for i, out in zip(positions, outs):
            flat[i] = out
        self._signals_pending += 1
        return tree_unflatten(flat, spec)

    def _hook_outputs_for_backward(self, output: Any) -> Any:
        tensors = []
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self.pre_backward, mode="any")
        return output

    # -- backward

    def unshard_for_backward(self) -> None:
        ctx = self.root_context()
        ctx.handle(Event.PRE_BACKWARD)
        with record_function(f"FSDP::pre_backward {self.fqn}"):
            # CPU, below 2 in flight: the previous reduce-scatter's buffers (input, output, gloo's
            # copy) die before this module's gradients are made. Streams overlap it instead.
            if ctx.pending_reduces and not ctx.comm.reduce_overlaps_compute:
                ctx.finish_pending_reduce()
            if self.settings.unshard_in_backward:  # no-op if prefetched
                self._unshard_groups(Reason.BACKWARD)
            # Prefetch after our own copy-out: two all-gather outputs are never alive at once, and it
            # still overlaps all of this group's backward.
            implicit = ctx.backward_prefetch_target(self)
            explicit = self.settings.backward_prefetch
            for target in explicit if explicit is not None else [implicit] if implicit is not None else []:
                if target.own and target.settings.unshard_in_backward:
                    with record_function(f"FSDP::backward_prefetch {target.fqn}"):
                        for g in target.own:
                            g.unshard(Reason.BACKWARD_PREFETCH)

    def signals_left(self) -> bool:
        """Guard: a module used several times in forward reduces at its last signal (its first use)."""
        return self._signals_pending > 1

    def count_signal(self) -> None:
        self._signals_pending -= 1

    def reduce(self) -> None:
        self._signals_pending = 0
        self._post_backward(Reason.BACKWARD)

    def _post_backward(self, reason: Reason) -> None:
        s = self.settings
        # create_graph=True (grad mode on in backward): a second backward through this graph (a
        # gradient penalty) needs the unsharded parameters; it reshards them.
        self._reduce_own(
            reason, s.requires_gradient_sync, s.reshard_after_backward and not torch.is_grad_enabled()
        )

    def _reduce_own(self, reason: Reason, sync: bool, reshard: bool) -> None:
        """Each own group's post-backward, issued once the root has room for its reductions."""

        def issue() -> list[ReduceScatterResult]:
            results = []
            for g in self.own:
                results += g.post_backward(reason, sync=sync, reshard=reshard, bucketed=self.default_schedule)
            return results

        self.root_context().reduce(issue)

    def reduce_accumulated(self) -> None:
        """`FSDPModule.reduce_grads`: reduce what accumulated without sync and reshard, whatever
        the sync and reshard settings say (they govern backward; this is the user's explicit call)."""
        self._signals_pending = 0
        self._members_done.clear()
        self._reduce_own(Reason.REDUCE_GRADS, sync=True, reshard=True)

    def reduce_leftovers(self) -> None:
        """Reduce whatever gradients the post-backward signals missed."""
        self._signals_pending = 0
        self._members_done.clear()
        if self.own:
            self._post_backward(Reason.END_OF_BACKWARD)

    def reset_module(self) -> None:
        self._signals_pending = 0
        self._members_done.clear()
        for g in self.groups:
            g.forward_users.clear()
        for g in self.own:
            g.reshard()


_I, _E = IterationPhase, Event
# The root's iteration: (phase, event) -> Step whose action is the `RootContext` method that runs.
# A missing pair is a bug in the caller's sequence and raises, naming both.
ITERATION: dict[tuple[IterationPhase, Event], Entry] = {
    # Several forwards before one backward: an evaluation forward, or two losses summed.
    **{(p, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.start_iteration) for p in (_I.IDLE, _I.FORWARD)},
    # A forward while backward is in flight: that backward raised, so autograd never ran the
    # end-of-backward callback. Recover (reshard, drop unreduced gradients), then start.
    **{
        (p, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.recover_and_start)
        for p in (_I.BACKWARD, _I.FINALIZING)
    },
    **{(p, _E.RECOMPUTE): Step(p) for p in IterationPhase},  # the groups decide what to gather
    # From IDLE: a retained graph run backward again.
    **{(p, _E.PRE_BACKWARD): Step(_I.BACKWARD, RootContext.begin_backward) for p in (_I.IDLE, _I.FORWARD)},
    (_I.BACKWARD, _E.PRE_BACKWARD): Step(_I.BACKWARD),
    (_I.BACKWARD, _E.BACKWARD_END): Step(_I.FINALIZING, RootContext.finish_backward, then=_I.IDLE),
    # reduce_grads(): between backwards (a pipeline schedule's end, a split backward's weight pass
    # run outside autograd's callbacks); also after a forward whose backward never comes.
    **{
        (p, _E.REDUCE_GRADS): Step(_I.FINALIZING, RootContext.reduce_grads, then=_I.IDLE)
        for p in (_I.IDLE, _I.FORWARD)
    },
    # reset_iter_state(): after a forward that raised, or a backward (its gradients dropped too).
    **{(p, _E.RESET): Step(_I.IDLE, RootContext.reset_iteration) for p in (_I.IDLE, _I.FORWARD)},
    **{(p, _E.RESET): Step(_I.IDLE, RootContext.reset_failed_backward) for p in (_I.BACKWARD, _I.FINALIZING)},
}


_P, _M, _S = TrainingPhase, ModuleEvent, FSDPState
# One sharded module: (phase, event) -> Step, or steps whose first holding guard wins; the action is
# the `FSDPState` method that runs with the event's payload. A missing pair raises, naming both.
MODULE: dict[tuple[TrainingPhase, ModuleEvent], Entry] = {
    # FORWARD in FORWARD: the next member of a list-form call, or a module run inside its own forward.
    # then=FORWARD: a root recovering from a backward that raised resets every module as it starts,
    # itself included; only the root's forward may come during backward (is_root_forward).
    **{
        (p, _M.FORWARD): Step(_P.FORWARD, _S.unshard_for_forward, then=_P.FORWARD)
        for p in (_P.IDLE, _P.FORWARD)
    },
    **{
        (p, _M.FORWARD): Step(_P.FORWARD, _S.unshard_for_forward, then=_P.FORWARD, when=_S.is_root_forward)
        for p in (_P.PRE_BACKWARD, _P.POST_BACKWARD)
    },
    (_P.FORWARD, _M.FORWARD_DONE): (
        Step(_P.FORWARD, _S.finish_member, when=_S.members_left),
        Step(_P.IDLE, _S.after_forward),
    ),
    # Gradients reach the outputs: also during forward (autograd.grad inside it), and again for a
    # second forward use.
    **{
        (p, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, _S.unshard_for_backward)
        for p in (_P.IDLE, _P.FORWARD, _P.PRE_BACKWARD)
    },
    # A signal fires once the gradients of one forward use exist; the module reduces at the last
    # (from IDLE too: its outputs reached the loss only untracked).
    **{
        (p, _M.SIGNAL): (
            Step(p, _S.count_signal, when=_S.signals_left),
            Step(_P.POST_BACKWARD, _S.reduce, then=_P.IDLE),
        )
        for p in (_P.IDLE, _P.PRE_BACKWARD)
    },
    **{
        (p, _M.SIGNAL): Step(p, _S.count_signal, when=_S.signals_left) for p in (_P.FORWARD, _P.POST_BACKWARD)
    },
    **{(p, _M.RECOMPUTE): Step(p, _S.unshard_for_recompute) for p in _P},
    **{(p, _M.RECOMPUTE_DONE): Step(p, _S.after_recompute) for p in _P},
    **{(p, _M.BACKWARD_END): Step(_P.POST_BACKWARD, _S.reduce_leftovers, then=_P.IDLE) for p in _P},
    # Not inside the module's own forward (its gathered parameters are in use there).
    **{
        (p, _M.REDUCE_GRADS): Step(_P.POST_BACKWARD, _S.reduce_accumulated, then=_P.IDLE)
        for p in _P
        if p is not _P.FORWARD
    },
    **{(p, _M.RESET): Step(_P.IDLE, _S.reset_module) for p in _P},
}
