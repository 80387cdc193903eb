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


def _plain(offload: bool) -> dict:
    """``replicate(plain_params=True)``: plain parameters and gradients, trained exactly as with
    ``Replicate()`` DTensors (the same engine and collectives); ``p.data = t`` and assigning a new
    plain Parameter are taken over; a deep copy trains on its own; a state dict round trip."""
    from fully_shard import CPUOffloadPolicy, replicate

    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    plain, dtensor = make_mlp(), make_mlp()
    ref = copy.deepcopy(plain)
    for m, flag in ((plain, True), (dtensor, False)):
        for block in m[:3]:
            replicate(block, mesh=cpu_mesh(), plain_params=flag, **kwargs)
        replicate(m, mesh=cpu_mesh(), plain_params=flag, **kwargs)
    out = {"kinds": sorted({type(p).__name__ for p in plain.parameters()})}
    fresh = copy.deepcopy(plain)  # an independent sharded copy, before any training
    rank, w = world()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, dtensor)]
    for step in range(3):
        x, y = mlp_batch(step)
        for m, opt in zip((plain, dtensor), opts):
            _mlp_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            if m is plain:
                out["grad_kinds"] = sorted({type(p.grad).__name__ for p in m.parameters()})
            opt.step()
            opt.zero_grad()
    out["vs_dtensor"] = max_abs_diff(plain, dtensor)
    out["train"] = _train_pair(fresh, copy.deepcopy(ref), mlp_batch, _mlp_loss, 2)
    # p.data = t: the next forward computes with t (the DTensor path refuses it instead)
    x, _ = mlp_batch(7)
    weight = plain[3].weight
    new = torch.full_like(weight, 0.5)
    weight.data = new
    with torch.no_grad():
        got = plain(x)
        ref_model = copy.deepcopy(ref)
        ref_model.load_state_dict({k: v.detach().clone() for k, v in plain.state_dict().items()})
        out["data_assigned"] = (got - ref_model(x)).abs().max().item()
    out["weight_is_new"] = plain[3].weight is weight and torch.equal(plain[3].weight, new)
    # a new plain Parameter assigned: kept as the object the model (and a new optimizer) holds
    fresh = torch.nn.Parameter(torch.full_like(weight, 0.25))
    plain[3].weight = fresh
    with torch.no_grad():
        got = plain(x)
    out["assigned_kept"] = plain[3].weight is fresh and [p for p in plain.parameters()][-2] is fresh
    ref_model[3].weight = torch.nn.Parameter(torch.full_like(weight, 0.25))
    with torch.no_grad():
        out["assigned"] = (got - ref_model(x)).abs().max().item()
    out["state_dict_kinds"] = sorted({type(v).__name__ for v in plain.state_dict().values()})
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("offload", [False, True])
def test_replicate_plain_params(ranks, world_size, offload):
    for r in ranks(world_size).run(_plain, offload):
        assert r["kinds"] == ["Parameter"] and r["grad_kinds"] == ["Tensor"], r
        assert r["vs_dtensor"] == 0.0, r
        check([r["train"]], f"replicate(plain_params=True) offload={offload} vs single process (float64)")
        assert r["data_assigned"] == 0.0 and r["weight_is_new"], r
        assert r["assigned"] == 0.0 and r["assigned_kept"], r
        assert r["state_dict_kinds"] == ["Tensor"], r


def test_replicate_plain_params_refuses_a_dtensor_parameter():
    from torch.distributed.tensor import distribute_tensor

    from fake_world import fake_world

    from fully_shard import replicate

    with fake_world(2):
        mesh = cpu_mesh()
        model = make_mlp()
        model[3].weight = torch.nn.Parameter(distribute_tensor(model[3].weight.detach(), mesh, [Replicate()]))
        before = [p for p in model.parameters()]
        with pytest.raises(ValueError, match=r"parameter '3.weight' is a DTensor .*plain_params=True.*Fix: "):
            replicate(model, mesh=mesh, plain_params=True)
        assert [p for p in model.parameters()] == before and not hasattr(model, "_fsdp_state")
