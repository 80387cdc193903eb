"""torchrun --nproc-per-node 2 benchmarks/bench_step.py

Compare this package's fully_shard with PyTorch's fully_shard and with DDP on the example Llama
model (examples/train_llama.py defaults), same seed, same data, in one run:

* step time (forward + backward + optimizer step): the three are interleaved round by round, in a
  rotating order, so machine noise hits each alike; medians over every timed step, and the ratio
  of ours to each of the others.
* per-rank peak memory: the median over 7 fresh builds (rotating order) of the median over 5 steps
  of the process's resident-memory high-water mark (VmHWM) in a step,
  minus its resident memory before the model was built, so it counts parameters, gradients,
  optimizer state and everything a step allocates (gloo's internal buffers and every thread
  included), with only that implementation alive in the process. glibc's mmap threshold is pinned
  at 64 KiB, so every tensor larger than that is unmapped the moment it is freed and resident
  memory tracks live tensors. Linux only.
* bytes communicated per rank per step: every c10d collective seen by the dispatcher (all-gather
  output, reduce-scatter input); DDP's all-reduce runs inside its C++ reducer, unseen by the
  dispatcher, so its row reports the gradient bytes it all-reduces.

Options: --rounds R --steps-per-round K --warmup W --dim D --layers L --batch B --seq-len S --out FILE
         --param-dtype {fp32,bf16}
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402


class Impl:
    def __init__(self, name: str, model: nn.Module) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.times: list[float] = []

    def step(self, step: int, args: argparse.Namespace) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = synthetic_batch(step, args.batch, args.seq_len, self.model_cfg.vocab_size)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss_fn(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    @property
    def model_cfg(self) -> LlamaConfig:
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
        return model.cfg


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def build(name: str, cfg: LlamaConfig, param_dtype: str = "fp32") -> Impl:
    torch.manual_seed(0)
    model = Llama(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dtype = PARAM_DTYPES[param_dtype]
    if name == "ours":
        from fully_shard import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif name == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_mp = TorchMP(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh, mp_policy=torch_mp)
        torch_fully_shard(model, mesh=mesh, mp_policy=torch_mp)
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        raise ValueError(name)
    return Impl(name, model)


class CollectiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            if "allgather" in name or "all_gather" in name:
                self.nbytes += args[0].numel() * args[0].element_size()
            elif "reduce_scatter" in name:
                self.nbytes += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


def set_mmap_threshold(nbytes: int) -> None:
    """Serve allocations above ``nbytes`` with mmap, so a free returns them to the OS at once."""
    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, nbytes)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def release_free_memory() -> None:
    """Return freed heap memory to the OS, so resident memory counts only what is live."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int:
    release_free_memory()
    return _status_kib("VmRSS") * 1024


def peak_step_bytes(impl: Impl, args: argparse.Namespace, before_model: int, samples: int = 5) -> int:
    """Median over ``samples`` steps of the step's resident high-water mark above ``before_model``."""
    peaks = []
    for step in range(samples):
        release_free_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        impl.step(step, args)
        peaks.append(_status_kib("VmHWM") * 1024 - before_model)
    return int(statistics.median(peaks))


def comm_bytes(impl: Impl, args: argparse.Namespace) -> int:
    if impl.name == "ddp":
        return sum(p.numel() * p.element_size() for p in impl.model.parameters() if p.requires_grad)
    with CollectiveBytes() as counter:
        impl.step(0, args)
    return counter.nbytes


def measure_memory(names: list[str], cfg: LlamaConfig, args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Peak bytes per implementation (median over ``args.memory_repeats`` fresh builds, taken in
    a rotating order), with one implementation alive at a time so resident memory is its own."""
    for name in names:  # first use of each code path allocates process-wide state: pay it up front
        impl = build(name, cfg, args.param_dtype)
        impl.step(0, args)
        comm_bytes(impl, args)
        del impl
    set_mmap_threshold(64 * 1024)
    peaks: dict[str, list[int]] = {name: [] for name in names}
    comm: dict[str, int] = {}
    for repeat in range(args.memory_repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            before_model = resident_bytes()
            impl = build(name, cfg, args.param_dtype)
            impl.step(0, args)  # warm: optimizer state exists, lazy init done
            impl.step(1, args)
            peaks[name].append(peak_step_bytes(impl, args, before_model))
            if name not in comm:
                comm[name] = comm_bytes(impl, args)
            del impl
            gc.collect()
    set_mmap_threshold(32 * 2**20)  # glibc's largest dynamic threshold: fast heap reuse for timing
    return {name: (int(statistics.median(peaks[name])), comm[name]) for name in names}


def timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default=None, help="also write the markdown table here (rank 0)")
    p.add_argument("--memory-repeats", type=int, default=7, help="fresh builds per implementation for the memory median")
    p.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="fp32",
                   help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for both FSDPs; DDP is left out")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4,
                      hidden_dim=int(args.dim * 8 / 3), max_seq_len=args.seq_len)
    names = ["ours", "torch_fsdp2", "ddp"] if args.param_dtype == "fp32" else ["ours", "torch_fsdp2"]

    memory = measure_memory(names, cfg, args)

    impls = [build(name, cfg, args.param_dtype) for name in names]
    for impl in impls:
        for s in range(args.warmup):
            impl.step(s, args)
    for r in range(args.rounds):
        order = impls[r % len(impls):] + impls[: r % len(impls)]
        for impl in order:
            for s in range(args.steps_per_round):
                impl.times.append(timed(lambda: impl.step(s, args)))

    # Medians over every rank's steps: the slowest rank sets the pace of a synchronous step.
    medians = {}
    for impl in impls:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, impl.times)
        per_step = [max(ts) for ts in zip(*gathered)]
        medians[impl.name] = statistics.median(per_step)
    peaks: list = [None] * world
    dist.all_gather_object(peaks, {n: memory[n][0] for n in names})

    if rank == 0:
        ours = medians["ours"]
        lines = [
            f"world {world}, CPU/gloo, {args.param_dtype} params, Llama dim {args.dim}, {args.layers} blocks, vocab {cfg.vocab_size}, "
            f"global batch {args.batch}x{args.seq_len}; {args.rounds} interleaved rounds x {args.steps_per_round} steps, "
            f"memory: median of {args.memory_repeats} builds, "
            f"torch {torch.__version__}",
            "",
            "| implementation | median step (ms) | ours / this | peak memory per rank (MiB) | ours / this | comm per rank per step (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for name in names:
            peak = [pk[name] for pk in peaks]
            ours_peak = [pk["ours"] for pk in peaks]
            mem_ratio = max(o / t for o, t in zip(ours_peak, peak))
            lines.append(
                f"| {name} | {medians[name] * 1e3:.2f} | {ours / medians[name]:.3f} | "
                f"{', '.join(f'{b / 2**20:.2f}' for b in peak)} | {mem_ratio:.3f} | {memory[name][1] / 2**20:.2f} |"
            )
        table = "\n".join(lines)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
    dist.barrier()  # gloo aborts if a rank tears down while a peer finishes the last collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
