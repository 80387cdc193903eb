"""torchrun --nproc-per-node 4 examples/train_hsdp.py --replicas 2

HSDP: shard each block over a "shard" mesh dimension and replicate across a "replicate" one (on
a cluster: shard within a node, replicate across nodes). Parameters are (Replicate(), Shard(0))
DTensors; each backward reduce-scatters gradients within the shard group, then all-reduces them
across replicas. With --accumulate K the first K-1 micro-batches defer the all-reduce
(set_requires_all_reduce(False)): the cross-replica traffic happens once per step. Prints the
collective trace of the first optimizer step (rank 0; the trace counts one step per root
forward, so per micro-batch) and the loss per step.

Options: --replicas R (divides the world size) --accumulate K --steps N --batch B --seq-len S
         --dim D --layers L --device {auto,cpu,cuda}
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402
from train_llama import setup  # noqa: E402

from fully_shard import debug, fully_shard  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences) per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args()
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.replicas or args.batch % (world * args.accumulate):
        raise SystemExit(f"--replicas must divide the world size {world}, and --batch must divide by world x accumulate")
    mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))

    cfg = LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers, n_heads=4, hidden_dim=2 * args.dim, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Llama(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if rank == 0:
        print(f"HSDP mesh {tuple(mesh.shape)} (replicate, shard); tok_embeddings.weight placements "
              f"{model.tok_embeddings.weight.placements}", flush=True)

    for step in range(args.steps):
        inputs, targets = synthetic_batch(step, args.batch, args.seq_len, cfg.vocab_size)
        micro = list(zip(inputs.chunk(world)[rank].chunk(args.accumulate), targets.chunk(world)[rank].chunk(args.accumulate)))
        total = torch.zeros((), device=device)
        with debug.trace() as trace:
            for i, (x, y) in enumerate(micro):
                model.set_requires_all_reduce(i == len(micro) - 1)  # all-reduce once, on the last
                loss = loss_fn(model(x.to(device)), y.to(device)) / len(micro)
                loss.backward()
                total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            if step == 0:
                print(trace.summary(), flush=True)
            print(f"step {step:3d}  loss {total.item() / world:.4f}", flush=True)

    shutdown()


if __name__ == "__main__":
    main()
