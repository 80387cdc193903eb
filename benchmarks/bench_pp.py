"""torchrun --nproc-per-node 4 benchmarks/bench_pp.py [--schedule interleaved] [--pp 2]

Pipeline parallelism x FSDP, ours against PyTorch's, in one run (issue #28): the example Llama
(examples/train_pp_fsdp.py's stages, byte tokens of the main job's text), each stage's blocks and
the stage sharded over the "dp" mesh dim with ``reshard_after_forward=False``, one
``torch.distributed.pipelining`` schedule, AdamW. Rows:

* ``ours``: fully_shard + ``fully_shard.pipelining.PipelineStage``;
* ``ours_plain_stage``: fully_shard under torch's own ``PipelineStage``, which does not recognise
  our modules (what users got before: a gather and a reduction per micro-batch; the zero-bubble
  schedules raise there, so this row is left out for them);
* ``torch``: PyTorch's ``fully_shard`` + torch's ``PipelineStage``.

Step time: rounds interleaved in a rotating order, medians [min-max] of the slowest rank's step.
Memory: for each implementation alone (built fresh, the others freed), the CPU allocator's peak
during a step above what was alive before the build (``benchmarks/alloc``), max over ranks.
Collectives: all-gathers and reduce-scatters per step on each rank (the most over ranks).
A throwaway build and step comes first, so that what a process allocates once is not charged to
the first implementation measured.

``--device cuda``: NCCL, one GPU per rank (``torchrun --nproc-per-node 1 ... --pp 1 --schedule
interleaved`` runs 2 virtual stages on one GPU); memory is ``max_memory_allocated`` in the step
above what was allocated before the build; ``--snapshot DIR`` dumps each implementation's
allocator history of that step (``torch.cuda.memory._dump_snapshot``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import alloc  # noqa: E402

COUNTER = alloc.install()  # before any tensor of a model exists

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.pipelining as pipelining  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import loss_fn  # noqa: E402
from teardown import shutdown  # noqa: E402
from textdata import Batches, load_corpus  # noqa: E402
from train_pp_fsdp import SCHEDULES, build_stages, count_collectives, virtual_stages  # noqa: E402


class Impl:
    def __init__(self, name: str, args: argparse.Namespace, mesh, batches: Batches, device: torch.device) -> None:
        self.name, self.args, self.batches, self.device = name, args, batches, device
        if name == "torch":
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.pipelining import PipelineStage
        else:
            from fully_shard import fully_shard

            if name == "ours":
                from fully_shard.pipelining import PipelineStage
            else:
                from torch.distributed.pipelining import PipelineStage
        sched_name, virtual = SCHEDULES[args.schedule][0], virtual_stages(args)
        self.dp_rank, self.dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        modules, stages = build_stages(args, mesh, device, fully_shard, PipelineStage)
        cls = getattr(pipelining, sched_name)
        self.schedule = cls(stages if virtual > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
        self.opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.times: list[float] = []

    def step(self, step: int) -> None:
        x, y = (t.to(self.device).contiguous() for t in self.batches.rank_batch(step, self.dp_rank, self.dp))
        kwargs = {"target": y} if self.last else {}
        self.schedule.step(x, **kwargs) if self.first else self.schedule.step(**kwargs)
        self.opt.step()
        self.opt.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages-per-rank", type=int, default=None, help="interleaved / zb: stages per pipeline rank (default 2)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: NCCL, one GPU per rank; memory is max_memory_allocated above the live bytes before")
    p.add_argument("--snapshot", default=None,
                   help="GPU: dump the caching allocator's history of each implementation's measured step here")
    args = p.parse_args()
    gpu = args.device != "cpu"
    if gpu:
        device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        torch.accelerator.set_device_index(device.index)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))

    def sync() -> None:
        if gpu:
            torch.accelerator.synchronize(device)

    def live() -> int:
        return torch.accelerator.memory_allocated(device) if gpu else COUNTER.live()
    batches = Batches(load_corpus(None, 2_000_000).train, args.seq_len, args.batch, seed=0)
    names = ["ours", "torch"] + ([] if args.schedule in ("zb", "zbv") else ["ours_plain_stage"])

    memory: dict[str, int] = {}
    counts: dict[str, tuple[int, int]] = {}
    # A throwaway build and step first: what the first model to run allocates once per process and
    # keeps (on a GPU 64 MiB, most likely cuBLAS workspaces; gloo's and the dispatcher's lazy state) is
    # then alive before every measured build, not charged to whichever implementation comes first.
    warm = Impl(names[-1], args, mesh, batches, device)
    warm.step(0)
    del warm
    for name in names:  # one alive at a time
        gc.collect()
        sync()
        before = live()
        impl = Impl(name, args, mesh, batches, device)
        impl.step(0)
        impl.step(1)
        gc.collect()
        sync()
        torch.accelerator.reset_peak_memory_stats(device) if gpu else COUNTER.reset_peak()
        counter = count_collectives()
        if gpu and args.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        with counter:
            impl.step(2)
        sync()
        if gpu and args.snapshot:
            os.makedirs(args.snapshot, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(args.snapshot, f"{name}-rank{rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        memory[name] = (torch.accelerator.max_memory_allocated(device) if gpu else COUNTER.peak()) - before
        counts[name] = (counter.all_gather, counter.reduce_scatter)
        del impl

    impls = [Impl(name, args, mesh, batches, device) for name in names]
    for impl in impls:
        impl.step(0)
    for r in range(args.rounds):
        for impl in impls[r % len(impls):] + impls[: r % len(impls)]:
            for s in range(args.steps_per_round):
                dist.barrier()
                tic = time.perf_counter()
                impl.step(1 + s)
                sync()
                dist.barrier()
                impl.times.append(time.perf_counter() - tic)

    rows = []
    for impl in impls:
        times: list = [None] * world
        dist.all_gather_object(times, impl.times)
        per_step = [max(ts) for ts in zip(*times)]
        mem: list = [None] * world
        dist.all_gather_object(mem, memory[impl.name])
        cnt: list = [None] * world
        dist.all_gather_object(cnt, counts[impl.name])
        rows.append((impl.name, statistics.median(per_step), min(per_step), max(per_step), max(mem),
                     max(c[0] for c in cnt), max(c[1] for c in cnt)))
    if rank == 0:
        base = {r[0]: r for r in rows}["torch"]
        lines = [f"world {world} (pp={args.pp}, dp={world // args.pp}), {SCHEDULES[args.schedule][0]} "
                 f"({virtual_stages(args)} stages per rank), "
                 f"{args.microbatches} micro-batches, Llama dim {args.dim} x {args.layers} blocks, batch "
                 f"{args.batch}x{args.seq_len}, {args.rounds} rounds x {args.steps_per_round} steps, torch {torch.__version__}, "
                 f"{torch.cuda.get_device_name(device) if gpu else 'CPU/gloo'}\n",
                 f"| implementation | median step ms [min-max] | / torch | peak MiB per rank ({'max_memory_allocated' if gpu else 'allocator'}) | / torch | "
                 "all-gathers / step | reduce-scatters / step |",
                 "|---|---|---|---|---|---|---|"]
        for name, med, lo, hi, mem, ag, rs in rows:
            lines.append(f"| {name} | {med * 1e3:.1f} [{lo * 1e3:.1f}-{hi * 1e3:.1f}] | {med / base[1]:.2f}x | "
                         f"{mem / 2**20:.2f} | {mem / base[4]:.2f}x | {ag} | {rs} |")
        table = "\n".join(lines) + "\n"
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table)
    shutdown()


if __name__ == "__main__":
    main()
