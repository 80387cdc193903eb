"""Buckets: consecutive small groups under one root that share their collectives
(docs/design.md, "Bucketing").

* all-gather: a member unsharding in a hook-driven phase gathers with the sharded members that run
  next in that direction; one copy-out fills them all, and each still reshards on its own schedule.
* reduce-scatter: members' gradients wait in the bucket until its last member in backward adds its
  own; the end of backward sends whatever is left.

`plan_buckets` bounds what a bucket holds at once by the byte budget (``set_bucket_bytes``). A member
whose settings leave the default schedule communicates alone. With more than two ranks a bucketed
reduce-scatter may differ from the unbucketed one in the last bit (summation order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .collective import Reason
from .lifecycle import ShardedState
from .param import FSDPParam
from .param_group import FSDPParamGroup, ReduceScatterResult, label


@dataclass(eq=False)
class Bucket:
    members: list[FSDPParamGroup]  # in module (forward) order
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
        """``requester`` and the sharded members on the default schedule that run next in
        ``reason``'s direction, in member order."""
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
        """End of the root's forward: members gathered with another but skipped in this forward
        give their memory back, as if they had run."""
        for g in self.members:
            if (
                (g.is_unsharded or g._all_gather is not None)
                and not g.forward_users
                and not g.pins  # an ``unsharded()`` block holds it
                and self.follows_schedule(g)
            ):
                g.reshard()

    # -- reduce-scatter --------------------------------------------------------------------------

    def add_grads(
        self, group: FSDPParamGroup, params: list[FSDPParam], grads: list[torch.Tensor], reason: Reason
    ) -> list[ReduceScatterResult]:
        """Keep ``group``'s gradients for the bucket's reduce-scatter; return the reductions this
        issues (first the waiting ones, if they cannot share a collective with these)."""
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
        """Issue the reduce-scatter of every waiting gradient (none if none)."""
        if not self._stash:
            return []
        groups = [g for g, _, _ in self._stash]
        params = [p for _, ps, _ in self._stash for p in ps]
        grads = [t for _, _, gs in self._stash for t in gs]
        self._stash.clear()
        return [groups[0].reduce_scatter(params, grads, reason, label(groups))]

    def waiting_grads(self) -> list[torch.Tensor]:
        return [t for _, _, grads in self._stash for t in grads if t is not None]

    def discard(self) -> None:
        """Drop the waiting gradients (a failed iteration)."""
        self._stash.clear()

    @property
    def holds_grads(self) -> bool:
        return bool(self._stash)


def plan_buckets(
    groups: Sequence[FSDPParamGroup | None],
    budget: int,
    follows_schedule: Callable[[FSDPParamGroup], bool],
) -> list[Bucket]:
    """Cut ``groups`` (module order; ``None``: may not share collectives) into buckets of
    consecutive groups on one mesh and all-gather dtype whose `collective_bytes` add up to at most
    ``budget``. Runs of one group are left alone. Sets every group's ``bucket``."""
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
        cost = collective_bytes(g) if g is not None else 0
        if g is None or cost > budget:
            close()
            continue
        if run and (_mesh_key(run[0]) != _mesh_key(g) or run_bytes + cost > budget):
            close()
        run.append(g)
        run_bytes += cost
    close()
    return buckets


def collective_bytes(g: FSDPParamGroup) -> int:
    """What a group adds to its bucket's collectives at their largest: twice the larger of its
    all-gather output and its reduce-scatter input (the unsharded gradients alive with their
    copy-in; on gloo, a collective's staging copy), plus its reduce-scatter output."""
    world = g.info.world_size
    reduce = world * sum(p.where.layout.shard_numel * p.dtypes.reduce.itemsize for p in g.trainable)
    return 2 * max(g.unsharded_bytes(), reduce) + reduce // world


def _mesh_key(g: FSDPParamGroup) -> tuple[object, ...]:
    info = g.info
    replicate = info.replicate_group.group_name if info.replicate_group is not None else None
    return (info.group.group_name, info.world_size, replicate, info.device, g.all_gather_dtype)
