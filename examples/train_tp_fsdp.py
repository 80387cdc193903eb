"""torchrun --nproc-per-node 4 examples/train_tp_fsdp.py --tp 2

2-D parallelism: tensor parallelism inside each block over the "tp" mesh dimension
(parallelize_module: column-wise wq/wk/wv/w1/w3, row-wise wo/w2), then fully_shard over the "dp"
dimension. Block parameters become 2-D DTensors on the (dp, tp) mesh; the embedding, final norm
and (tied) output projection are sharded over dp only. The ranks of one tp group see the same
data; dp ranks see different slices of the global batch.

Options: --tp T (divides the world size and the head count 4) --steps N --batch B --seq-len S
         --dim D --layers L --device {auto,cpu,cuda}
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402
from train_llama import setup  # noqa: E402

from fully_shard import fully_shard  # noqa: E402

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), split across dp ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args()
    device = setup(args.device)
    world = dist.get_world_size()
    n_heads = 4
    if world % args.tp or n_heads % args.tp:
        raise SystemExit(f"--tp must divide the world size {world} and the head count {n_heads}")
    dp = world // args.tp
    if args.batch % dp:
        raise SystemExit(f"--batch must be divisible by the dp size {dp}")
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))

    cfg = LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers, n_heads=n_heads, hidden_dim=2 * args.dim, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Llama(cfg)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], BLOCK_PLAN)
        layer.attention.n_heads = n_heads // args.tp  # each tp rank computes its share of the heads
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w1 = model.layers[0].feed_forward.w1.weight
    dp_rank = mesh.get_local_rank(0)
    if dist.get_rank() == 0:
        print(f"mesh (dp={dp}, tp={args.tp}); layers.0.feed_forward.w1.weight: {w1.placements} on "
              f"{w1.device_mesh.mesh_dim_names}, local {tuple(w1.to_local().shape)} of {tuple(w1.shape)}", flush=True)

    for step in range(args.steps):
        inputs, targets = synthetic_batch(step, args.batch, args.seq_len, cfg.vocab_size)
        x, y = inputs.chunk(dp)[dp_rank].to(device), targets.chunk(dp)[dp_rank].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {mean.item() / dp:.4f}", flush=True)

    shutdown()


if __name__ == "__main__":
    main()
