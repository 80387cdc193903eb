"""torchrun --nproc-per-node 2 benchmarks/quant_allgather.py

What `fully_shard.quant.Int8AllGather` saves and what it costs, on the example Llama: the same
model, seed and data trained four ways in one run (float32; int8 weight all-gather; bf16 compute
via MixedPrecisionPolicy; both), each for ``--steps`` steps.

* all-gather bytes per rank per step: every all-gather ``fully_shard.debug.trace`` records in
  one step (each output buffer's bytes), and the ratio to float32;
* the loss at a few steps and the mean |loss - float32 loss| over the run: the accuracy cost.

Options: --steps N --dim D --layers L --batch B --seq-len S --lr LR --out FILE
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402

from fully_shard import MixedPrecisionPolicy, debug, fully_shard  # noqa: E402
from fully_shard.quant import Int8AllGather  # noqa: E402

MODES = ("fp32", "int8", "bf16", "bf16+int8")


def train(mode: str, args: argparse.Namespace, mesh) -> tuple[int, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4, hidden_dim=int(args.dim * 8 / 3),
        max_seq_len=args.seq_len,
    )
    model = Llama(cfg)
    bf16 = mode.startswith("bf16")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if mode.endswith("int8"):
        model.set_all_gather_codec(Int8AllGather())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    with debug.trace() as t:
        for step in range(args.steps):
            x, y = synthetic_batch(step, batch=args.batch, seq_len=args.seq_len, vocab=cfg.vocab_size)
            loss = loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            global_loss = loss.detach().reshape(1).clone()
            dist.all_reduce(global_loss)
            losses.append(global_loss.item() / world)
    return sum(r.nbytes for r in t.select(op="all_gather", step=1)), losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    runs = {mode: train(mode, args, mesh) for mode in MODES}
    if dist.get_rank() == 0:
        base_bytes, base_losses = runs["fp32"]
        marks = sorted({0, args.steps // 4, args.steps // 2, args.steps - 1})
        lines = [
            f"Example Llama (dim {args.dim}, {args.layers} layers), world {dist.get_world_size()}, {args.steps} steps, "
            f"lr {args.lr}, same seed and data.",
            "",
            "| all-gather | bytes/rank/step | vs fp32 | " + " | ".join(f"loss @{m}" for m in marks)
            + " | mean abs(loss - fp32 loss) |",
            "|---|---|---|" + "---|" * len(marks) + "---|",
        ]
        for mode, (nbytes, losses) in runs.items():
            gap = sum(abs(a - b) for a, b in zip(losses, base_losses)) / len(losses)
            lines.append(
                f"| {mode} | {nbytes:,} | {nbytes / base_bytes:.3f} | "
                + " | ".join(f"{losses[m]:.4f}" for m in marks) + f" | {gap:.4f} |"
            )
        table = "\n".join(lines)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
    shutdown()


if __name__ == "__main__":
    main()
