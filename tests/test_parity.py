"""Tier 3 parity: sharded training equals a single-process reference on the global batch, and
PyTorch's own ``fully_shard`` given the same seed (fp32, 5+ AdamW steps, world 1/2/4)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch
from rank_utils import cpu_mesh, global_mean, max_param_diff, world

TOL = 1e-5
STEPS = 5
# Adam divides each gradient by its running RMS, so an element whose gradient is tiny moves by
# ~lr whatever its exact value: summation-order noise (per-rank partial sums vs one global sum)
# in such gradients becomes parameter noise proportional to lr. 1e-3 is a typical transformer lr.
LLAMA_LR = 1e-3


# -- models ------------------------------------------------------------------------------------


def make_mlp() -> nn.Sequential:
    """Nested blocks with dims that divide by neither 2 nor 4 (padding on every rank count)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 11)),
        nn.Sequential(nn.Linear(11, 5), nn.ReLU()),
        nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)),
        nn.Linear(3, 3),
    )


def shard_mlp(model: nn.Sequential, layout: str, reshard: bool, shard_fn) -> None:
    mesh = cpu_mesh()
    if layout == "nested":
        for block in model[:3]:
            shard_fn(block, mesh=mesh, reshard_after_forward=reshard)
    elif layout == "list":
        shard_fn([model[0], model[1]], mesh=mesh, reshard_after_forward=reshard)
        shard_fn(model[2], mesh=mesh, reshard_after_forward=reshard)
    shard_fn(model, mesh=mesh)


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen), torch.randn(8, 3, generator=gen)


# -- rank bodies ---------------------------------------------------------------------------------


def _train_pair(model, ref, batch_fn, loss_of, steps: int, lr: float = 1e-2, split: tuple[int, int] | None = None) -> dict:
    """``split=(index, parts)``: which slice of the global batch this rank trains on (default: its
    rank of the world; tensor-parallel ranks of one data-parallel rank share a slice)."""
    rank, w = world() if split is None else split
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    loss_diffs = []
    for step in range(steps):
        x, y = batch_fn(step)
        loss = loss_of(model, x.chunk(w)[rank], y.chunk(w)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(global_mean(loss) - ref_loss.item()))
    return {"loss_diff": max(loss_diffs), "param_diff": max_param_diff(model, ref)}


def _mlp_loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _mlp_parity(layout: str, reshard: bool) -> dict:
    from fully_shard import fully_shard

    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, layout, reshard, fully_shard)
    return _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)


def shard_llama(model: Llama, reshard: bool, shard_fn) -> None:
    mesh = cpu_mesh()
    for layer in model.layers:
        shard_fn(layer, mesh=mesh, reshard_after_forward=reshard)
    shard_fn(model, mesh=mesh)


def llama_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = LlamaConfig()
    return synthetic_batch(step, batch=8, seq_len=16, vocab=cfg.vocab_size)


def _llama_loss(model, x, y):
    return loss_fn(model(x), y)


def _llama_parity(reshard: bool, lr: float = LLAMA_LR) -> dict:
    """Ours vs the single-process reference, and ours vs PyTorch's fully_shard, same seed."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    rank, w = world()
    torch.manual_seed(0)
    ours = Llama()
    theirs = copy.deepcopy(ours)
    ref = copy.deepcopy(ours)
    shard_llama(ours, reshard, fully_shard)
    shard_llama(theirs, reshard, torch_fully_shard)
    vs_ref = _train_pair(ours, ref, llama_batch, _llama_loss, STEPS, lr)

    torch.manual_seed(0)
    ours2 = Llama()
    shard_llama(ours2, reshard, fully_shard)
    opt_ours = torch.optim.AdamW(ours2.parameters(), lr=1e-2)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    loss_diff = 0.0
    for step in range(STEPS):
        x, y = llama_batch(step)
        x, y = x.chunk(w)[rank], y.chunk(w)[rank]
        losses = []
        for model, opt in ((ours2, opt_ours), (theirs, opt_theirs)):
            loss = _llama_loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(global_mean(loss))
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
    param_diff = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(ours2.parameters(), theirs.parameters())
    )
    return {"vs_ref": vs_ref, "vs_torch": {"loss_diff": loss_diff, "param_diff": param_diff}}


def _noncontiguous_parity() -> dict:
    """A parameter whose storage is transposed trains like the contiguous reference."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 3))
    model[0].weight = nn.Parameter(model[0].weight.detach().t().contiguous().t())
    assert not model[0].weight.is_contiguous()
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=cpu_mesh())
    return _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)


# -- tests ---------------------------------------------------------------------------------------


def _check(results: list[dict], label: str) -> None:
    for rank, r in enumerate(results):
        print(f"{label} rank {rank}: max |loss diff| {r['loss_diff']:.2e}, max |param diff| {r['param_diff']:.2e}")
        assert r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["nested", "list", "root_only"])
@pytest.mark.parametrize("reshard", [True, False])
def test_mlp_matches_single_process(ranks, world_size, layout, reshard):
    _check(ranks(world_size).run(_mlp_parity, layout, reshard), f"mlp {layout} reshard={reshard}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_llama_matches_reference_and_torch_fully_shard(ranks, world_size, reshard):
    results = ranks(world_size).run(_llama_parity, reshard)
    _check([r["vs_ref"] for r in results], f"llama reshard={reshard} vs single process")
    _check([r["vs_torch"] for r in results], f"llama reshard={reshard} vs torch fully_shard")


@pytest.mark.parametrize("world_size", [2, 4])
def test_noncontiguous_parameter_trains_correctly(ranks, world_size):
    _check(ranks(world_size).run(_noncontiguous_parity), "non-contiguous")
