"""Tier 2: shard shapes at world sizes 3, 4 and 8 with torch's fake process group.

Collectives move no data here; these tests check every rank's shapes, padding and gradients'
shapes through a real forward/backward, at world sizes the machine cannot run for real.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from fake_world import fake_world
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_every_rank_holds_its_torch_chunk(world_size):
    from fully_shard import fully_shard

    cfg = LlamaConfig(n_layers=2, vocab_size=7)  # vocab 7 < 8: some ranks hold empty embedding shards
    torch.manual_seed(0)
    reference = Llama(cfg)
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for rank in range(world_size):
        with fake_world(world_size, rank) as mesh:
            torch.manual_seed(0)
            model = Llama(cfg)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
                assert p.shape == full[name].shape, name
                expected = full[name].chunk(world_size)  # Shard(0) means torch.chunk
                local = expected[rank] if rank < len(expected) else full[name][:0]
                assert torch.equal(p.to_local(), local), (name, rank)
            x, y = synthetic_batch(0, 2, 8, cfg.vocab_size)
            loss_fn(model(x), y).backward()
            for name, p in model.named_parameters():
                assert isinstance(p.grad, DTensor), name
                assert p.grad.to_local().shape == p.to_local().shape, name


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_padded_shards_are_equal_sized(world_size):
    """Every rank's all-gather input has the same size: ceil(n / W) rows, zero-padded."""
    from fully_shard import fully_shard

    sizes = set()
    for rank in range(world_size):
        with fake_world(world_size, rank) as mesh:
            torch.manual_seed(0)
            lin = torch.nn.Linear(5, 10)  # weight (10, 5): 10 rows over W ranks
            fully_shard(lin, mesh=mesh)
            group = lin.__dict__["_fsdp_state"].group
            for p in group.params:
                rows = -(-p.shape[0] // world_size)
                assert p.padded_shard.shape[0] == rows
                n_local = p.local_shard.shape[0]
                assert torch.count_nonzero(p.padded_shard[n_local:]) == 0
            sizes.add(sum(p.shard_numel for p in group.params))
    assert len(sizes) == 1
