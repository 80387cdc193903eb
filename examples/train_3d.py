"""torchrun --nproc-per-node 4 examples/train_3d.py --dp-replicate 1 --tp 2

3-D parallelism the way torchtitan sets it up: one full mesh ``(dp_replicate, dp_shard, tp)``;
tensor parallelism inside each block over ``tp`` (parallelize_module), then fully_shard with the
full mesh and ``dp_mesh_dims`` naming its data-parallel dims (HSDP when dp_replicate > 1: gradients
reduce-scatter over dp_shard, then all-reduce over dp_replicate). Block parameters end up on the
joint 3-D mesh; the ranks of one tp group see the same data. With ``--ckpt DIR`` the model and
optimizer are saved there at the end with torch.distributed.checkpoint; ``--resume`` loads them
first, whatever layout (or world size) saved them.

Options: --dp-replicate R --tp T (dp_shard = world / (R * T)) --steps N --batch B --seq-len S
         --dim D --layers L --device {auto,cpu,cuda} --ckpt DIR --resume
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402
from train_llama import setup  # noqa: E402
from train_tp_fsdp import BLOCK_PLAN  # noqa: E402

from fully_shard import DataParallelMeshDims, fully_shard  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), split across dp ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ckpt", default=None, help="save model + optimizer here at the end (DCP)")
    p.add_argument("--resume", action="store_true", help="load --ckpt before training")
    args = p.parse_args()
    device = setup(args.device)
    world, n_heads = dist.get_world_size(), 4
    if world % (args.dp_replicate * args.tp) or n_heads % args.tp:
        raise SystemExit(f"--dp-replicate x --tp must divide the world size {world}, and --tp the head count {n_heads}")
    shard = world // (args.dp_replicate * args.tp)
    dp = args.dp_replicate * shard
    if args.batch % dp:
        raise SystemExit(f"--batch must be divisible by the data-parallel size {dp}")
    mesh = init_device_mesh(device.type, (args.dp_replicate, shard, args.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")

    cfg = LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers, n_heads=n_heads, hidden_dim=2 * args.dim, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Llama(cfg)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], BLOCK_PLAN)
        layer.attention.n_heads = n_heads // args.tp  # each tp rank computes its share of the heads
        fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    w1 = model.layers[0].feed_forward.w1.weight
    dp_rank = mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard")
    if dist.get_rank() == 0:
        print(f"mesh (dp_replicate={args.dp_replicate}, dp_shard={shard}, tp={args.tp}); layers.0.feed_forward.w1.weight: "
              f"{w1.placements} on {w1.device_mesh.mesh_dim_names}, local {tuple(w1.to_local().shape)} of {tuple(w1.shape)}",
              flush=True)

    for step in range(args.steps):
        inputs, targets = synthetic_batch(step, args.batch, args.seq_len, cfg.vocab_size)
        x, y = inputs.chunk(dp)[dp_rank].to(device), targets.chunk(dp)[dp_rank].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)  # every rank once; tp ranks of one dp rank hold the same loss
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)
    if args.ckpt:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.ckpt)
        if dist.get_rank() == 0:
            print(f"saved to {args.ckpt}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
