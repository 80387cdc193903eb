"""`FSDPParamGroup`: the parameters of one ``fully_shard`` call, which communicate together.

One all-gather per unshard and one reduce-scatter per backward, each through one flat buffer. Work
in flight is a `Pending` value held by the group; clearing it means it is done.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..layouts.mesh import MeshInfo, PostForwardGroup, ReduceScatterGroup
from . import collectives
from .collective import HOOK_DRIVEN, Collective, Op, Reason
from .comm import CommContext, Pending
from .comm_buffers import CommBuffers
from .copying import copy_fields, refuse_busy
from .lifecycle import GROUP_STATES, ShardedState, advance
from .param import FSDPParam, wrapper_key
from .settings import Settings


class SharedCollectives(Protocol):
    """A `Bucket` (bucket.py), as its member groups use it: collectives shared with other groups."""

    def gather_with(self, requester: FSDPParamGroup, reason: Reason) -> list[FSDPParamGroup]: ...

    def waiting_grads(self) -> list[torch.Tensor]: ...

    def add_grads(
        self,
        group: FSDPParamGroup,
        params: list[FSDPParam],
        grads: list[torch.Tensor | None],
        reason: Reason,
    ) -> list[ReduceScatterResult]: ...


def label(groups: Sequence[FSDPParamGroup]) -> str:
    """How traces name the groups that share one collective: their paths joined by ``+``."""
    return "+".join(g.fqn or "<root>" for g in groups)


@dataclass(frozen=True)
class _GatherPlan:
    """One all-gather about to be issued. ``inputs`` None: read on the all-gather stream."""

    members: list[FSDPParamGroup]
    inputs: list[torch.Tensor] | None
    dtype: torch.dtype
    world: int
    rank: int
    group: Any


@dataclass(eq=False)
class AllGather:
    """One all-gather in flight, for one group or a bucket's: each rank's row holds the members'
    shards side by side, in member order."""

    pending: Pending
    world: int
    members: list[FSDPParamGroup]
    extended: bool = False  # some member's parameter all-gathers through an extension (extension.py)
    slots: int = 1  # > 1: gathering back reshard_after_forward=int shares from world / slots ranks

    def finish(self) -> None:
        """Wait, copy out into every member still waiting for it (one that resharded meanwhile
        dropped out) and swap their unsharded parameters in; the output dies here."""
        self.pending.wait()
        rows = self.pending.keep_alive[0].view(self.world, -1)
        self.pending.keep_alive = ()
        waiting = []
        for g in self.members:
            if g._all_gather is self:
                waiting.append(g)
        # Per waiting member, per parameter: its (W, bytes) targets, or None (copy_out fills it).
        targets: dict[int, list[Any]] = {}
        outs: list[torch.Tensor] | None = (
            [] if self.slots == 1 and len(waiting) == len(self.members) else None
        )
        for g in waiting:
            targets[id(g)] = mine = []
            for p in g.params:
                target = p.all_gather_targets()
                mine.append(target)
                if target is None:
                    outs = None
                elif outs is not None:
                    outs.extend(target)
        # Extension outputs may be the unsharded parameter's own data, saved by autograd: writing
        # them must not bump the version it checks.
        ext = self._extension_outputs(waiting) if self.extended else ()
        with torch.autograd._unsafe_preserve_version_counter(ext) if ext else contextlib.nullcontext():
            if outs is not None:  # every member waits, every target a (W, bytes) view: one copy
                collectives.all_gather_copy_out(rows, self.world, outs)
            else:
                self._copy_out(rows, targets)
        for g in waiting:
            g._all_gather = None
            g._mark_unsharded()

    def _extension_outputs(self, waiting: list[FSDPParamGroup]) -> tuple[torch.Tensor, ...]:
        return tuple(
            t
            for g in waiting
            for p in g.params
            if p.ext is not None and p.uses_extension
            for t in p.ext.outputs
        )

    def _copy_out(self, rows: torch.Tensor, targets: dict[int, list[Any]]) -> None:
        """Member by member: some member resharded meanwhile, a parameter is sharded on a dim
        other than 0, or ``slots`` > 1."""
        offset = 0
        for g in self.members:
            width = self.slots * g.row_bytes()
            if id(g) in targets:
                g._copy_out(rows[:, offset : offset + width], self.slots, targets[id(g)])
            offset += width


@dataclass
class ReduceScatterPart:
    """One reduce-scatter in flight (one per reduce dtype in the group) and where its output goes."""

    pending: Pending
    output: torch.Tensor
    params: list[FSDPParam]
    plan: collectives.Reduction  # how it divides (what is left to divide by after it)
    reason: Reason = Reason.BACKWARD
    name: str = ""  # the group(s) it reduces, as traces name them
    # HSDP: the deferred partial sums of ``params``, taken when it was issued, added to its output.
    partials: list[torch.Tensor | None] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # positions in ``params`` this rank sent zeros for


@dataclass
class ReduceScatterResult:
    """A group's gradient reduction in flight: usually one part, one per reduce dtype if mixed."""

    parts: list[ReduceScatterPart]

    def finish(self) -> None:
        """Wait for the reduction and add its output to the sharded gradients."""
        with record_function(f"FSDP::reduce_scatter_wait {self.parts[0].name}"), torch.no_grad():
            for part in self.parts:
                part.pending.wait()  # CPU: runs `FSDPParamGroup._after_reduce_scatter` here


class FSDPParamGroup:
    def __init__(self, params: list[FSDPParam], info: MeshInfo, fqn: str) -> None:
        self.params = params
        for p in params:
            p.group = self
        self.info = info
        self.fqn = fqn
        self.refresh()
        self.comm: CommContext | None = None  # shared by every group under one root, set at lazy init
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGather | None = None
        # The root's finite check (finite.py), when on: sees each gradient before it is reduced.
        self.grad_observer: Callable[[FSDPParam, torch.Tensor], None] | None = None
        self.bucket: SharedCollectives | None = None  # set at lazy init
        self._gathered_versions: list[int] = []  # of the shards the unsharded copy came from
        # Something changed behind the group's back (`notice_changes`): the next unshard drops any
        # copy and takes it over first. True at first: that unshard resolves extensions, refuses meta.
        self.needs_sync = True
        self.extended = False  # some parameter all-gathers through an extension (extension.py)
        self._reductions: dict[tuple[torch.dtype, float | None, bool], collectives.Reduction] = {}
        # reshard_after_forward=int: the smaller group, and this rank's share while resharded to it.
        self.post_forward: PostForwardGroup | None = None
        self._post_forward_shard: torch.Tensor | None = None
        # States between their pre- and post-forward that use these parameters (the owner and
        # modules tied to them): the last one out reshards.
        self.forward_users: set[int] = set()
        self.pins = 0  # open ``unsharded()`` blocks: a forward inside one does not reshard it
        # CPUOffloadPolicy on an accelerator: events after each asynchronous gradient copy to the host.
        self.offload_events: list[torch.Event] = []
        self.settings = Settings()  # the owning call's, frozen; its state hands it over
        # Under torch.compile: the flag by which the next gather's backward that adds taken sums adds
        # them once (traced._sums_once); made by set_requires_gradient_sync / set_requires_all_reduce.
        self.traced_once: torch.Tensor | None = None
        # FSDPModule.set_separate_reduce_scatter_group: the reduce-scatter's own process group
        self.separate_rs: ReduceScatterGroup | None = None
        # set_allocate_memory_from_process_group_for_comm / set_symm_mem_for_comm (comm_buffers.py)
        self.comm_buffers: CommBuffers | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPParamGroup:
        if (
            self.sharded_state is not ShardedState.SHARDED
            or self._all_gather is not None
            or self.offload_events
        ):
            refuse_busy(f"group {self.fqn or '<root>'}", "holds unsharded parameters or work in flight")
        for p in self.params:
            p.precopy(memo)
        # comm: the copy's root gives it streams at lazy init.
        return copy_fields(
            self,
            memo,
            comm=None,
            bucket=None,
            grad_observer=None,
            forward_users=set(),
            _post_forward_shard=None,
            needs_sync=True,
        )

    def derive_dtypes(self) -> None:
        """The settings' reduce dtype changed: each parameter derives its dtypes again."""
        for p in self.params:
            p.derive_dtypes()
        self.refresh()

    def refresh(self) -> None:
        """Re-derive what the group reads off its parameters (after one was replaced or converted)."""
        self.trainable = [p for p in self.params if p.requires_grad]
        param_dtypes = {p.dtypes.param for p in self.params}
        # The all-gather moves bytes; traces show the dtype when the group has one.
        self.all_gather_dtype = param_dtypes.pop() if len(param_dtypes) == 1 else torch.uint8

    def sync_params(self, adopt_device: bool = False) -> None:
        """Take over parameters replaced or converted while sharded, resolve which all-gather
        through an extension, and refuse to gather any still on the meta device."""
        changed = False
        for p in self.params:
            changed |= p.sync_with_module(adopt_device)
        # A list, not a generator: every parameter must resolve, not just those up to the first hit.
        self.extended = any([p.resolve_extension() for p in self.params])  # noqa: C419
        if changed:
            self.refresh()
            self._refuse_meta(adopt_device)
        self.needs_sync = False

    def notice_changes(self) -> None:
        """Set ``needs_sync`` on what no event reports (checked once per iteration and before an
        explicit unshard): a shard's local tensor swapped, ``requires_grad`` flipped, a shard written
        while an unsharded copy is held, a parameter deleted or set to None; ``p.data = t`` raises.

        DTensor writes its local tensor below autograd, so the local version counter misses
        optimizer steps and ``load_state_dict`` while the DTensor's sees them, and the DTensor's
        misses writes through ``to_local()``: the sum sees both."""
        versions = self._gathered_versions if self.holds_copy else None
        for i, p in enumerate(self.params):
            sp, seen = p.sharded_param, p._seen
            local = sp._local_tensor
            if seen is not None and local is seen[0] and wrapper_key(sp) != seen[1]:
                p.data_assigned()  # p.data = t: taken over (plain) or refused
                self.needs_sync = True
                return
            if (
                sp.requires_grad != p.requires_grad
                or seen is None
                or local is not seen[0]
                or (versions is not None and versions[i] != sp._version + local._version)
            ):
                self.needs_sync = True
                return
            for place in p.places:
                held = place.module._parameters.get(place.name)
                if held is None or (held is not sp and held is not p.unsharded_param):
                    self.needs_sync = True
                    return

    def _refuse_meta(self, adopt_device: bool) -> None:
        on_meta = [p.path for p in self.params if p.local_shard.is_meta]
        if on_meta and not adopt_device and self.info.device.type != "meta":  # meta mesh: a simulation
            raise RuntimeError(
                f"fully_shard group {self.fqn or '<root>'}: parameters {on_meta} are still on the meta "
                "device, so there is nothing to compute with. Fix: after fully_shard, call "
                "model.to_empty(device=...) and then initialise them (model.reset_parameters(), or "
                "set_model_state_dict / load_state_dict)."
            )

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.fqn or '<root>'}, {len(self.params)} params, {self.sharded_state.name})"

    def _set_sharded_state(self, to: ShardedState) -> None:
        if to is not self.sharded_state and to not in GROUP_STATES[self.sharded_state]:
            advance(GROUP_STATES, self.sharded_state, to, f"group {self.fqn or '<root>'}")  # raises
        self.sharded_state = to

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """Where this group's reduce-scatter runs: its shard group, or the reduce-scatter's own."""
        return self.separate_rs.group if self.separate_rs is not None else self.info.group

    def _all_gather_comm(self) -> Any:
        """The custom all-gather, else the buffer source's (None: the caching allocator)."""
        custom = self.settings.custom_all_gather
        if custom is None and self.comm_buffers is not None:
            return self.comm_buffers.all_gather
        return custom

    def _reduce_scatter_comm(self) -> Any:
        custom = self.settings.custom_reduce_scatter
        if custom is None and self.comm_buffers is not None:
            return self.comm_buffers.reduce_scatter
        return custom

    def _comm(self) -> CommContext:
        if self.comm is None:
            raise RuntimeError(
                f"fully_shard group {self.fqn or '<root>'} is used before lazy init: run the root module's "
                "forward first (or call unshard() on the root)."
            )
        return self.comm

    # -- all-gather ------------------------------------------------------------------------------

    def unshard(self, reason: Reason = Reason.EXPLICIT, after: torch.Event | None = None) -> None:
        """Issue the all-gather (idempotent); `wait_for_unshard` makes the result usable.

        ``after``: a post-optimizer event the all-gather stream waits for instead of the whole
        compute stream. A copy gathered before a shard changed is dropped and gathered again.
        """
        if reason not in HOOK_DRIVEN:  # hook-driven ones: the root's forward start looked
            self.notice_changes()
        if self.needs_sync:
            self.reshard()
            with torch.no_grad():
                self.sync_params()
        if self.sharded_state is ShardedState.UNSHARDED or self._all_gather is not None:
            return
        self._issue_gather(self._plan_gather(reason), reason, after)

    def _plan_gather(self, reason: Reason) -> _GatherPlan:
        """Who gathers with this group, over which ranks, in which dtype."""
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            # Gather back from the smaller group's shares; they came from the last full gather,
            # so the gathered versions stay those of that gather.
            assert self.post_forward is not None and self._post_forward_shard is not None
            pf = self.post_forward
            return _GatherPlan([self], [self._post_forward_shard], torch.uint8, pf.size, pf.rank, pf.group)
        members = (
            self.bucket.gather_with(self, reason)
            if self.bucket is not None and reason in HOOK_DRIVEN
            else [self]
        )
        extended = False
        for g in members:
            versions = g._gathered_versions
            versions.clear()
            for p in g.params:
                sp = p.sharded_param
                versions.append(sp._version + sp._local_tensor._version)
            extended = extended or g.extended
        # Extensions choose their inputs' dtypes: one byte all-gather carries them all.
        dtype = torch.uint8 if extended else self.all_gather_dtype
        return _GatherPlan(members, None, dtype, self.info.world_size, self.info.rank, self.info.group)

    def _issue_gather(self, plan: _GatherPlan, reason: Reason, after: torch.Event | None) -> None:
        comm, members, world = self._comm(), plan.members, plan.world
        custom = self._all_gather_comm() if world == self.info.world_size else None
        # inference_mode(False): a first forward under torch.inference_mode must not make the
        # buffers (reused for training) inference tensors.
        with (
            record_function(f"FSDP::all_gather {self.fqn}"),
            torch.no_grad(),
            torch.inference_mode(False),
            comm.on(comm.all_gather_stream, after),
        ):
            inputs = plan.inputs
            if inputs is None:  # read on the all-gather stream: offloaded shards are copied there
                inputs = []
                for g in members:
                    g._all_gather_inputs(plan.dtype, inputs)
            ag_input, output = collectives.all_gather_copy_in(
                inputs, world, plan.rank, plan.dtype, self.info.device, custom
            )
            name = (self.fqn or "<root>") if len(members) == 1 else label(members)
            c = Collective(Op.ALL_GATHER, reason, name, plan.dtype, output.numel(), plan.group)
            # One rank: the copy-in already wrote the whole output.
            run = functools.partial(
                collectives.all_gather, output, ag_input, plan.group, comm.async_op, custom
            )
            work = comm.issue(c, run) if world > 1 else None
            stream = comm.all_gather_stream
            event = stream.record_event() if stream is not None else None
        extended = plan.dtype == torch.uint8 and any(p.uses_extension for g in members for p in g.params)
        pending = Pending(work=work, event=event, keep_alive=(output,), what=c, keeps_output=True)
        gather = AllGather(pending, world, members, extended, self.info.world_size // world)
        for g in members:
            g._all_gather = gather
        comm.track(pending)  # after: a watchdog dump during its wait shows the all-gather in flight

    def _all_gather_inputs(self, dtype: torch.dtype, inputs: list[torch.Tensor]) -> None:
        """Append this group's inputs: with one dtype each shard (copy-in casts it); with several,
        or extensions, each parameter's inputs as bytes."""
        for p in self.params:
            if dtype != torch.uint8:
                inputs.append(p.all_gather_input())
            elif p.uses_extension:
                inputs.extend(p.extension_inputs())
            else:
                inputs.append(p.all_gather_input_bytes())

    def row_bytes(self) -> int:
        """Bytes this group puts in each rank's row of a full all-gather."""
        return sum(p.row_bytes() for p in self.params)

    def unsharded_bytes(self) -> int:
        """Bytes of this group's unsharded parameters (padding included)."""
        return self.info.world_size * self.row_bytes()

    def wait_for_unshard(self) -> None:
        """Wait for the all-gather and swap the unsharded parameters in (for every group sharing it)."""
        gather = self._all_gather
        if gather is None:
            return
        with (
            record_function(f"FSDP::all_gather_copy_out {self.fqn}"),
            torch.no_grad(),
            torch.inference_mode(False),
        ):
            gather.finish()

    def _copy_out(self, rows: torch.Tensor, slots: int, targets: list[list[torch.Tensor] | None]) -> None:
        """Fill the unsharded parameters from this group's ``(W', slots * row_bytes)`` columns
        (``slots`` > 1: reshard_after_forward=int shares from ``W' = W / slots`` ranks)."""
        world = rows.shape[0]
        offset = 0
        for p, target in zip(self.params, targets):
            if target is None:  # sharded on another dim: copy_out moves the chunks into place
                nbytes = slots * p.where.layout.shard_numel * p.dtypes.param.itemsize
                p.copy_out(rows[:, offset : offset + nbytes].view(p.dtypes.param))
                offset += nbytes
                continue
            for t in target:
                nbytes = slots * t.shape[1]
                t.view(world, -1).copy_(rows[:, offset : offset + nbytes])
                offset += nbytes

    def show_form(self, unsharded: bool) -> None:
        """While unsharded, point the modules at one form without changing state (state dicts)."""
        if not self.is_unsharded:
            return
        for p in self.params:
            shown, other = (
                (p.sharded_param, p.unsharded_param) if unsharded else (p.unsharded_param, p.sharded_param)
            )
            for place in p.places:
                if place.get() is shown:  # a place the load assigned something else keeps it
                    place.set(other)

    def _mark_unsharded(self) -> None:
        for p in self.params:
            p.to_unsharded()
        self._post_forward_shard = None
        self._set_sharded_state(ShardedState.UNSHARDED)

    def is_stale(self) -> bool:
        """Whether this group holds an unsharded copy it must not use (`needs_sync`)."""
        self.notice_changes()
        return self.holds_copy and self.needs_sync

    @property
    def holds_copy(self) -> bool:
        """Whether an unsharded copy of the shards exists (gathered, or being gathered)."""
        return self.sharded_state is not ShardedState.SHARDED or self._all_gather is not None

    # -- reshard ---------------------------------------------------------------------------------

    def reshard(self) -> None:
        """Free the unsharded parameters and point the modules at the shards (idempotent)."""
        if self._all_gather is not None:  # prefetched, never used: let it land before dropping its buffer
            self._all_gather.pending.wait()
            self._all_gather = None
        self._post_forward_shard = None
        if self.sharded_state is ShardedState.UNSHARDED:
            for p in self.params:
                p.to_sharded()
        self._set_sharded_state(ShardedState.SHARDED)

    def reshard_to_post_forward(self) -> None:
        """Keep only this rank's share of the unsharded parameters over the smaller group."""
        assert self.post_forward is not None
        if not self.is_unsharded:
            return
        size, pos = self.post_forward.size, self.post_forward.rank
        rows = self.info.world_size // size  # shard-world rows each member of the smaller group keeps
        with torch.no_grad():
            self._post_forward_shard = torch.cat([p.gathered_rows(pos * rows, rows) for p in self.params])
        for p in self.params:
            p.to_sharded()
        self._set_sharded_state(ShardedState.SHARDED_POST_FORWARD)

    # -- reduce-scatter --------------------------------------------------------------------------

    def post_backward(
        self,
        reason: Reason = Reason.BACKWARD,
        *,
        sync: bool = True,
        reshard: bool = True,
        bucketed: bool = False,
    ) -> list[ReduceScatterResult]:
        """Reshard (if ``reshard``), then reduce every unsharded gradient made so far (if ``sync``;
        else they keep accumulating on the unsharded parameters). ``bucketed``: hand them to the
        bucket instead. Returns the reductions issued (none, one, or a bucket's)."""
        with record_function(f"FSDP::post_backward {self.fqn}"):
            params, grads, any_grad = [], [], False
            for p in self.trainable if sync else ():
                grad = p.take_unsharded_grad()
                if grad is not None and self.grad_observer is not None:
                    self.grad_observer(p, grad)
                if grad is None and self.settings.requires_all_reduce:
                    grad = p.zero_grad_if_partial()  # a deferred HSDP sum still to all-reduce
                if p.where.layout.shard_numel == 0:  # a size-0 parameter: nothing to reduce
                    if grad is not None:
                        p.accumulate_sharded_grad(grad.new_empty(0, dtype=p.dtypes.reduce))
                    continue
                # None where this rank has no gradient (it sends zeros): ranks that route
                # differently (MoE) still agree on the layout.
                if grad is not None or self.settings.reduce_unused:
                    params.append(p)
                    grads.append(grad)
                    any_grad = any_grad or grad is not None
            for p in self.trainable if not sync else ():
                p.hold_unsynced()
            if reshard:
                self.reshard()
            if not any_grad:  # nothing on this rank: no reduction (as every rank, usually)
                results = []
            elif bucketed and self.bucket is not None:
                results = self.bucket.add_grads(self, params, grads, reason)
            else:
                results = [self.reduce_scatter(params, grads, reason, self.fqn)]
        return results

    def live_buffers(self) -> list[tuple[str, torch.Tensor | None]]:
        """The tensors this group holds, with their categories: its ``reshard_after_forward=int``
        share, gradients waiting in its bucket, an all-gather in flight, then each parameter's."""
        out: list[tuple[str, torch.Tensor | None]] = [("unsharded_params", self._post_forward_shard)]
        if self.bucket is not None:
            out += [("gradients", t) for t in self.bucket.waiting_grads()]
        if self._all_gather is not None:
            out += [("communication", t) for t in self._all_gather.pending.keep_alive]
        for p in self.params:
            out += p.live_buffers()
        return out

    def wait_for_offloaded_grads(self) -> None:
        """Block the host until every gradient copied to it this backward has landed."""
        for event in self.offload_events:
            event.synchronize()
        self.offload_events.clear()

    def lower_grads(self) -> None:
        for p in self.trainable:
            p.lower_grad()

    def discard_unsharded_grads(self) -> bool:
        """Drop every unreduced gradient; whether there was one."""
        dropped = False
        for p in self.trainable:
            dropped = p.discard_accumulated() or dropped
            dropped = p.take_partial_reduce() is not None or dropped  # HSDP sums deferred
        return dropped

    def reduce_scatter(
        self, params: list[FSDPParam], grads: list[torch.Tensor | None], reason: Reason, name: str
    ) -> ReduceScatterResult:
        """Reduce ``grads`` (this group's, or a bucket's with this group's reduction key) with one
        reduce-scatter per reduce dtype; ``name`` labels it in traces."""
        by_dtype: dict[torch.dtype, tuple[list[FSDPParam], list[torch.Tensor]]] = {}
        for p, g in zip(params, grads):
            bucket = by_dtype.setdefault(p.dtypes.reduce, ([], []))
            bucket[0].append(p)
            bucket[1].append(g)
        grads.clear()
        parts = []
        for dtype, (ps, gs) in by_dtype.items():
            parts.append(self._reduce_scatter_one(ps, gs, dtype, reason, name))
        return ReduceScatterResult(parts)

    def _reduce_scatter_one(
        self,
        params: list[FSDPParam],
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        reason: Reason,
        name: str,
    ) -> ReduceScatterPart:
        """One reduce-scatter of ``grads`` (None: zeros are sent), then, with ``reduce_unused``, one
        count per parameter of the ranks that had a gradient: a parameter no rank had one for keeps
        its ``.grad`` as it was, as in single-process training."""
        comm, info, custom = self._comm(), self.info, self._reduce_scatter_comm()
        key = (dtype, self.settings.gradient_divide_factor, self.settings.force_sum_reduction)
        plan = self._reductions.get(key) or self._reduction(key)
        with torch.no_grad():
            rs_input, slot, missing = self._reduce_scatter_input(params, grads, dtype, plan.before)
            with comm.on(comm.reduce_scatter_stream):
                nbytes = rs_input.numel() * rs_input.element_size()
                group = self.reduce_scatter_group
                c = Collective(Op.REDUCE_SCATTER, reason, name, dtype, nbytes, group, plan)
                if info.world_size == 1:  # one rank: its gradients are the reduced ones
                    output, work = rs_input, None
                else:
                    output = collectives.empty_buffer(slot, dtype, info.device, custom)
                    args = (output, rs_input, group, comm.async_op, plan.op, custom)
                    work = comm.issue(c, functools.partial(collectives.reduce_scatter, *args))
                pending = Pending(work=work, keep_alive=(rs_input,), what=c)
                part = ReduceScatterPart(pending, output, params, plan, reason, name, missing=missing)
                self._settle(part, comm)
                comm.track(pending)
        return part

    def _settle(self, part: ReduceScatterPart, comm: CommContext) -> None:
        """Run the HSDP all-reduce and the accumulation once the reduce-scatter lands (stream-ordered
        on accelerators, no host wait; in `ReduceScatterResult.finish` on CPU)."""
        if self.info.is_hsdp and self.settings.requires_all_reduce:
            part.partials = [p.take_partial_reduce() for p in part.params]
        comm.settle(part.pending, functools.partial(self._after_reduce_scatter, part))
        if part.pending.event is not None and any(p.where.offload for p in part.params):
            self.offload_events.append(part.pending.event)  # the host waits before the optimizer

    def _reduction(self, key: tuple[torch.dtype, float | None, bool]) -> collectives.Reduction:
        """Plan (once per key: dtype, divide factor, force sum) how a reduction divides."""
        dtype, factor, force_sum = key
        info = self.info
        plan = self._reductions[key] = collectives.plan_reduction(
            info.data_parallel_size if factor is None else factor,
            dtype,
            info.world_size,
            info.data_parallel_size,
            info.native_avg,
            force_sum,
        )
        return plan

    def _reduce_scatter_input(
        self,
        params: list[FSDPParam],
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        before: float,
    ) -> tuple[torch.Tensor, int, list[int]]:
        """The flat input (zeros for missing gradients, then the used-counts), each rank's slot
        size, and where this rank had no gradient. Made on the compute stream, where the gradients
        were: they are freed right after, with no cross-stream hazard."""
        device = self.info.device
        # _chunk_cat wants one input dtype (it casts to ``dtype`` on the way): the gradients', or
        # ``dtype`` where they differ (a sum accumulated apart in the reduce dtype beside a bf16 one).
        gdtypes = {g.dtype for g in grads if g is not None}
        if len(gdtypes) > 1:
            gdtype = dtype
            grads[:] = [g if g is None or g.dtype == dtype else g.to(dtype) for g in grads]
        else:
            gdtype = next(iter(gdtypes), dtype)
        inputs, slot, missing = [], 0, []
        for i, (p, g) in enumerate(zip(params, grads)):
            slot += p.where.layout.shard_numel
            if g is None:
                missing.append(i)
                g = torch.zeros(p.where.layout.moved_shape, dtype=gdtype, device=device)
            inputs.append(g)
        if self.settings.reduce_unused:  # each rank puts its 0/1 in every row: all receive the totals
            had = torch.ones(len(params), dtype=gdtype, device=device)  # made on the device: no host copy
            for i in missing:
                had[i] = 0
            inputs.append(had.expand(self.info.world_size, len(params)))
            slot += len(params)
        custom = self._reduce_scatter_comm()
        rs_input = collectives.reduce_scatter_copy_in(
            inputs, self.info.world_size, slot, dtype, device, custom
        )
        grads.clear()
        inputs.clear()
        if before != 1:
            rs_input.div_(before)
        return rs_input, slot, missing

    def _after_reduce_scatter(self, part: ReduceScatterPart) -> None:
        """HSDP: all-reduce over the replicas, or keep this backward's sums as partials when that
        is deferred. Then the all-reduce hook, the division left, and add to the sharded gradients."""
        output, info = part.output, self.info
        shards, offset = [], 0  # each parameter's slot of ``output``: this rank's padded shard
        for p in part.params:
            shards.append(output.narrow(0, offset, p.where.layout.shard_numel))
            offset += p.where.layout.shard_numel
        deferred = info.is_hsdp and info.replicate_size > 1 and not self.settings.requires_all_reduce
        if info.is_hsdp and info.replicate_size > 1 and not deferred:
            self._all_reduce(part, shards)
        if self.settings.all_reduce_hook is not None and not deferred:
            self._run_all_reduce_hook(output)
        if part.plan.after != 1 and not deferred:
            output.div_(part.plan.after)
        # The used-counts follow the shards; read only when this rank missed some (a host sync on
        # accelerators, in that rare case only).
        used = output.narrow(0, offset, len(shards)).tolist() if part.missing else None
        for i, p in enumerate(part.params):
            if used is not None and used[i] == 0:  # no rank had a gradient: .grad stays as it was
                continue
            if deferred:
                p.add_partial_reduce(shards[i])
            else:
                p.accumulate_sharded_grad(shards[i])

    def _all_reduce(self, part: ReduceScatterPart, shards: list[torch.Tensor]) -> None:
        """HSDP: add the sums deferred by earlier backwards, then sum over the replicas."""
        for shard, partial in zip(shards, part.partials):
            if partial is not None:
                shard.add_(partial)
        group, output = self.info.replicate_group, part.output
        assert group is not None
        nbytes = output.numel() * output.element_size()
        c = Collective(Op.ALL_REDUCE, part.reason, part.name, output.dtype, nbytes, group, part.plan)
        run = functools.partial(dist.all_reduce, output, op=part.plan.all_reduce_op, group=group)
        self._comm().issue(c, run)

    def _run_all_reduce_hook(self, output: torch.Tensor) -> None:
        stream = self.settings.all_reduce_hook_stream
        if stream is None:
            assert self.settings.all_reduce_hook is not None
            self.settings.all_reduce_hook(output)
            return
        current = self._comm().streams.current()
        stream.wait_stream(current)
        with stream:
            self.settings.all_reduce_hook(output)  # type: ignore[misc]
        current.wait_stream(stream)
