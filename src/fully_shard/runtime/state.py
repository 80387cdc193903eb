"""`FSDPState`: the module hooks that drive a group through forward and backward.

One `FSDPState` per ``fully_shard`` call. The root's first forward creates a `RootContext` that
every state under it shares: the streams, the post-forward order (for backward prefetch), the
reduce-scatter in flight and the end-of-backward callback.

Hook map (each hook reports one event and nothing else; the two module hooks are installed
through `api.sharding._OutsideCompile`, so they run eagerly outside ``torch.compile``'s graphs):

* forward pre-hook  -> `FSDPState.pre_forward`: FORWARD (or RECOMPUTE inside backward)
* forward hook      -> `FSDPState.post_forward`: FORWARD_DONE (or RECOMPUTE_DONE)
* output grad hook  -> `FSDPState.pre_backward`: PRE_BACKWARD
* input grad signal -> `FSDPState.post_backward_signal`: SIGNAL
* engine callback   -> `RootContext.handle(BACKWARD_END)`: every module's BACKWARD_END

What each event does is decided by the tables at the bottom of this file: `MODULE` for a module
(`FSDPState.handle`), `ITERATION` for a root's iteration (`RootContext.handle`).
"""

from __future__ import annotations

import dataclasses
import warnings
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
from ..layouts.mesh import MeshInfo, PostForwardGroup, post_forward_groups
from ..layouts.policy import MixedPrecisionPolicy
from .registry import class_name
from .settings import Settings
from .lifecycle import Entry, Event, IterationPhase, ModuleEvent, Step, TrainingPhase, step_for
from .param_group import FSDPParamGroup, ReduceScatterResult


class StepVerdict(RuntimeError):
    """A check's verdict on a step (e.g. `NonFiniteGradients`), raised once the step's work is done."""


class GradientCheck(Protocol):
    """Sees each gradient before its reduction; concludes at the end of the last backward before the
    optimizer step (where it may raise a `StepVerdict`)."""

    def observe(self, p: Any, grad: torch.Tensor) -> None: ...

    def conclude(self) -> None: ...


class RootContext:
    """Per-root runtime state shared by every `FSDPState` under one root module."""

    def __init__(self, root: "FSDPState", states: list["FSDPState"], comm: CommContext) -> None:
        self.root = root
        self.states = states
        self.comm = comm
        self.post_forward_order: list[FSDPState] = []
        self.phase = IterationPhase.IDLE
        self.pending_reduce: Optional[ReduceScatterResult] = None
        self._post_forward_groups: dict[tuple[str, int], PostForwardGroup] = {}
        self.buckets: list[Bucket] = []
        # A check of the gradients (the finite check, finite.py) that concludes at the end of the
        # last backward before the step; set by the check itself.
        self.gradient_check: Optional[GradientCheck] = None

    def name(self) -> str:
        """How errors name this root."""
        return f"root {class_name(self.root.modules[0])}"

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """The reduction in flight's input and output ("communication")."""
        if self.pending_reduce is None:
            return []
        return [
            ("communication", t)
            for part in self.pending_reduce.parts
            for t in (*part.pending.keep_alive, part.output)
        ]

    def describe(self) -> list[str]:
        """What this root is doing, for the watchdog (watchdog.py)."""
        lines = [
            f"{self.name()}: iteration {self.phase.name}"
            + (f", reduction in flight: {self.pending_reduce.parts[0].name}" if self.pending_reduce else "")
        ]
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
        """Cut the groups under this root into buckets (bucket.py) by the root's byte budget."""
        if self.pending_reduce is not None or any(b.holds_grads for b in self.buckets):
            raise RuntimeError(
                f"fully_shard: set_bucket_bytes on {class_name(self.root.modules[0])} while gradients are "
                "being reduced; call it between steps (after backward)."
            )
        owner = {id(s.group): s for s in self.states if s.group is not None}
        lent = {id(g) for s in self.states for g in s.borrowed}
        candidates = [
            s.group if s.group is not None and s.may_share_collectives() and id(s.group) not in lent else None
            for s in self.states
        ]
        self.buckets = plan_buckets(
            candidates, self.root.settings.bucket_bytes, lambda g: owner[id(g)].default_schedule
        )

    def post_forward_group(self, info: MeshInfo, size: int) -> PostForwardGroup:
        """One set of smaller groups per (shard group, size) under this root, made on first use."""
        key = (info.group.group_name, size)
        if key not in self._post_forward_groups:
            self._post_forward_groups[key] = post_forward_groups(info, size)
        return self._post_forward_groups[key]

    # -- the iteration's lifecycle: hooks report events, the table (ITERATION, below) decides ----

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
        if step.then is not None:
            self.phase = step.then

    def start_iteration(self) -> None:
        """A root forward starts: look for what changed between steps with no event to say so
        (`FSDPParamGroup.notice_changes`); hook up the traces opened around it."""
        for state in self.states:
            for g in state.own:
                g.notice_changes()
        if ACTIVE_OBSERVERS.get():
            self.attach_active_observers()
        for o in self.comm.observers:
            o.begin_step()

    def attach_active_observers(self) -> None:
        """Called in the user's thread when this root starts work: the observers opened there
        (``fully_shard.debug.trace()``) watch its collectives from now on, including those issued
        from autograd's threads."""
        for o in ACTIVE_OBSERVERS.get():
            if o not in self.comm.observers:
                self.comm.observers.append(o)
            o.attach(self)

    def detach(self, observer: CollectiveObserver) -> None:
        """``observer`` stops watching this root (a trace's ``with`` block ended)."""
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
        self.reset_iteration()
        self.start_iteration()

    def begin_backward(self) -> None:
        """The first gradients reached a sharded module: have autograd call us when backward ends."""
        Variable._execution_engine.queue_callback(lambda: self.handle(Event.BACKWARD_END))

    def start_reduce(self, results: list[ReduceScatterResult]) -> None:
        # One reduce-scatter in flight at a time: it overlaps the next group's backward, and the
        # memory of at most one gradient buffer is held for it.
        for result in results:
            self.finish_pending_reduce()
            self.pending_reduce = result

    def finish_pending_reduce(self) -> None:
        if self.pending_reduce is None:
            return
        result, self.pending_reduce = self.pending_reduce, None
        result.finish()

    def backward_prefetch_target(self, state: "FSDPState") -> Optional["FSDPState"]:
        """The state whose forward ran just before ``state``'s: it runs next in backward.

        Consumes ``state``'s latest entry in the post-forward order, so a module that ran forward
        twice prefetches correctly for each of its backward passes.
        """
        order = self.post_forward_order
        for i in range(len(order) - 1, -1, -1):
            if order[i] is state:
                del order[i]
                return order[i - 1] if i > 0 else None
        return None

    def finish_backward(self) -> None:
        """End of backward: reduce what the post-backward signals missed, and, after the last
        backward before the optimizer step, wait for every reduction."""
        with record_function("FSDP::backward_end"):
            for state in self.states:
                state.finish_backward()
            for bucket in self.buckets:  # gradients of members whose bucket-mates did not run
                self.start_reduce(bucket.flush(Reason.END_OF_BACKWARD))
            # Not the last backward before the step (micro-batching): leave the last
            # reduce-scatter in flight and keep the prefetch order for the backwards to come.
            if self.root.settings.is_last_backward:
                self.finish_pending_reduce()
                self.post_forward_order.clear()
                for state in self.states:  # offloaded .grad must be on the host for the optimizer
                    for g in state.own:
                        if g.offload_events:
                            g.wait_for_offloaded_grads()
                if self.gradient_check is not None:
                    self.gradient_check.conclude()

    def reset_iteration(self) -> None:
        """Forget a failed iteration: reshard everything, drop its unreduced gradients."""
        if self.pending_reduce is not None:
            for part in self.pending_reduce.parts:
                part.pending.discard()  # let the collective land before dropping its buffers
            self.pending_reduce = None
        for bucket in self.buckets:
            bucket.discard()
        for state in self.states:
            state.reset()
        self.post_forward_order.clear()


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in ``tree`` to ``dtype`` (differentiably)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tree_map_only(torch.Tensor, cast, tree)


def _is_int_setting(value: object) -> bool:
    return type(value) is int  # not a bool


class _PostBackwardSignal(torch.autograd.Function):
    """Forward: passes the module's tensor inputs through unchanged.

    Backward: runs once the gradients of those inputs exist, which is after autograd has produced
    every gradient of the module's parameters for this forward; then calls
    ``state.post_backward_signal()``. The gradients pass through untouched.
    """

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
    """`share_comm_ctx`: one `CommContext` (streams, release worker, traces) for several roots,
    e.g. the pipeline stages one rank runs; made by the first root that starts."""

    def __init__(self) -> None:
        self.comm: Optional[CommContext] = None

    def get(self, device: torch.device) -> CommContext:
        if self.comm is None:
            self.comm = CommContext(device)
        elif self.comm.device != device:
            raise RuntimeError(
                f"share_comm_ctx: roots on {self.comm.device} and {device} cannot share streams. Fix: share "
                "only among roots whose meshes are on the same device."
            )
        return self.comm

    def __deepcopy__(self, memo: dict[int, Any]) -> "SharedComm":
        return SharedComm()  # a copied model starts its own


def fsdp_states(tops: Sequence[nn.Module]) -> dict["FSDPState", str]:
    """Every `FSDPState` in the subtrees of ``tops``, each once, in pre-order, with the module path
    (from the first of ``tops``) of the module it was applied to. The one walk that finds them."""
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
        # The group on the call's mesh (None if no parameter stayed on it), and every group this
        # call owns: that one and one per other mesh shard_placement_fn chose (MoE experts).
        self.group = group
        self.own = ([group] if group is not None else []) + list(extra)
        # Groups of earlier calls whose parameters these modules use too (tied weights): unsharded
        # around this module's forward and backward; their owner reduces and reshards them.
        self.borrowed = list(borrowed)
        self.groups = self.own + self.borrowed
        self.info = info
        self.mp_policy = mp_policy
        self.settings = Settings(reshard_after_forward=reshard_after_forward)
        for g in self.own:
            g.settings = self.settings
        # set_post_optim_event: the root's first all-gather of the next forward waits for it (once).
        self.post_optim_event: Optional[torch.Event] = None
        # share_comm_ctx: roots that share one CommContext (streams, release worker, traces).
        self.shared_comm: Optional[SharedComm] = None
        self.ctx: Optional[RootContext] = None
        self.is_root = False
        self.fqn = ""
        self.resolve_reshard_after_forward()  # reshard_after_forward and default_schedule
        self.phase = TrainingPhase.IDLE  # this module's lifecycle (the table MODULE)
        # Post-backward signals attached in forward that have not fired yet: the group reduces
        # at the last one, i.e. after the backward of its *first* forward use.
        self._signals_pending = 0
        # List form: members that finished forward since the group last unsharded.
        self._members_done: set[int] = set()
        # What the layers above the runtime attach to a root at lazy init (api.py: the checks).
        self.setup_root: Optional[Callable[[RootContext], None]] = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "FSDPState":
        if self.ctx is not None and (
            self.ctx.pending_reduce is not None or self.ctx.phase is IterationPhase.BACKWARD
        ):
            refuse_busy(f"module {self.fqn or '<root>'}", "is between forward and the end of its backward")
        for group in self.groups:  # before `modules` leads deepcopy to the parameters (FSDPParam.precopy)
            for p in group.params:
                p.precopy(memo)
        # The copy finds its own root at its first forward; an event belongs to the original's stream.
        return copy_fields(
            self,
            memo,
            ctx=None,
            is_root=False,
            post_optim_event=None,
            _signals_pending=0,
            _members_done=set(),
            phase=TrainingPhase.IDLE,
        )

    # -- state dicts ------------------------------------------------------------------------------

    def show_sharded(self, module: nn.Module, *unused: Any) -> None:
        """Before (load_)state_dict: a module whose parameters are unsharded (after ``unshard()``,
        inside forward) shows its sharded DTensors, the one form a state dict holds and loads into;
        a load then moves the shards' versions, so the unsharded copy is gathered again before use."""
        for g in self.groups:
            g.show_form(unsharded=False)

    def show_unsharded(self, module: nn.Module, *unused: Any) -> None:
        """After state_dict: back to the form the group is in."""
        for g in self.groups:
            g.show_form(unsharded=True)

    def after_load(self, module: nn.Module, *unused: Any) -> None:
        """After load_state_dict: back to the form the group is in; the loaded shards (assigned or
        copied into) are taken over, and any unsharded copy gathered again, before the next use."""
        self.show_unsharded(module)
        for g in self.groups:
            g.needs_sync = True

    # -- lazy init -------------------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Make this state the root of every state in its modules' subtrees (first forward)."""
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
        comm = shared.get(self.info.device) if shared is not None else CommContext(self.info.device)
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
        self.fqn = fqn
        self.resolve_reshard_after_forward()
        for g in self.own:
            g.comm = ctx.comm
            if _is_int_setting(self.reshard_after_forward):
                g.post_forward = ctx.post_forward_group(g.info, int(self.reshard_after_forward))
            g.fqn = fqn

    def name(self) -> str:
        """How errors name this module."""
        return f"module {self.fqn or '<root>'}"

    def live_buffers(self) -> list[tuple[str, Optional[torch.Tensor]]]:
        """What the engine holds for this call, with categories (`fully_shard.plan.CATEGORIES`):
        its modules' buffers, its own groups' tensors, and its root's reduction in flight. The one
        way tools (tools/memory.py) see the engine's memory."""
        out: list[tuple[str, Optional[torch.Tensor]]] = [
            ("buffers", b) for m in self.modules for b in m.buffers()
        ]
        for g in self.own:
            out += g.live_buffers()
        if self.ctx is not None:
            out += self.ctx.live_buffers()
        return out

    def update_settings(self, **changes: Any) -> None:
        """Replace this call's settings (``FSDPModule.set_*``): one new frozen value, handed to its
        own groups too. A new reduce dtype re-derives each parameter's."""
        before = self.settings
        self.settings = dataclasses.replace(before, **changes)
        for g in self.own:
            g.settings = self.settings
            if self.settings.reduce_dtype != before.reduce_dtype:
                g.derive_dtypes()
            if self.settings.codecs != before.codecs:  # resolved again before the next all-gather
                g.needs_sync = True
        self.resolve_reshard_after_forward()

    def may_share_collectives(self) -> bool:
        """Whether this module's group may join a bucket at all (see bucket.py): not the root's
        (gathered first, kept through forward), not offloaded, not tensor-parallel."""
        group = self.group
        return (
            group is not None
            and len(self.own) == 1
            and not self.is_root
            and not self.borrowed
            and not any(p.offload or p.tp is not None for p in group.params)
        )

    def follows_default_schedule(self) -> bool:
        """Whether the settings leave this module on the schedule a bucket assumes (reshard after
        forward and after backward, unshard in backward, implicit prefetch)."""
        s = self.settings
        return (
            self.reshard_after_forward is True
            and s.reshard_after_backward
            and s.unshard_in_backward
            and s.forward_prefetch is None
            and s.backward_prefetch is None
            and all(g.settings.communicates_plainly() for g in self.own)
        )

    def resolve_reshard_after_forward(self) -> None:
        setting = self.settings.reshard_after_forward
        # The root's parameters are needed first in backward, so keeping them is free prefetch.
        self.reshard_after_forward: Union[bool, int] = (not self.is_root) if setting is None else setting
        self.default_schedule = self.follows_default_schedule()

    def root_context(self) -> RootContext:
        """The per-root runtime state this module runs under. Before any forward (an explicit
        ``unshard()``, ``unsharded()``), this state lazily becomes the root of its subtree."""
        if self.ctx is None:
            self.lazy_init()
        assert self.ctx is not None
        return self.ctx

    # -- hooks: each reports one event; the table (MODULE, below) decides what runs ----------------

    # Inside backward (an autograd node runs: activation checkpointing recomputes) or not.
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
        """End of backward (`RootContext.finish_backward`)."""
        self.handle(ModuleEvent.BACKWARD_END)

    def reset(self) -> None:
        self.handle(ModuleEvent.RESET)

    def handle(self, event: ModuleEvent, *payload: Any) -> Any:
        step = MODULE.get((self.phase, event))
        if type(step) is tuple:  # guarded steps: the first whose guard holds
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
        result = step.action(self, *payload) if step.action is not None else None
        if step.then is not None:
            self.phase = step.then
        return result

    # -- forward ---------------------------------------------------------------------------------

    def prepare_inputs(
        self, args: tuple, kwargs: dict, in_backward: bool
    ) -> tuple[tuple, dict, Optional[torch.Event]]:
        """Lazy init; the root moves the inputs to the device and reports to its iteration; inputs
        cast to the compute dtype. Returns the post-optimizer event the first all-gather waits for."""
        ctx = self.root_context()
        after: Optional[torch.Event] = None
        if self.is_root:
            if self.info.device.type != "cpu":
                args, kwargs = self._move_inputs(args, kwargs)
            ctx.handle(Event.RECOMPUTE if in_backward else Event.ROOT_FORWARD)
            if not in_backward:  # accelerators: the first all-gather waits only for the optimizer step
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
            if torch.is_grad_enabled():
                for g in self.own:
                    if g.trainable:
                        args, kwargs = self._attach_post_backward_signal(args, kwargs)
                        break
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
        """Forward inside backward: activation checkpointing recomputes this module.

        Only make sure the parameters are there (usually they are: this module's pre-backward
        or a prefetch gathered them). No post-backward signal: the recomputed graph is only a
        source of saved tensors, its backward never runs; the original forward's signal fires.
        """
        args, kwargs, _ = self.prepare_inputs(args, kwargs, in_backward=True)
        if self.groups:
            with record_function(f"FSDP::pre_recompute {self.fqn}"):
                self._unshard_groups(Reason.BACKWARD)
        return args, kwargs

    def _unshard_groups(self, reason: Reason, after: Optional[torch.Event] = None) -> None:
        """Own group and borrowed ones: issue every all-gather first, then wait for them."""
        for g in self.groups:
            g.unshard(reason, after)
        for g in self.groups:
            g.wait_for_unshard()

    def finish_output(self, module: nn.Module, output: Any) -> Any:
        """Post-forward of each module of the call: cast the output; the root reshards bucket
        members its forward skipped; outputs hooked for backward."""
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if self.is_root and self.ctx is not None:
            for bucket in self.ctx.buckets:
                bucket.reshard_unused()
        if self.groups and torch.is_grad_enabled():
            output = self._hook_outputs_for_backward(output)
        return output

    def finish_member(self, module: nn.Module, output: Any) -> Any:
        """List form: one module of the call finished its forward; others still run."""
        self._members_done.add(self._member_index(module))
        return self.finish_output(module, output)

    def after_forward(self, module: nn.Module, output: Any) -> Any:
        """The call's forward is done: reshard as the settings say (fully, to the smaller group,
        or keep); without grad no backward will come for these parameters, so keep nothing
        unsharded."""
        output = self.finish_output(module, output)
        self._members_done.clear()
        grad_enabled = torch.is_grad_enabled()
        with record_function(f"FSDP::post_forward {self.fqn}"):
            for g in self.groups:
                g.forward_users.discard(id(self))
                if g.forward_users:
                    continue  # a module still inside its forward uses these parameters (tied weights)
                if not grad_enabled or self.reshard_after_forward is True:
                    g.reshard()
                elif type(self.reshard_after_forward) is int and g.post_forward is not None:
                    g.reshard_to_post_forward()
            if grad_enabled and self.own:
                self.root_context().post_forward_order.append(self)
        return output

    def after_recompute(self, module: nn.Module, output: Any) -> Any:
        """Cast the output. Inside backward nothing else: backward needs these parameters next,
        and its own post-backward reshards them."""
        dtype = self.mp_policy.output_dtype
        return _cast_floats(output, dtype) if dtype is not None else output

    def members_left(self, module: nn.Module, output: Any) -> bool:
        """Guard: other modules of a list-form call have not finished this forward yet."""
        if len(self.modules) == 1:
            return False
        return len(self._members_done | {self._member_index(module)}) < len(self.modules)

    def is_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Guard: this is the root's forward (its own iteration decides what to do with a
        backward still in flight)."""
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

    # -- backward --------------------------------------------------------------------------------

    def unshard_for_backward(self) -> None:
        ctx = self.root_context()
        ctx.handle(Event.PRE_BACKWARD)
        with record_function(f"FSDP::pre_backward {self.fqn}"):
            if self.settings.unshard_in_backward:  # a no-op when the previous group's backward prefetched it
                self._unshard_groups(Reason.BACKWARD)
            # Prefetch only after our own copy-out: two all-gather outputs are never alive at once,
            # and the prefetch still overlaps all of this group's backward compute.
            implicit = ctx.backward_prefetch_target(self)
            explicit = self.settings.backward_prefetch
            for target in explicit if explicit is not None else [implicit] if implicit is not None else []:
                if target.own and target.settings.unshard_in_backward:
                    with record_function(f"FSDP::backward_prefetch {target.fqn}"):
                        for g in target.own:
                            g.unshard(Reason.BACKWARD_PREFETCH)

    def signals_left(self) -> bool:
        """Guard: a module used several times in forward reduces after the backward of its first
        use, i.e. when the last of its post-backward signals fires."""
        return self._signals_pending > 1

    def count_signal(self) -> None:
        self._signals_pending -= 1

    def reduce(self) -> None:
        self._signals_pending = 0
        self._post_backward(Reason.BACKWARD)

    def _post_backward(self, reason: Reason) -> None:
        s, results = self.settings, []
        for g in self.own:
            results += g.post_backward(
                reason,
                sync=s.requires_gradient_sync,
                reshard=s.reshard_after_backward,
                bucketed=self.default_schedule,
            )
        self.root_context().start_reduce(results)

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
            g.discard_unsharded_grads()


_I, _E = IterationPhase, Event
# The root's iteration: (phase, event) -> Step, whose action is the `RootContext` method that runs.
# A pair missing here is a bug in the caller's sequence and raises, naming both.
ITERATION: dict[tuple[IterationPhase, Event], Entry] = {
    (_I.IDLE, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.start_iteration),
    # Several forwards before one backward (an evaluation forward, or two losses summed).
    (_I.FORWARD, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.start_iteration),
    # A forward while backward is in flight: that backward raised, so autograd never ran the
    # end-of-backward callback. Recover (reshard, drop its unreduced gradients), then start.
    (_I.BACKWARD, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.recover_and_start),
    (_I.FINALIZING, _E.ROOT_FORWARD): Step(_I.FORWARD, RootContext.recover_and_start),
    # Recomputation inside backward changes nothing at the root (the groups decide what to gather).
    **{(phase, _E.RECOMPUTE): Step(phase) for phase in IterationPhase},
    (_I.FORWARD, _E.PRE_BACKWARD): Step(_I.BACKWARD, RootContext.begin_backward),
    # A backward with no forward since the last one ended: a retained graph run again.
    (_I.IDLE, _E.PRE_BACKWARD): Step(_I.BACKWARD, RootContext.begin_backward),
    (_I.BACKWARD, _E.PRE_BACKWARD): Step(_I.BACKWARD),
    (_I.BACKWARD, _E.BACKWARD_END): Step(_I.FINALIZING, RootContext.finish_backward, then=_I.IDLE),
    **{(phase, _E.RESET): Step(_I.IDLE, RootContext.reset_iteration) for phase in IterationPhase},
}


_P, _M, _S = TrainingPhase, ModuleEvent, FSDPState
# One sharded module: (phase, event) -> Step (or steps tried in order: the first whose guard holds),
# whose action is the `FSDPState` method that runs with the event's payload. A pair missing here
# raises, naming the module and both. RECOMPUTE, BACKWARD_END and RESET can come in any phase.
MODULE: dict[tuple[TrainingPhase, ModuleEvent], Entry] = {
    # then=FORWARD again: a root whose last backward raised resets every module while it starts
    # (RootContext.recover_and_start), this one included.
    (_P.IDLE, _M.FORWARD): Step(_P.FORWARD, _S.unshard_for_forward, then=_P.FORWARD),
    # List form: the next module of the call; or a module that runs inside its own forward.
    (_P.FORWARD, _M.FORWARD): Step(_P.FORWARD, _S.unshard_for_forward, then=_P.FORWARD),
    # The root's forward after a backward that raised (autograd never ran the end-of-backward
    # callback): the root's recovery resets every module, the root included, as it starts.
    **{
        (p, _M.FORWARD): Step(_P.FORWARD, _S.unshard_for_forward, then=_P.FORWARD, when=_S.is_root_forward)
        for p in (_P.PRE_BACKWARD, _P.POST_BACKWARD)
    },
    (_P.FORWARD, _M.FORWARD_DONE): (
        Step(_P.FORWARD, _S.finish_member, when=_S.members_left),  # list form: others still run
        Step(_P.IDLE, _S.after_forward),
    ),
    # Gradients reach the module's outputs (also while its forward runs: autograd.grad inside it).
    (_P.IDLE, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, _S.unshard_for_backward),
    (_P.FORWARD, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, _S.unshard_for_backward),
    # Used twice in forward: its second use's outputs get gradients too.
    (_P.PRE_BACKWARD, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, _S.unshard_for_backward),
    # A signal fires when the gradients of one forward use exist; the module reduces at the last
    # (with several uses, once for all). Without a pre-backward (its outputs reached the loss
    # only untracked) too.
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
    **{(p, _M.RECOMPUTE): Step(p, _S.unshard_for_recompute) for p in TrainingPhase},
    **{(p, _M.RECOMPUTE_DONE): Step(p, _S.after_recompute) for p in TrainingPhase},
    **{
        (p, _M.BACKWARD_END): Step(_P.POST_BACKWARD, _S.reduce_leftovers, then=_P.IDLE) for p in TrainingPhase
    },
    **{(p, _M.RESET): Step(_P.IDLE, _S.reset_module) for p in TrainingPhase},
}
