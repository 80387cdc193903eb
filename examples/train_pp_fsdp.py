"""torchrun --nproc-per-node 4 examples/train_pp_fsdp.py --pp 2 --schedule interleaved

Pipeline parallelism x fully_shard: the example Llama (byte tokens, the main job's text) cut into
stages along its blocks, the ranks arranged as a (pp, dp) mesh. Each pipeline rank holds one stage
(two with the interleaved and zero-bubble schedules); each stage's blocks and the stage itself are
sharded with ``fully_shard`` over the "dp" dimension, ``reshard_after_forward=False``, so a step
gathers each block once and reduces it once, whatever the number of micro-batches.
``fully_shard.pipelining.PipelineStage`` (a drop-in for torch's) hands the stages to a
``torch.distributed.pipelining`` schedule. The embedding and the output projection are untied (they
live on the first and the last stage). Prints the loss (bits per byte) and, with ``--count``, the
data-parallel collectives of each step on rank 0.

Options: --pp P (divides the world size) --schedule {gpipe,1f1b,interleaved,zb,zbv} [--stages-per-rank V] --microbatches M
         --steps N --batch B (global) --seq-len S --dim D --layers L --lr LR --device {auto,cpu,cuda}
         --count --max-bytes N --fp64
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
import sys

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn  # noqa: E402
from teardown import shutdown  # noqa: E402
from textdata import Batches, load_corpus  # noqa: E402
from train_llama import setup  # noqa: E402

from fully_shard import fully_shard, share_comm_ctx  # noqa: E402
from fully_shard.pipelining import PipelineStage  # noqa: E402

SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}


class LlamaStage(nn.Module):
    """A run of the Llama's blocks, with the embedding on the first stage and the final norm and
    output projection on the last."""

    def __init__(self, model: Llama, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers:
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def virtual_stages(args: argparse.Namespace) -> int:
    """Stages per pipeline rank: the schedule's, or ``--stages-per-rank`` (interleaved schedules)."""
    virtual = getattr(args, "stages_per_rank", None)
    if virtual is None:
        return SCHEDULES[args.schedule][1]
    if args.schedule not in ("interleaved", "zb") or virtual < 2:
        raise SystemExit("--stages-per-rank (2 or more) is for --schedule interleaved or zb")
    return virtual


def stage_indices(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Which of the ``pp * virtual`` stages this pipeline rank holds."""
    if virtual == 1:
        return [pp_rank]
    if schedule == "zbv":  # the V: down the ranks, then back up
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def build_stages(args: argparse.Namespace, mesh, device: torch.device, shard, stage_cls) -> tuple[list, list]:
    """This pipeline rank's stage modules, their blocks and themselves sharded with ``shard`` over
    "dp" (``reshard_after_forward=False``), and a ``stage_cls`` for each (ours, or PyTorch's
    ``fully_shard`` and ``PipelineStage``: benchmarks/bench_pp.py). Built from the same seed on
    every rank; the embedding and output projection untied."""
    virtual = virtual_stages(args)
    n_stages = args.pp * virtual
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4, hidden_dim=2 * args.dim,
                      max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Llama(cfg)  # initialised on the CPU: the same weights on any device (its RNG differs)
    model.output.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())  # untied
    model.to(device, torch.float64 if getattr(args, "fp64", False) else None)
    per_stage = args.layers // n_stages
    modules, stages = [], []
    for s in stage_indices(args.schedule, mesh["pp"].get_local_rank(), args.pp, virtual):
        module = LlamaStage(model, range(s * per_stage, (s + 1) * per_stage), s == 0, s == n_stages - 1)
        for layer in module.layers:
            shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        modules.append(module)
        stages.append(stage_cls(module, s, n_stages, device, group=mesh["pp"].get_group()))
    return modules, stages


def count_collectives() -> "torch.utils._python_dispatch.TorchDispatchMode":
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.all_gather = self.reduce_scatter = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            self.all_gather += name.startswith("c10d::") and "gather" in name
            self.reduce_scatter += name.startswith("c10d::") and "reduce_scatter" in name
            return func(*args, **(kwargs or {}))

    return Count()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages-per-rank", type=int, default=None, help="interleaved / zb: stages per pipeline rank (default 2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences): dp x microbatches x n")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="a multiple of the number of stages")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="text read (the stdlib's sources)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--count", action="store_true", help="print each step's all-gathers and reduce-scatters")
    p.add_argument("--fp64", action="store_true", help="train in float64 (compare a GPU run with a CPU run)")
    args = p.parse_args()
    device = setup(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    name, virtual = SCHEDULES[args.schedule][0], virtual_stages(args)
    n_stages = args.pp * virtual
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the world size {world}")
    dp = world // args.pp
    if args.layers % n_stages:
        raise SystemExit(f"--layers {args.layers} must be a multiple of the {n_stages} stages")
    if args.batch % (dp * args.microbatches):
        raise SystemExit(f"--batch {args.batch} must divide into {dp} dp ranks x {args.microbatches} micro-batches")
    if not hasattr(pipelining, name):
        raise SystemExit(f"this torch ({torch.__version__}) has no {name}")
    mesh = init_device_mesh(device.type, (args.pp, dp), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()

    modules, stages = build_stages(args, mesh, device, fully_shard, PipelineStage)
    if len(modules) > 1:  # one rank's stages share one communication context (streams, in-flight limit)
        share_comm_ctx(modules)
    per_stage = args.layers // n_stages
    schedule_cls = getattr(pipelining, name)
    schedule = schedule_cls(stages if virtual > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([q for m in modules for q in m.parameters()], lr=args.lr)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    batches = Batches(load_corpus(None, args.max_bytes).train, args.seq_len, args.batch, seed=0)
    if rank == 0:
        print(f"mesh (pp={args.pp}, dp={dp}), {name}, {n_stages} stages of {per_stage} blocks, "
              f"{args.microbatches} micro-batches", flush=True)

    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = batches.rank_batch(step, dp_rank, dp)
        x, y = x.to(device).contiguous(), y.to(device).contiguous()  # torch 2.11 checks input strides
        losses: list[torch.Tensor] = []
        counter = count_collectives() if args.count else None
        with counter if counter is not None else contextlib.nullcontext():
            kwargs = {"target": y, "losses": losses} if holds_last else {}
            schedule.step(x, **kwargs) if holds_first else schedule.step(**kwargs)
        optimizer.step()
        optimizer.zero_grad()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        times.append(time.perf_counter() - start)
        # the step's mean loss, on the last stage's ranks, averaged over dp, to rank 0
        mean = torch.stack(losses).mean().detach().double() if holds_last else torch.zeros((), dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        if rank == 0:
            bpb = mean.item() / dp / math.log(2)
            extra = f"  all-gathers {counter.all_gather} reduce-scatters {counter.reduce_scatter}" if counter else ""
            print(f"step {step:3d}  loss {bpb:.3f} bits/byte ({mean.item() / dp!r} nats){extra}", flush=True)
    if rank == 0 and len(times) > 1:
        steady = sorted(times[1:])
        peak = f", peak allocated {torch.accelerator.max_memory_allocated(device) / 2**20:.1f} MiB" if device.type != "cpu" else ""
        print(f"median step {steady[len(steady) // 2] * 1e3:.1f} ms (after the first){peak}", flush=True)

    shutdown()


if __name__ == "__main__":
    main()
