"""CPUOffloadPolicy on a CPU mesh: the offload path runs (shards, gradients and optimizer state
on the host, copies that are no-ops here) and trains exactly like the run without it. The
accelerator half (pinned host shards, device copies per all-gather) is in test_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

from llama_model import LlamaConfig
from rank_utils import cpu_mesh, world
from _parity import LLAMA_LR, _llama_loss, llama_batch, llama64


def _offload_equals_plain() -> dict:
    from fully_shard import CPUOffloadPolicy, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    plain = llama64(LlamaConfig(n_layers=2))
    offloaded = copy.deepcopy(plain)
    for model, policy in ((plain, None), (offloaded, CPUOffloadPolicy())):
        kwargs = {"offload_policy": policy} if policy is not None else {}
        for layer in model.layers:
            fully_shard(layer, mesh=cpu_mesh(), **kwargs)
        fully_shard(model, mesh=cpu_mesh(), **kwargs)
    states = [m.__dict__["_fsdp_state"] for m in offloaded.modules() if "_fsdp_state" in m.__dict__]
    flags = {(p.offload, p.pin_memory) for s in states for p in s.group.params}
    opts = [torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for m in (plain, offloaded)]
    losses = []
    for step in range(4):
        x, y = llama_batch(step)
        pair = []
        for model, opt in zip((plain, offloaded), opts):
            loss = _llama_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(abs(pair[0] - pair[1]))
        grads_on_host = all(p.grad.to_local().device.type == "cpu" for p in offloaded.parameters())
        for opt in opts:
            opt.zero_grad()
    state_on_host = all(t.device.type == "cpu" for st in opts[1].state.values() for t in st.values() if torch.is_tensor(t))
    return {
        "flags": flags,
        "loss_diff": max(losses),
        "param_diff": max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(plain.parameters(), offloaded.parameters())),
        "params_on_host": all(p.to_local().device.type == "cpu" for p in offloaded.parameters()),
        "grads_on_host": grads_on_host,
        "state_on_host": state_on_host,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cpu_offload_policy_on_cpu_mesh_trains_exactly_like_without(ranks, world_size):
    for r in ranks(world_size).run(_offload_equals_plain):
        print(r)
        assert r["flags"] == {(True, False)}  # the offload path, no pinning without an accelerator
        assert r["loss_diff"] == 0 and r["param_diff"] == 0
        assert r["params_on_host"] and r["grads_on_host"] and r["state_on_host"]


def _offload_meta_init() -> float:
    from fully_shard import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    ref = llama64(LlamaConfig(n_layers=2))
    with torch.device("meta"):
        model = llama64(LlamaConfig(n_layers=2))
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh(), offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=cpu_mesh(), offload_policy=CPUOffloadPolicy())
    model.to_empty(device="cpu")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    return max((a.full_tensor() - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("world_size", [2])
def test_cpu_offload_with_meta_init(ranks, world_size):
    assert ranks(world_size).run(_offload_meta_init) == [0.0] * world_size


def _per_parameter_offload(kind: str) -> dict:
    """Some parameters offloaded, the rest not, in one model (and one group): by name pattern, or
    by offload_by_budget (the largest parameters up to a byte budget). Trains exactly like the
    same model with no offload."""
    from fully_shard import CPUOffloadPolicy, fully_shard, offload_by_budget

    rank, w = world()
    torch.manual_seed(0)
    plain = llama64(LlamaConfig(n_layers=2))
    mixed = copy.deepcopy(plain)
    if kind == "patterns":
        policy = {"*.w1.weight": CPUOffloadPolicy(), "tok_embeddings.*": CPUOffloadPolicy()}
    else:
        embed = mixed.tok_embeddings.weight
        budget = embed.numel() * embed.element_size()  # exactly the largest parameter
        policy = offload_by_budget(mixed, budget)
    for model, kwargs in ((plain, {}), (mixed, {"offload_policy": policy})):
        for layer in model.layers:
            fully_shard(layer, mesh=cpu_mesh(), **kwargs)
        fully_shard(model, mesh=cpu_mesh(), **kwargs)
    states = {m.__dict__["_fsdp_state"] for m in mixed.modules() if "_fsdp_state" in m.__dict__}
    offloaded = sorted(p.path for s in states for p in s.group.params if p.offload)
    opts = [torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for m in (plain, mixed)]
    for step in range(3):
        x, y = llama_batch(step)
        for m, opt in zip((plain, mixed), opts):
            _llama_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opt.step()
            opt.zero_grad()
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(plain.parameters(), mixed.parameters()))
    return {"offloaded": offloaded, "diff": diff, "plan": repr(policy) if kind == "budget" else ""}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["patterns", "budget"])
def test_per_parameter_offload(ranks, world_size, kind):
    for r in ranks(world_size).run(_per_parameter_offload, kind):
        if kind == "patterns":  # (patterns match names relative to the module each call shards)
            assert r["offloaded"] == [
                "layers.0.feed_forward.w1.weight", "layers.1.feed_forward.w1.weight", "tok_embeddings.weight"
            ], r
        else:
            assert r["offloaded"] == ["tok_embeddings.weight"] and "OffloadPlan(1 parameters" in r["plan"], r
        assert r["diff"] == 0.0, r


def test_bad_per_parameter_offload_is_refused_before_anything_changes():
    from fake_world import fake_world

    from fully_shard import fully_shard, offload_by_budget

    with fake_world(2) as mesh:
        model = llama64(LlamaConfig(n_layers=1))
        with pytest.raises(TypeError, match="offload_policy must be a fully_shard.OffloadPolicy"):
            fully_shard(model, mesh=mesh, offload_policy={"*": "cpu"})
        with pytest.raises(TypeError, match="offload_policy must be"):
            fully_shard(model, mesh=mesh, offload_policy=lambda p: 42)
        from torch.distributed.tensor import DTensor

        assert not any(isinstance(p, DTensor) for p in model.parameters())
        with pytest.raises(ValueError, match="offload_by_budget expects a byte budget >= 0"):
            offload_by_budget(model, -1)
