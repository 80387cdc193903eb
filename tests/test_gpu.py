"""Accelerator path (streams, events, NCCL): runs where a GPU is lent, skipped elsewhere.

One process, world size 1 over NCCL: the collectives, the side streams and the event ordering
are all real; parity is against the same model trained without sharding on the same device.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU machine)"),
]


@pytest.fixture
def nccl_world():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False])
def test_cuda_parity_and_nothing_unsharded_between_steps(nccl_world, reshard):
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=3))  # built on CPU: fully_shard moves each shard
    ref = copy.deepcopy(model).cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world, reshard_after_forward=reshard)
    fully_shard(model, mesh=nccl_world)
    assert all(p.device.type == "cuda" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(5):
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        print(f"step {step}: |loss diff| {abs(loss.item() - ref_loss.item()):.2e}")
        assert abs(loss.item() - ref_loss.item()) <= 1e-5
        states = [m.__dict__["_fsdp_state"] for m in model.modules() if "_fsdp_state" in m.__dict__]
        alive = sum(p.padded_unsharded.untyped_storage().nbytes() for s in states for p in s.group.params)
        assert alive == 0
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    print(f"max |param diff| {diff:.2e}")
    assert diff <= 1e-5


def test_cuda_streams_are_used(nccl_world):
    from fully_shard import fully_shard

    model = Llama(LlamaConfig(n_layers=2))
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world)
    fully_shard(model, mesh=nccl_world)
    x, y = synthetic_batch(0, 2, 8, model.cfg.vocab_size)
    loss_fn(model(x.cuda()), y.cuda()).backward()
    comm = model.__dict__["_fsdp_state"].ctx.comm
    assert comm.uses_streams and comm.all_gather_stream is not None and comm.reduce_scatter_stream is not None
    assert comm.all_gather_stream != torch.cuda.current_stream()


def test_cuda_post_optim_event_keeps_parity(nccl_world):
    """The first all-gather of each forward waits for an event recorded after optimizer.step()
    instead of the whole compute stream: results stay the reference's."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    ref = copy.deepcopy(model).cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world)
    fully_shard(model, mesh=nccl_world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(4):
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.set_post_optim_event(torch.cuda.current_stream().record_event())
        ref_loss = loss_fn(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5
