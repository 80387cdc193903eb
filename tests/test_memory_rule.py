"""The rule that bounds the buffers alive at once (docs/design.md, "Memory: what may be alive at
once"), proved with the runtime's own accounting at every collective and every compute start, for
each ``set_collectives_in_flight`` setting. No timing: on CPU a collective counts as in flight
until the runtime completes it, whether or not the backend has finished."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from rank_utils import cpu_mesh

from fully_shard import fully_shard

DIM, BLOCKS = 20, 4  # 20 rows: uneven over 3 ranks, padded over 4


class Block(nn.Module):
    """``relu(lin(x))``: the ReLU puts the block's own pre-backward before ``lin``'s backward, so a
    hook on ``lin`` sees what is alive while the block's gradients are computed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _snapshot(model: nn.Module) -> dict:
    """What the runtime says it holds now: groups gathered or being gathered, collectives in flight
    (issued, not completed), the reduction in flight, and bytes by category (its `live_buffers`)."""
    root = model._get_fsdp_state()
    ctx = root.ctx
    gathered = [s.fqn for s in ctx.states for g in s.own if g.is_unsharded or g._all_gather is not None]
    storages: dict[int, tuple[str, int]] = {}
    for category, t in [b for s in ctx.states for b in s.live_buffers()] + ctx.live_buffers():
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            storages.setdefault(t.untyped_storage()._cdata, (category, t.untyped_storage().nbytes()))
    by_category: dict[str, int] = {}
    for category, nbytes in storages.values():
        by_category[category] = by_category.get(category, 0) + nbytes
    return {
        "gathered": gathered,
        "in_flight": sum(not p.done() for p in ctx.comm.in_flight),
        "reducing": ctx.pending_reduces[-1].parts[0].name if ctx.pending_reduces else None,
        "communication": by_category.get("communication", 0),
        "unsharded_params": by_category.get("unsharded_params", 0),
    }


class _Watch:
    """A collective observer: a snapshot right after each collective is issued."""

    def __init__(self, model: nn.Module, log: list) -> None:
        self.model, self.log = model, log

    def begin_step(self) -> None: ...

    def attach(self, root: object) -> None: ...

    def before(self, c: object) -> None: ...

    def after(self, c) -> None:  # noqa: ANN001
        self.log.append(("issued", str(c), _snapshot(self.model)))


def _alive_at_every_point(in_flight: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    mesh = cpu_mesh()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_bucket_bytes(0)  # one group per collective: the rule per group
    model.set_collectives_in_flight(in_flight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log: list = []
    for i, block in enumerate(model):
        block.lin.register_forward_pre_hook(
            lambda m, a, i=i: log.append(("forward", str(i), _snapshot(model)))
        )
        block.lin.register_full_backward_pre_hook(
            lambda m, g, i=i: log.append(("backward", str(i), _snapshot(model)))
        )
    x = torch.randn(8, DIM)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the input needs no grad
    model(x).sum().backward()  # lazy init; the observer joins from the second step
    opt.step()
    opt.zero_grad()
    model._get_fsdp_state().ctx.comm.observers.append(_Watch(model, log))
    log.clear()
    model(x).sum().backward()
    bytes_of = {s.fqn: g.unsharded_bytes() for s in model._get_fsdp_state().ctx.states for g in s.own}
    return {"log": log, "bytes_of": bytes_of, "left": _snapshot(model)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_the_buffers_alive_at_once_follow_the_rule(ranks, world_size, in_flight):
    for r in ranks(world_size).run(_alive_at_every_point, in_flight):
        log, size = r["log"], r["bytes_of"]
        compute = {(kind, i): snap for kind, i, snap in log if kind != "issued"}
        for i in range(BLOCKS):
            fwd = compute[("forward", str(i))]
            # Forward: the block computing, nothing else gathered, nothing in flight.
            assert fwd["gathered"] == [str(i)] and fwd["in_flight"] == 0, (i, fwd)
            assert fwd["unsharded_params"] == size[str(i)] and fwd["communication"] == 0, (i, fwd)
            bwd = compute[("backward", str(i))]
            ahead = [str(i - 1)] if i > 0 else []  # the block prefetched for the next backward
            assert sorted(bwd["gathered"]) == sorted([str(i)] + ahead), (i, bwd)
            # The prefetch's all-gather output is the only communication buffer, unless a reduction
            # may overlap (2): then the previous block's reduce-scatter is still in flight.
            prefetch_bytes = size[str(i - 1)] if i > 0 else 0
            overlapping = in_flight >= 2 and i < BLOCKS - 1
            assert bwd["reducing"] == (str(i + 1) if overlapping else None), (i, bwd)
            if world_size == 1:  # nothing is ever in flight on one rank
                assert bwd["in_flight"] == 0, (i, bwd)
                continue
            assert bwd["in_flight"] == min(in_flight, (i > 0) + overlapping), (i, bwd)
            if not overlapping:
                assert bwd["communication"] == prefetch_bytes, (i, bwd)
            assert bwd["unsharded_params"] == size[str(i)], (i, bwd)  # the prefetch is copied out later
        issued = [(what, snap["in_flight"]) for kind, what, snap in log if kind == "issued"]
        if world_size > 1:  # every collective: never more in flight than the setting
            assert len(issued) == 3 * BLOCKS, issued  # all-gathers in forward and backward, reductions
            # Seen as it is issued, before it counts: the room left is the setting less one.
            assert max(n for _, n in issued) == max(in_flight - 1, 0), issued
        left = r["left"]
        assert left["in_flight"] == 0 and left["reducing"] is None and left["communication"] == 0, left


def _set_collectives_in_flight_refuses(value: object) -> str:
    model = nn.Sequential(Block())
    fully_shard(model, mesh=cpu_mesh())
    try:
        model.set_collectives_in_flight(value)
    except ValueError as e:
        return str(e)
    return ""


def test_set_collectives_in_flight_refuses_bad_counts(ranks):
    for value in (-1, True, 1.5, "1"):
        for error in ranks(1).run(_set_collectives_in_flight_refuses, value):
            assert error == f"set_collectives_in_flight expects a count >= 0, got {value!r}.", error


def test_only_cpu_collectives_are_limited():
    """The setting bounds CPU work; on accelerators the streams overlap a reduce-scatter with the next
    module's backward whatever it is (a stream-ordered context, as `CommContext` builds for CUDA)."""
    from fully_shard.runtime.comm import CommContext

    comm = CommContext(torch.device("cpu"))
    assert comm.limit == 0 and not comm.reduce_overlaps_compute
    for n, overlaps in ((1, False), (2, True), (0, False)):
        comm.set_limit(n)
        assert comm.reduce_overlaps_compute is overlaps, n
    comm.uses_streams = True  # what a CUDA device sets; no stream is needed to decide
    for n in (0, 1, 2):
        comm.set_limit(n)
        assert comm.reduce_overlaps_compute, n
