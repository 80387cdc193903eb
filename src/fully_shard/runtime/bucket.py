"""Buckets: consecutive small groups under one root that share their collectives.

Many small ``fully_shard`` groups (a deep stack of narrow blocks) pay a collective's fixed cost,
and our per-group copy-in and copy-out, once per group per step. A `Bucket` lets them pay it once:

* **all-gather**: when a member needs its parameters in a hook-driven phase, the members that run
  next in that direction (after it in forward, before it in backward), and are sharded, gather in
  the same collective; each rank's row holds their shards side by side. One copy-out fills them
  all; each member reshards on its own schedule, so its memory is freed as before.
* **reduce-scatter**: a member's gradients wait in the bucket until its last member in backward
  (the first in forward order with trainable parameters) adds its own, then go in one
  reduce-scatter; the end of backward sends whatever is left (members that did not run).

The rule (`plan_buckets`): walking the root's groups in module order, consecutive groups join one
bucket while their unsharded parameter bytes add up to at most the budget (``set_bucket_bytes``,
default `DEFAULT_BUCKET_BYTES`); a group that is the root's, or bigger than the budget, or on
another mesh or all-gather dtype, or offloaded, tensor-parallel, tied to another module, ends the
run. So the memory a bucket adds is bounded: at most one budget of unsharded parameters and one of
waiting gradients beyond one group's. At run time a member whose settings leave the default
schedule (``reshard_after_forward`` not True, explicit prefetch, no unshard or reshard in
backward) communicates alone, and gradients with another division or reduce op go in another
collective (`Settings.reduction_key`).

Numerics: the all-gather is exact; a reduce-scatter sums each element over the ranks. With one or
two ranks that sum has one possible value; with more, the collective's summation order for an
element can depend on where it lies in the buffer (gloo and NCCL split buffers by size), so a
bucketed sum may differ from the unbucketed one in the last bit, as it does when modules are
wrapped differently. ``set_bucket_bytes(0)`` gives the unbucketed collectives exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .lifecycle import ShardedState
from .param import FSDPParam
from .collective import Reason
from .param_group import FSDPParamGroup, ReduceScatterResult, label

# 1 MiB: below that a collective costs mostly its fixed latency on any backend (NCCL: tens of
# microseconds, about what 1 MiB takes at NVLink/IB bandwidths; gloo: a fraction of a millisecond),
# so sharing one pays; above it, bucketing saves little and costs memory. The extra memory a
# bucket can hold is bounded by the budget, which leaves the peak of a model whose blocks are
# bigger than 1 MiB unchanged (docs/benchmarks.md).


@dataclass(eq=False)
class Bucket:
    members: list[FSDPParamGroup]  # in module (forward) order
    # Whether a member follows the default schedule right now (its FSDPState's settings).
    follows_schedule: Callable[[FSDPParamGroup], bool]
    _stash: list[tuple[FSDPParamGroup, list[FSDPParam], list[torch.Tensor]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._position = {id(g): i for i, g in enumerate(self.members)}
        for g in self.members:
            g.bucket = self

    @property
    def name(self) -> str:
        return label(self.members)

    # -- all-gather ------------------------------------------------------------------------------

    def gather_with(self, requester: FSDPParamGroup, reason: Reason) -> list[FSDPParamGroup]:
        """The groups to all-gather with ``requester`` (itself included, in member order): the
        sharded members on the default schedule that run next in ``reason``'s direction."""
        if not self.follows_schedule(requester):
            return [requester]
        i = self._position[id(requester)]
        ahead = self.members[i + 1 :] if reason.forward else self.members[:i]
        chosen = []
        for g in ahead:
            if not self.follows_schedule(g):
                continue
            if g.needs_sync:
                g.reshard()
                with torch.no_grad():
                    g.sync_params()
            if g.sharded_state is not ShardedState.SHARDED or g._all_gather is not None:
                continue
            if g.all_gather_dtype == requester.all_gather_dtype:
                chosen.append(g)
        chosen.append(requester)
        return sorted(chosen, key=lambda g: self._position[id(g)])

    def reshard_unused(self) -> None:
        """End of the root's forward: members gathered with another but not run in this forward
        (a skipped block) give their memory back now, as if they had run."""
        for g in self.members:
            if (
                (g.is_unsharded or g._all_gather is not None)
                and not g.forward_users
                and self.follows_schedule(g)
            ):
                g.reshard()

    # -- reduce-scatter --------------------------------------------------------------------------

    def add_grads(
        self, group: FSDPParamGroup, params: list[FSDPParam], grads: list[torch.Tensor], reason: Reason
    ) -> list[ReduceScatterResult]:
        """Keep ``group``'s gradients for the bucket's reduce-scatter; return the reductions this
        issues (the waiting ones first if they cannot share a collective with these)."""
        results = []
        if self._stash and (
            self._stash[0][0].settings.reduction_key() != group.settings.reduction_key()
            or any(g is group for g, _, _ in self._stash)
        ):
            results += self.flush(reason)
        self._stash.append((group, params, grads))
        last = next((g for g in self.members if g.trainable), None)  # the last member in backward
        if group is last:
            results += self.flush(reason)
        return results

    def flush(self, reason: Reason) -> list[ReduceScatterResult]:
        """Issue the reduce-scatter of every gradient waiting in the bucket (none if none)."""
        if not self._stash:
            return []
        groups = [g for g, _, _ in self._stash]
        params = [p for _, ps, _ in self._stash for p in ps]
        grads = [t for _, _, gs in self._stash for t in gs]
        self._stash.clear()
        return [groups[0].reduce_scatter(params, grads, reason, label(groups))]

    def waiting_grads(self) -> list[torch.Tensor]:
        """The gradients held for the bucket's next reduce-scatter (every member's)."""
        return [t for _, _, grads in self._stash for t in grads if t is not None]

    def discard(self) -> None:
        """Drop the waiting gradients (a failed iteration: `RootContext.reset`)."""
        self._stash.clear()

    @property
    def holds_grads(self) -> bool:
        return bool(self._stash)


def plan_buckets(
    groups: Sequence[Optional[FSDPParamGroup]],
    budget: int,
    follows_schedule: Callable[[FSDPParamGroup], bool],
) -> list[Bucket]:
    """Cut ``groups`` (module order; ``None`` for a group that may not share collectives) into
    buckets of consecutive groups on one mesh and all-gather dtype whose unsharded bytes add up
    to at most ``budget``. Runs of one group are left alone. Every group's ``bucket`` is set."""
    for g in groups:
        if g is not None:
            g.bucket = None
    buckets: list[Bucket] = []
    run: list[FSDPParamGroup] = []
    run_bytes = 0

    def close() -> None:
        nonlocal run, run_bytes
        if len(run) > 1:
            buckets.append(Bucket(run, follows_schedule))
        run, run_bytes = [], 0

    for g in groups:
        if g is None or g.unsharded_bytes() > budget:
            close()
            continue
        if run and (_mesh_key(run[0]) != _mesh_key(g) or run_bytes + g.unsharded_bytes() > budget):
            close()
        run.append(g)
        run_bytes += g.unsharded_bytes()
    close()
    return buckets


def _mesh_key(g: FSDPParamGroup) -> tuple[object, ...]:
    info = g.info
    replicate = info.replicate_group.group_name if info.replicate_group is not None else None
    return (info.group.group_name, info.world_size, replicate, info.device, g.all_gather_dtype)
