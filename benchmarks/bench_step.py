"""torchrun --nproc-per-node 2 benchmarks/bench_step.py

Compare this package's fully_shard with PyTorch's fully_shard and with DDP on one model shape
(``--model``: the example Llama, ``wide`` = a few Linear(4096, 4096), ``deep-narrow`` = 64 tiny
residual blocks), each block and the root sharded, same seed, same data, in one run:

* host CPU time per step (the Python thread's thread_time) and collectives per step, besides the
  columns below.
* step time (forward + backward + optimizer step): the three are interleaved round by round, in a
  rotating order, so machine noise hits each alike; medians over every timed step, and the ratio
  of ours to each of the others.
* per-rank peak memory, counted at the allocator (``benchmarks/alloc``: a counting wrapper around
  c10's CPU allocator, installed before anything is built): the most bytes of CPU storages alive at
  once during a step, minus those alive before the model was built, so it counts parameters,
  gradients, optimizer state, autograd's saved tensors, our buffers and what the collective
  backend holds on its own threads. ``--memory-repeats`` fresh builds per implementation, taken in a
  rotating order with one implementation alive at a time, 3 measured steps each: the median and the
  min-max over all of them (a peak that depends on thread timing shows as a range).
* bytes communicated per rank per step: every c10d collective seen by the dispatcher (all-gather
  output, reduce-scatter input); DDP's all-reduce runs inside its C++ reducer, unseen by the
  dispatcher, so its row reports the gradient bytes it all-reduces.

``--unbucketed`` adds a row for ours with bucketing off; ``--in-flight N`` (repeatable) a row for
ours with ``set_collectives_in_flight(N)``; ``--bucket-bytes N`` (repeatable) one with
``set_bucket_bytes(N)``; ``--hsdp`` shards over a (2, world/2)
(replicate, shard) mesh; ``--finite-check`` / ``--schedule-check`` turn those checks on for ours
(compare with a run without to read their cost).

Options: --model {llama,wide,deep-narrow} --unbucketed --hsdp --rounds R --steps-per-round K --warmup W --dim D --layers L
         --batch B --seq-len S --out FILE --param-dtype {fp32,bf16}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import alloc  # noqa: E402

COUNTER = alloc.install()  # before any tensor of a model exists

import torch.distributed as dist  # noqa: E402
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402


class Impl:
    def __init__(self, name: str, model: nn.Module, kind: str) -> None:
        self.name = name
        self.model = model
        self.kind = kind
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.host_times: list[float] = []  # CPU time of the Python thread (our hooks, autograd, optimizer)

    def step(self, step: int, args: argparse.Namespace) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.kind == "llama":
            x, y = synthetic_batch(step, args.batch, args.seq_len, 1024)
            loss = loss_fn(self.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        else:  # wide / deep-narrow: a regression on random inputs
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(args.batch, self.width, generator=gen).chunk(world)[rank]
            loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    @property
    def width(self) -> int:
        first = next(m for m in self.model.modules() if isinstance(m, nn.Linear))
        return first.in_features


class Residual(nn.Module):
    """One deep-narrow block: ``x + relu(Linear(x))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


def make_model(kind: str, args: argparse.Namespace) -> tuple[nn.Module, list[nn.Module]]:
    """The model and the blocks each get their own fully_shard call (then the root)."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4,
                          hidden_dim=int(args.dim * 8 / 3), max_seq_len=args.seq_len)
        model = Llama(cfg)
        return model, list(model.layers)
    if kind == "wide":  # few large layers: memory per collective dominates
        model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        return model, list(model)
    if kind == "deep-narrow":  # many tiny layers: per-collective overhead dominates
        model = nn.Sequential(*[Residual(args.dim) for _ in range(args.layers)])
        return model, list(model)
    raise ValueError(kind)


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def build(name: str, args: argparse.Namespace) -> Impl:
    model, blocks = make_model(args.model, args)
    world = dist.get_world_size()
    if args.hsdp:  # (replicate, shard): 2 replicas of world / 2 shards each
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    dtype = PARAM_DTYPES[args.param_dtype]
    if name.startswith("ours"):
        from fully_shard import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if name == "ours_unbucketed":
            model.set_bucket_bytes(0)
        if name.startswith("ours_bucket_"):
            model.set_bucket_bytes(int(name.rsplit("_", 1)[1]))
        if name.startswith("ours_in_flight_"):
            model.set_collectives_in_flight(int(name.rsplit("_", 1)[1]))
        if args.finite_check:
            model.set_grad_finite_check("report")
    elif name == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_mp = TorchMP(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=torch_mp)
        torch_fully_shard(model, mesh=mesh, mp_policy=torch_mp)
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        raise ValueError(name)
    return Impl(name, model, args.model)


class CollectiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            self.count += 1
            if "allgather" in name or "all_gather" in name:
                self.nbytes += args[0].numel() * args[0].element_size()
            elif "reduce_scatter" in name:
                self.nbytes += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


def step_peaks(impl: Impl, args: argparse.Namespace, before_model: int, samples: int = 3) -> list[int]:
    """The allocator's peak in each of ``samples`` steps, above what was alive before the model."""
    peaks = []
    for step in range(samples):
        gc.collect()
        COUNTER.reset_peak()
        impl.step(step, args)
        peaks.append(COUNTER.peak() - before_model)
    return peaks


def comm_bytes(impl: Impl, args: argparse.Namespace) -> tuple[int, int]:
    """(bytes, collectives) per rank per step. DDP's all-reduces run inside its C++ reducer,
    unseen by the dispatcher: its row reports the gradient bytes and 0 counted collectives."""
    if impl.name == "ddp":
        return sum(p.numel() * p.element_size() for p in impl.model.parameters() if p.requires_grad), 0
    with CollectiveBytes() as counter:
        impl.step(0, args)
    return counter.nbytes, counter.count


def measure_memory(names: list[str], args: argparse.Namespace) -> tuple[dict, dict]:
    """Per implementation: every measured step's allocator peak (``args.memory_repeats`` fresh
    builds, a rotating order, one implementation alive at a time) and (bytes, collectives) per step."""
    peaks: dict[str, list[int]] = {name: [] for name in names}
    comm: dict[str, tuple[int, int]] = {}
    for repeat in range(args.memory_repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            gc.collect()
            before_model = COUNTER.live()
            impl = build(name, args)
            impl.step(0, args)  # warm: optimizer state exists, lazy init done
            impl.step(1, args)
            peaks[name] += step_peaks(impl, args, before_model)
            if name not in comm:
                comm[name] = comm_bytes(impl, args)
            del impl
    return peaks, comm


def timed(impl: Impl, fn: Callable[[], None]) -> None:
    dist.barrier()
    start, host = time.perf_counter(), time.thread_time()
    fn()
    impl.host_times.append(time.thread_time() - host)
    impl.times.append(time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", choices=["llama", "wide", "deep-narrow"], default="llama",
                   help="llama: the example model; wide: --layers Linear(dim, dim); deep-narrow: --layers residual Linear blocks")
    p.add_argument("--dim", type=int, default=None, help="default: 128 (llama), 4096 (wide), 64 (deep-narrow)")
    p.add_argument("--layers", type=int, default=None, help="default: 4 (llama, wide), 64 (deep-narrow)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default=None, help="also write the markdown table here (rank 0)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here (rank 0; plot_bucket_curve.py reads it)")
    p.add_argument("--memory-repeats", type=int, default=4, help="fresh builds per implementation for the memory median")
    p.add_argument("--unbucketed", action="store_true",
                   help="also time ours with bucketing off (set_bucket_bytes(0)): what buckets cost and save")
    p.add_argument("--bucket-bytes", type=int, action="append", default=[],
                   help="also run ours with set_bucket_bytes(N) (repeatable): the bucket budget curve")
    p.add_argument("--in-flight", type=int, action="append", default=[],
                   help="also run ours with set_collectives_in_flight(N) (repeatable): the memory / time trade-off")
    p.add_argument("--hsdp", action="store_true", help="both FSDPs on a (2, world/2) (replicate, shard) mesh")
    p.add_argument("--finite-check", action="store_true", help="ours with set_grad_finite_check('report'): its cost")
    p.add_argument("--schedule-check", action="store_true", help="ours with the schedule check on: its cost")
    p.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="fp32",
                   help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for both FSDPs; DDP is left out")
    args = p.parse_args()
    defaults = {"llama": (128, 4), "wide": (4096, 4), "deep-narrow": (64, 64)}[args.model]
    args.dim = args.dim if args.dim is not None else defaults[0]
    args.layers = args.layers if args.layers is not None else defaults[1]

    dist.init_process_group("gloo")
    if args.schedule_check:
        from fully_shard.debug import set_schedule_check

        set_schedule_check(True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ["ours", "torch_fsdp2", "ddp"] if args.param_dtype == "fp32" else ["ours", "torch_fsdp2"]
    if args.unbucketed:
        names.insert(1, "ours_unbucketed")
    for n in args.in_flight:
        names.insert(1, f"ours_in_flight_{n}")
    for n in args.bucket_bytes:
        names.insert(1, f"ours_bucket_{n}")
    if args.hsdp and (world < 4 or world % 2):
        raise SystemExit("--hsdp needs an even world size >= 4 (2 replicas of at least 2 shards)")

    memory, comm = measure_memory(names, args)

    impls = [build(name, args) for name in names]
    for impl in impls:
        for s in range(args.warmup):
            impl.step(s, args)
    for r in range(args.rounds):
        order = impls[r % len(impls):] + impls[: r % len(impls)]
        for impl in order:
            for s in range(args.steps_per_round):
                timed(impl, lambda: impl.step(s, args))

    # Medians over every rank's steps: the slowest rank sets the pace of a synchronous step.
    medians, spans, host = {}, {}, {}
    for impl in impls:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (impl.times, impl.host_times))
        per_step = [max(ts) for ts in zip(*(g[0] for g in gathered))]
        medians[impl.name] = statistics.median(per_step)
        spans[impl.name] = (min(per_step), max(per_step))
        host[impl.name] = max(statistics.median(g[1]) for g in gathered)
    peaks: list = [None] * world
    dist.all_gather_object(peaks, memory)

    if rank == 0:
        ours = medians["ours"]
        shape = {"llama": f"Llama dim {args.dim}, {args.layers} blocks, vocab 1024, global batch {args.batch}x{args.seq_len}",
                 "wide": f"{args.layers} x Linear({args.dim}, {args.dim}), global batch {args.batch}",
                 "deep-narrow": f"{args.layers} blocks of x + relu(Linear({args.dim}, {args.dim})(x)), global batch {args.batch}"}[args.model]
        lines = [
            f"world {world}{' as HSDP (2 replicas x ' + str(world // 2) + ' shards)' if args.hsdp else ''}, CPU/gloo, "
            f"{args.param_dtype} params, {shape}; {args.rounds} interleaved rounds x "
            f"{args.steps_per_round} steps; memory: allocator peak per rank, max over ranks, median [min-max] of "
            f"{args.memory_repeats} builds x 3 steps; torch {torch.__version__}",
            "",
            "| implementation | median step (ms) [min-max] | ours / this | host CPU ms/step | peak MiB per rank (allocator) [min-max] | ours / this | collectives / step | comm MiB / rank / step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        worst = {n: [max(vals) for vals in zip(*(pk[n] for pk in peaks))] for n in names}  # max over ranks
        mib = {n: [b / 2**20 for b in worst[n]] for n in names}
        for name in names:
            lo, hi = spans[name]
            med = statistics.median(mib[name])
            lines.append(
                f"| {name} | {medians[name] * 1e3:.2f} [{lo * 1e3:.1f}-{hi * 1e3:.1f}] | {ours / medians[name]:.3f} | "
                f"{host[name] * 1e3:.2f} | {med:.1f} [{min(mib[name]):.1f}-{max(mib[name]):.1f}] | "
                f"{statistics.median(mib['ours']) / med:.3f} | {comm[name][1] if name != 'ddp' else '(in C++)'} | "
                f"{comm[name][0] / 2**20:.2f} |"
            )
        emit("\n".join(lines), args.out)
        if args.json:
            rows = {n: {"step_ms": medians[n] * 1e3, "peak_mib": statistics.median(mib[n]),
                        "collectives": comm[n][1]} for n in names if n != "ddp"}
            with open(args.json, "w") as f:
                from fully_shard.runtime.settings import DEFAULT_BUCKET_BYTES

                json.dump({"model": args.model, "world": world, "rows": rows,
                           "default_bucket_bytes": DEFAULT_BUCKET_BYTES}, f, indent=1)

    shutdown()


def emit(table: str, out: "str | None") -> None:
    """Print a markdown table (rank 0) and, with ``--out``, write it there too."""
    print(table, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
