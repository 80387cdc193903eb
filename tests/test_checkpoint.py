"""Checkpoints with torch.distributed.checkpoint (issue #5, in part): sharded save/load of model
and optimizer across world sizes, full state dicts gathered to rank 0 and loaded back."""

from __future__ import annotations


import pytest
import torch

from llama_model import Llama, LlamaConfig
from rank_utils import cpu_mesh, global_mean, world
from _parity import LLAMA_LR, TOL64, _llama_loss, llama_batch, llama64

SAVE_AFTER = 2
STEPS_AFTER = 3


def _sharded_llama(seed: int = 0, layout: str = "fsdp"):
    """``fsdp``: 1-D mesh, dim 0. ``hsdp``: (2, W/2) replicate x shard mesh. ``dim1``: 1-D mesh,
    matrices sharded on dim 1 (uneven). ``3d:R,S,T``: torchtitan's layout, blocks tensor-parallel
    over ``tp`` and every call given the full (dp_replicate, dp_shard, tp) mesh with dp_mesh_dims."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fully_shard import fully_shard

    torch.manual_seed(seed)
    model = llama64(LlamaConfig(n_layers=2))
    w = world()[1]
    if layout.startswith("3d:"):
        return _three_d(model, tuple(int(n) for n in layout[3:].split(",")))
    if layout == "plain":  # replicate(plain_params=True): plain tensors, every rank the whole
        from fully_shard import replicate

        for layer in model.layers:
            replicate(layer, mesh=cpu_mesh(), plain_params=True)
        replicate(model, mesh=cpu_mesh(), plain_params=True)
        return model, torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    mesh = init_device_mesh("cpu", (2, w // 2) if w > 1 else (1, 1)) if layout == "hsdp" else cpu_mesh()
    placement = (lambda p: Shard(1) if p.dim() == 2 else None) if layout == "dim1" else None
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model, torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)


def _three_d(model, shape: tuple[int, int, int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fully_shard import DataParallelMeshDims, fully_shard
    from train_tp_fsdp import BLOCK_PLAN

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], BLOCK_PLAN)
        layer.attention.n_heads //= shape[2]
        fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    # The ranks of one tp group train on the same slice of the batch.
    model.data_split = (mesh.get_local_rank("dp_replicate") * shape[1] + mesh.get_local_rank("dp_shard"), shape[0] * shape[1])
    return model, torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)


def _step(model, opt, step: int) -> float:
    rank, w = getattr(model, "data_split", None) or world()
    x, y = llama_batch(step)
    loss = _llama_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return global_mean(loss)


def _train_and_save(path: str, layout: str = "fsdp") -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _sharded_llama(layout=layout)
    for step in range(SAVE_AFTER):
        _step(model, opt, step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load_and_train(path: str, layout: str = "fsdp") -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model, opt = _sharded_llama(seed=123, layout=layout)  # different initial weights: the checkpoint must replace them
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [_step(model, opt, step) for step in range(SAVE_AFTER, SAVE_AFTER + STEPS_AFTER)]
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
    return {"losses": losses, "params": {k: v.clone() for k, v in full.items()} if world()[0] == 0 else None}


def _reference() -> tuple[list[float], dict]:
    """Uninterrupted single-process training on the global batches."""
    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    losses = []
    for step in range(SAVE_AFTER + STEPS_AFTER):
        x, y = llama_batch(step)
        loss = _llama_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[SAVE_AFTER:], {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("save_world", [1, 2, 4])
@pytest.mark.parametrize("load_world", [1, 2, 4])
def test_resume_at_any_world_size(ranks, tmp_path, reference, save_world, load_world):
    ref_losses, ref_params = reference
    ranks(save_world).run(_train_and_save, str(tmp_path))
    results = ranks(load_world).run(_load_and_train, str(tmp_path))
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses))
    param_diff = max((results[0]["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    print(f"save at {save_world}, load at {load_world}: max |loss diff| {loss_diff:.2e}, max |param diff| {param_diff:.2e}")
    assert loss_diff <= TOL64 and param_diff <= TOL64
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank saw the same global loss


@pytest.mark.parametrize(
    "save_world,save_layout,load_world,load_layout",
    [(4, "hsdp", 2, "dim1"), (2, "dim1", 4, "hsdp"), (4, "hsdp", 1, "fsdp"), (1, "fsdp", 4, "dim1"),
     (4, "3d:1,2,2", 4, "3d:2,1,2"), (4, "3d:2,2,1", 2, "fsdp"), (1, "fsdp", 4, "3d:1,2,2"),
     (2, "plain", 4, "fsdp"), (4, "hsdp", 2, "plain")],
)
def test_resume_across_layouts(ranks, tmp_path, reference, save_world, save_layout, load_world, load_layout):
    """Save under one layout (HSDP, dim-1 shards, plain, 3-D HSDP x TP through dp_mesh_dims,
    replicate(plain_params=True)) and world size, resume under another."""
    ref_losses, ref_params = reference
    ranks(save_world).run(_train_and_save, str(tmp_path), save_layout)
    results = ranks(load_world).run(_load_and_train, str(tmp_path), load_layout)
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses))
    param_diff = max((results[0]["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    print(f"{save_layout}@{save_world} -> {load_layout}@{load_world}: |loss diff| {loss_diff:.2e}, |param diff| {param_diff:.2e}")
    assert loss_diff <= TOL64 and param_diff <= TOL64


def _full_state_dict_round_trip() -> dict:
    """Gather a full state dict to rank 0 (CPU), load it into a differently initialised sharded
    model from rank 0 only, gather again: bit-identical, and the same loss on the next batch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    rank, w = world()
    model, opt = _sharded_llama()
    for step in range(SAVE_AFTER):
        _step(model, opt, step)
    gather = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=gather)
    saved = {k: v.clone() for k, v in full.items()} if rank == 0 else {}
    on_cpu = all(v.device.type == "cpu" and not hasattr(v, "placements") for v in saved.values())
    fresh, _ = _sharded_llama(seed=7)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, full if rank == 0 else {}, options=load)
    again = get_model_state_dict(fresh, options=gather)
    exact = all(torch.equal(saved[k], again[k]) for k in saved) and (rank != 0 or saved.keys() == again.keys())
    x, y = llama_batch(SAVE_AFTER)
    with torch.no_grad():
        losses = [_llama_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).item() for m in (model, fresh)]
    return {"on_cpu": on_cpu, "exact": exact, "same_loss": losses[0] == losses[1]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_state_dict_gather_and_load(ranks, world_size):
    for r in ranks(world_size).run(_full_state_dict_round_trip):
        assert r["on_cpu"] and r["exact"] and r["same_loss"], r
