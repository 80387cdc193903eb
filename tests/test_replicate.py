"""``replicate``: data parallelism without sharding on the same engine (issue #12 item 5), against
the float64 single-process reference, PyTorch's ``replicate`` (bit for bit at world <= 2) and
composed with ``fully_shard`` in one model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from _parity import _mlp_loss, _train_pair, check, make_mlp, max_abs_diff, mlp_batch
from rank_utils import cpu_mesh, world


def _replicated(compose: bool) -> dict:
    from fully_shard import ReplicateModule, debug, fully_shard, replicate

    model = make_mlp()
    ref = copy.deepcopy(model)
    if compose:  # small blocks replicated, the first sharded, the root sharded
        fully_shard(model[0], mesh=cpu_mesh())
        replicate(model[1], mesh=cpu_mesh())
        replicate(model[2], mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
    else:
        for block in model[:3]:
            replicate(block, mesh=cpu_mesh())
        replicate(model, mesh=cpu_mesh())
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    with debug.trace() as t:
        out = _train_pair(model, ref, mlp_batch, _mlp_loss, 3)
    out["placements"] = placements
    out["kinds"] = sorted({r.op for r in t.select(step=1)})
    out["is_replicate"] = isinstance(model[1], ReplicateModule)
    return out


def _vs_torch_replicate() -> dict:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    from fully_shard import replicate

    ours, theirs = make_mlp(), make_mlp()
    for m, fn in ((ours, replicate), (theirs, torch_replicate)):
        for block in m[:3]:
            fn(block, mesh=cpu_mesh())
        fn(m, mesh=cpu_mesh())
    rank, w = world()
    for m in (ours, theirs):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            x, y = mlp_batch(step)
            _mlp_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opt.step()
            opt.zero_grad()
    return {"vs_torch": max_abs_diff(ours, theirs)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("compose", [False, True])
def test_replicate_trains_like_the_reference(ranks, world_size, compose):
    results = ranks(world_size).run(_replicated, compose)
    check(results, f"replicate compose={compose} vs single process (float64)")
    for r in results:
        assert r["is_replicate"], r
        for name, placements in r["placements"].items():
            sharded = compose and (name.startswith("0.") or name.startswith("3."))
            assert placements == ((Shard(0),) if sharded else (Replicate(),)), (name, placements)
        if world_size > 1:  # replicas: only all-reduces (and, composed, the sharded modules' collectives)
            assert r["kinds"] == (["all_gather", "all_reduce", "reduce_scatter"] if compose else ["all_reduce"]), r


@pytest.mark.parametrize("world_size", [2])
def test_replicate_matches_pytorch_replicate(ranks, world_size):
    for r in ranks(world_size).run(_vs_torch_replicate):
        assert r["vs_torch"] == 0.0, r


def test_replicate_refuses_a_2d_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from fake_world import fake_world

    from fully_shard import replicate

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        model = make_mlp()
        with pytest.raises(ValueError, match="replicate got a 2-D mesh .*Fix: pass the data-parallel dimension"):
            replicate(model, mesh=mesh)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
