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

``--compile --floor`` adds ``local+step``: each rank trains an unsharded replica of its own, whole
step compiled, nothing communicated (not data parallel: the floor a sharded step is measured
against). ``--unbucketed`` adds a row for ours with bucketing off; ``--in-flight N`` (repeatable) a row for
ours with ``set_collectives_in_flight(N)``; ``--bucket-bytes N`` (repeatable) one with
``set_bucket_bytes(N)``; ``--hsdp`` shards over a (2, world/2)
(replicate, shard) mesh; ``--finite-check`` / ``--schedule-check`` turn those checks on for ours
(compare with a run without to read their cost).

With ``--model llama`` a tokens/s column: global batch x seq_len / median step time.

On a GPU (``--device cuda``; CPU/gloo is the default): NCCL, each rank on the device LOCAL_RANK,
the model built there, meshes on it, DDP with ``device_ids``; a step's clock starts and stops on a
synchronized device. The memory column is the device's caching allocator instead of
``benchmarks/alloc`` (which counts CPU storages only): ``max_memory_allocated()`` in a step (peak
stats reset before it) minus ``memory_allocated()`` before the model was built, and an extra column,
the reserved peak (``memory_stats()["reserved_bytes.all.peak"]``) minus what was reserved then (the
cache is emptied before each build): what the process takes from the device, fragmentation
included. Both are read through ``torch.accelerator`` (the same statistics as ``torch.cuda``'s
calls of those names). The table of issue #22's GPU section (a 1.17B-parameter Llama in bf16, ours
vs PyTorch's ``fully_shard``; run both):

    torchrun --nproc-per-node 1 benchmarks/bench_step.py --device cuda --model llama --dim 2048 --layers 22 \\
        --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16 --out gpu-world1.md
    torchrun --nproc-per-node 2 benchmarks/bench_step.py --device cuda --model llama --dim 2048 --layers 22 \\
        --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16 --out gpu-world2.md

The timed rounds keep every implementation alive at once (about 19 GB of fp32 parameters, gradients
and AdamW state each at world 1, plus one step's activations): if world 1 does not fit the card,
halve ``--batch`` (and say so next to the numbers).

Options: --model {llama,wide,deep-narrow} --unbucketed --hsdp --rounds R --steps-per-round K --warmup W --dim D --layers L
         --batch B --seq-len S --out FILE --param-dtype {fp32,bf16} --device {cpu,cuda} --vocab V --heads H
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


def _cpu_referee_optional() -> bool:
    """``--device`` names an accelerator: its own allocator is the referee there, so a missing
    ``benchmarks/alloc`` (no C++ compiler) is not fatal. On CPU it is."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    return pre.parse_known_args()[0].device != "cpu"


try:
    COUNTER: alloc.Counter | None = alloc.install()  # before any tensor of a model exists
except (RuntimeError, OSError) as error:
    if not _cpu_referee_optional():
        raise
    COUNTER = None
    print(f"bench_step.py: no CPU allocator referee ({error}); the device's allocator is the referee",
          file=sys.stderr, flush=True)

import torch.distributed as dist  # noqa: E402
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402

DEFAULT_VOCAB, DEFAULT_HEADS = 1024, 4  # the Llama's; scripts whose args lack --vocab / --heads get these


class Impl:
    def __init__(self, name: str, model: nn.Module, kind: str, device: torch.device | str = "cpu") -> None:
        self.name = name
        self.model = model
        self.kind = kind
        self.device = torch.device(device)  # where its batches go
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.opt_step = self.opt.step  # torch.compile(opt.step) for the rows that compile the whole step
        self.times: list[float] = []
        self.host_times: list[float] = []  # CPU time of the Python thread (our hooks, autograd, optimizer)

    def step(self, step: int, args: argparse.Namespace) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.kind == "llama":
            x, y = synthetic_batch(step, args.batch, args.seq_len, getattr(args, "vocab", DEFAULT_VOCAB))
            x, y = x.chunk(world)[rank].to(self.device), y.chunk(world)[rank].to(self.device)
            loss = loss_fn(self.model(x), y)
        else:  # wide / deep-narrow: a regression on random inputs
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(args.batch, self.width, generator=gen).chunk(world)[rank].to(self.device)
            loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt_step()
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


def device_of(args: argparse.Namespace) -> torch.device:
    """The device ``args.device`` names (cpu where args have none), at the current index on an accelerator."""
    kind = getattr(args, "device", "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def make_model(kind: str, args: argparse.Namespace) -> tuple[nn.Module, list[nn.Module]]:
    """The model and the blocks each get their own fully_shard call (then the root). Built on the
    accelerator with ``--device``; on CPU under no device context (the planner builds it on meta)."""
    device = device_of(args)
    if device.type != "cpu":
        with torch.device(device):
            return _make_model(kind, args)
    return _make_model(kind, args)


def _make_model(kind: str, args: argparse.Namespace) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    if kind == "llama":
        hidden = int(args.dim * 8 / 3)
        if getattr(args, "float8", False):  # float8 matmuls want dims in multiples of 16
            hidden = -(-hidden // 256) * 256
        cfg = LlamaConfig(vocab_size=getattr(args, "vocab", DEFAULT_VOCAB), dim=args.dim, n_layers=args.layers,
                          n_heads=getattr(args, "heads", DEFAULT_HEADS), hidden_dim=hidden,
                          max_seq_len=args.seq_len)
        model = Llama(cfg)
        if getattr(args, "float8", False):
            to_float8(model)
        return model, list(model.layers)
    if kind == "wide":  # few large layers: memory per collective dominates
        model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        return model, list(model)
    if kind == "deep-narrow":  # many tiny layers: per-collective overhead dominates
        model = nn.Sequential(*[Residual(args.dim) for _ in range(args.layers)])
        return model, list(model)
    raise ValueError(kind)


def to_float8(model: nn.Module) -> None:
    """torchao's float8 training for every Linear but the output projection (as torchtitan), with
    the float8 all-gather: each weight's local tensor defines fsdp_pre_all_gather (docs/extensions.md)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def build(name: str, args: argparse.Namespace) -> Impl:
    model, blocks = make_model(args.model, args)
    world, device = dist.get_world_size(), device_of(args)
    if args.hsdp:  # (replicate, shard): 2 replicas of world / 2 shards each
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    dtype = PARAM_DTYPES[args.param_dtype]
    # +blocks: each block compiled; +model: the whole model; +step: the whole model and the optimizer's
    # step (torch.compile(opt.step)); +blocks+opt: each block and the optimizer's step
    name, _, compiled = name.partition("+")
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
    elif name == "local":  # the floor: each rank its own unsharded replica, nothing communicated
        if dtype is not None:
            model.to(dtype)
    elif name == "ddp":
        if device.type == "cpu":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        raise ValueError(name)
    if compiled.startswith("blocks"):  # in place, after sharding: the hooks stay outside each block's graph
        for block in blocks:
            block.compile(backend=args.compile_backend)
    elif compiled.startswith(("model", "step")):  # one graph (ours: the collectives in it; local: none)
        _, _, collectives = compiled.partition(":")  # +model:bucket: FSDPModule.compile(collectives=...)
        extra = {"collectives": collectives} if collectives else {}
        model.compile(backend=args.compile_backend, fullgraph=True, **extra)
    impl = Impl(name + (f"+{compiled}" if compiled else ""), model, args.model, device)
    if compiled.startswith("step") or compiled == "blocks+opt":
        impl.opt_step = torch.compile(impl.opt.step, backend=args.compile_backend)
    return impl


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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class DeviceMemory:
    """An accelerator's caching allocator as the referee, with ``alloc.Counter``'s interface plus
    the reserved bytes. Each reading waits for the device first, so a step's kernels and the frees
    they hold back are in it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def live(self) -> int:
        synchronize(self.device)
        return torch.accelerator.memory_allocated(self.device)

    def peak(self) -> int:
        synchronize(self.device)
        return torch.accelerator.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        synchronize(self.device)
        torch.accelerator.reset_peak_memory_stats(self.device)

    def reserved(self) -> int:
        return torch.accelerator.memory_reserved(self.device)

    def reserved_peak(self) -> int:
        """``memory_stats()["reserved_bytes.all.peak"]``."""
        synchronize(self.device)
        return torch.accelerator.max_memory_reserved(self.device)

    def empty_cache(self) -> None:
        """Give cached blocks back, so what one build reserved does not count in the next's peak."""
        gc.collect()
        synchronize(self.device)
        torch.accelerator.empty_cache()


def referee(device: torch.device) -> alloc.Counter | DeviceMemory:
    """Who counts memory on ``device``: the counting CPU allocator, or the accelerator's own."""
    if device.type == "cpu":
        if COUNTER is None:
            raise RuntimeError("the CPU allocator referee (benchmarks/alloc) is not installed")
        return COUNTER
    return DeviceMemory(device)


def step_peaks(impl: Impl, args: argparse.Namespace, before_model: int, samples: int = 3,
               reserved: list[int] | None = None) -> list[int]:
    """The allocator's peak in each of ``samples`` steps, above what was alive before the model
    (on an accelerator: ``max_memory_allocated``; ``reserved`` gets each step's reserved peak)."""
    counter = referee(impl.device)
    peaks = []
    for step in range(samples):
        gc.collect()
        counter.reset_peak()
        impl.step(step, args)
        peaks.append(counter.peak() - before_model)
        if reserved is not None:
            reserved.append(counter.reserved_peak())
    return peaks


def comm_bytes(impl: Impl, args: argparse.Namespace) -> tuple[int, int]:
    """(bytes, collectives) per rank per step. DDP's all-reduces run inside its C++ reducer,
    unseen by the dispatcher: its row reports the gradient bytes and 0 counted collectives."""
    if impl.name == "ddp":
        return sum(p.numel() * p.element_size() for p in impl.model.parameters() if p.requires_grad), 0
    if impl.name.startswith("local"):  # nothing communicated
        return 0, 0
    if "+" in impl.name:  # compiled: a dispatch mode would make dynamo skip the frames (-1: not counted)
        return -1, -1
    with CollectiveBytes() as counter:
        impl.step(0, args)
    return counter.nbytes, counter.count


first_step: dict[str, float] = {}  # seconds of each implementation's first step in a fresh process (compiling)


def measure_memory(names: list[str], args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Per implementation: every measured step's allocator peak (``args.memory_repeats`` fresh
    builds, a rotating order, one implementation alive at a time), (bytes, collectives) per step,
    and on an accelerator every step's reserved peak above what was reserved before the build."""
    counter = referee(device_of(args))
    on_device = isinstance(counter, DeviceMemory)
    peaks: dict[str, list[int]] = {name: [] for name in names}
    reserved: dict[str, list[int]] = {name: [] for name in names} if on_device else {}
    comm: dict[str, tuple[int, int]] = {}
    for repeat in range(args.memory_repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            gc.collect()
            if on_device:
                counter.empty_cache()
            before_reserved = counter.reserved() if on_device else 0
            before_model = counter.live()
            impl = build(name, args)
            tic = time.perf_counter()
            impl.step(0, args)  # warm: optimizer state exists, lazy init done
            if repeat == 0:  # the first build of each: compiling, cold
                first_step[name] = time.perf_counter() - tic
            impl.step(1, args)
            raw: list[int] | None = [] if on_device else None
            peaks[name] += step_peaks(impl, args, before_model, reserved=raw)
            if on_device:
                reserved[name] += [r - before_reserved for r in raw]
            if name not in comm:
                comm[name] = comm_bytes(impl, args)
            del impl
    if on_device:
        counter.empty_cache()  # the timed rounds start from an empty cache too
    return peaks, comm, reserved


def timed(impl: Impl, fn: Callable[[], None]) -> None:
    """Time ``fn`` from a synchronized device to a synchronized device; the host CPU time stops
    before the wait (a spinning synchronize would count as host work)."""
    dist.barrier()
    synchronize(impl.device)
    start, host = time.perf_counter(), time.thread_time()
    fn()
    host = time.thread_time() - host
    synchronize(impl.device)
    impl.times.append(time.perf_counter() - start)
    impl.host_times.append(host)


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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: NCCL, one GPU per rank (LOCAL_RANK), memory from the device's caching allocator")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="llama's vocabulary size")
    p.add_argument("--heads", type=int, default=DEFAULT_HEADS, help="llama's attention heads (must divide --dim)")
    p.add_argument("--compile", action="store_true",
                   help="rows: ours eager, ours+blocks (each block compiled), ours+model (the whole model, "
                        "collectives in the graph), ours+step (the whole model and torch.compile(optimizer.step)), "
                        "torch_fsdp2+blocks, torch_fsdp2+blocks+opt (and its optimizer step compiled); the first "
                        "step's time (compiling) is reported")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--compile-collectives", action="append", default=[],
                   help="with --compile: also rows ours+model:NAME and ours+step:NAME, the whole model (and "
                        "the optimizer step) compiled with FSDPModule.compile(collectives=NAME) (repeatable; "
                        "docs/compile.md)")
    p.add_argument("--float8", action="store_true",
                   help="llama: torchao float8 training (float8 all-gather) for every Linear but the output, "
                        "for every implementation; the FFN width rounded up to a multiple of 256")
    p.add_argument("--floor", action="store_true",
                   help="with --compile: also a row local+step, each rank training an unsharded replica of its own "
                        "(whole model and optimizer step compiled, nothing communicated, no gradients averaged): "
                        "not data parallel, the floor a sharded step's time is measured against (bf16: the "
                        "replica in bf16, optimizer included)")
    p.add_argument("--only", action="append", default=[], help="run only these rows (repeatable)")
    args = p.parse_args()
    defaults = {"llama": (128, 4), "wide": (4096, 4), "deep-narrow": (64, 64)}[args.model]
    args.dim = args.dim if args.dim is not None else defaults[0]
    args.layers = args.layers if args.layers is not None else defaults[1]
    if args.model == "llama" and (args.dim % args.heads or (args.dim // args.heads) % 2):
        raise SystemExit(f"--heads {args.heads} must divide --dim {args.dim} into an even head size (rotary pairs)")

    device = init_distributed(args.device)
    if args.compile:
        # torch 2.13's AOTAutograd cache keys a DTensor input by its global shape only: a rank whose
        # uneven shard differs would load another rank's compiled optimizer step from a shared cache
        # directory and fail its size check (docs/compile.md). One cache directory per rank.
        import tempfile

        base = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_bench"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{dist.get_rank()}")
    if args.schedule_check:
        from fully_shard.debug import set_schedule_check

        set_schedule_check(True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ["ours", "torch_fsdp2", "ddp"] if args.param_dtype == "fp32" else ["ours", "torch_fsdp2"]
    if args.compile:
        # Every whole-model row compiles the same code (nn.Module._call_impl) for a model of its own,
        # built twice (memory, then timing): each is a cache entry of that one code object.
        torch._dynamo.config.recompile_limit = 64
        names = ["ours", "ours+blocks", "ours+model", "ours+step",
                 *(f"ours+{w}:{c}" for c in args.compile_collectives for w in ("model", "step")), "torch_fsdp2+blocks", "torch_fsdp2+blocks+opt"]
    if args.floor and not args.compile:
        raise SystemExit("--floor adds local+step, a compiled row: use it with --compile")
    if args.floor:
        names.append("local+step")
    if args.unbucketed:
        names.insert(1, "ours_unbucketed")
    for n in args.in_flight:
        names.insert(1, f"ours_in_flight_{n}")
    for n in args.bucket_bytes:
        names.insert(1, f"ours_bucket_{n}")
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"--only {unknown}: not rows of this run; its rows are {names}")
        names = [n for n in names if n in args.only]
    if args.float8 and args.model != "llama":
        raise SystemExit("--float8 converts the llama model's Linear layers; use --model llama")
    if args.hsdp and (world < 4 or world % 2):
        raise SystemExit("--hsdp needs an even world size >= 4 (2 replicas of at least 2 shards)")

    memory, comm, reserved = measure_memory(names, args)

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
    reserved_peaks: list = [None] * world
    dist.all_gather_object(reserved_peaks, reserved)

    if rank == 0:
        table, rows = report(names, args, device, world, medians, spans, host, peaks, reserved_peaks, comm)
        if args.compile and ("torch_fsdp2+blocks" in names or "local+step" in names):
            mib = {n: statistics.median(max(v) for v in zip(*(pk[n] for pk in peaks))) / 2**20 for n in names}
            pairs = [(n, "torch_fsdp2+blocks") for n in names
                     if n.startswith(("ours+model", "ours+step")) and "torch_fsdp2+blocks" in names]
            pairs += [("ours+step", "torch_fsdp2+blocks+opt")] if {"ours+step", "torch_fsdp2+blocks+opt"} <= set(names) else []
            pairs += [(n, "local+step") for n in ("ours+step", "torch_fsdp2+blocks") if {n, "local+step"} <= set(names)]
            table += "\n" + "".join(
                f"{n} / {t}: step time {medians[n] / medians[t]:.2f}x, peak memory {mib[n] / mib[t]:.2f}x\n"
                for n, t in pairs)
            table += ("first step of the first build (compiling, cold), s: " + ", ".join(f"{n} {first_step[n]:.1f}" for n in names) + "\n")
        emit(table, args.out)
        if args.json:
            with open(args.json, "w") as f:
                from fully_shard.runtime.settings import DEFAULT_BUCKET_BYTES

                json.dump({"model": args.model, "world": world, "device": device.type, "rows": rows,
                           "default_bucket_bytes": DEFAULT_BUCKET_BYTES}, f, indent=1)

    shutdown()


def init_distributed(kind: str) -> torch.device:
    """The process group and this rank's device: gloo on CPU; on an accelerator the device
    LOCAL_RANK made current and its default backend (NCCL for cuda) bound to it."""
    if kind == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or accelerator.type != kind:
        raise SystemExit(f"--device {kind}: no such accelerator here (found {accelerator})")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.accelerator.device_count():
        raise SystemExit(f"LOCAL_RANK {local_rank}: only {torch.accelerator.device_count()} {kind} devices")
    torch.accelerator.set_device_index(local_rank)
    device = torch.device(kind, local_rank)
    dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device)
    return device


def llama_params(args: argparse.Namespace) -> int:
    """The Llama's parameter count (tied embedding once), built on the meta device."""
    with torch.device("meta"):
        model, _ = make_model("llama", argparse.Namespace(**{**vars(args), "device": "cpu"}))
    return sum(p.numel() for p in model.parameters())


def report(names: list[str], args: argparse.Namespace, device: torch.device, world: int, medians: dict,
           spans: dict, host: dict, peaks: list, reserved_peaks: list, comm: dict) -> tuple[str, dict]:
    """The markdown table (rank 0) and the JSON rows. ``peaks`` / ``reserved_peaks``: every rank's
    per-implementation lists (``reserved_peaks``' dicts are empty on CPU)."""
    base = "ours" if "ours" in names else names[0]  # the ratios' reference row (--only may leave ours out)
    ours = medians[base]
    on_device = device.type != "cpu"
    llama = args.model == "llama"
    if llama:
        n = llama_params(args)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        shape = (f"Llama dim {args.dim}, {args.layers} blocks, {args.heads} heads, vocab {args.vocab} "
                 f"({size} params), global batch {args.batch}x{args.seq_len}")
        if args.float8:
            shape += ", torchao float8 Linears (float8 all-gather), FFN width rounded to 256"
    elif args.model == "wide":
        shape = f"{args.layers} x Linear({args.dim}, {args.dim}), global batch {args.batch}"
    else:
        shape = f"{args.layers} blocks of x + relu(Linear({args.dim}, {args.dim})(x)), global batch {args.batch}"
    if on_device:
        card = getattr(torch.get_device_module(device.type), "get_device_name", lambda _: device.type)(device)
        where = f"{device.type.upper()} ({card})/{dist.get_backend()}"
        memory = ("memory: max_memory_allocated in a step minus allocated before the model was built, and the "
                  "reserved peak minus reserved then")
        mem_header = (f"peak MiB per rank (max_memory_allocated) [min-max] | {base} / this | "
                      "reserved peak MiB per rank")
    else:
        where = "CPU/gloo"
        memory = "memory: allocator peak per rank"
        mem_header = f"peak MiB per rank (allocator) [min-max] | {base} / this"
    lines = [
        f"world {world}{' as HSDP (2 replicas x ' + str(world // 2) + ' shards)' if args.hsdp else ''}, {where}, "
        f"{args.param_dtype} params, {shape}; {args.rounds} interleaved rounds x "
        f"{args.steps_per_round} steps; {memory}, max over ranks, median [min-max] of "
        f"{args.memory_repeats} builds x 3 steps; torch {torch.__version__}",
        "",
        f"| implementation | median step (ms) [min-max] | {base} / this |{' tokens/s |' if llama else ''} "
        f"host CPU ms/step | {mem_header} | collectives / step | comm MiB / rank / step |",
        "|---" * (8 + llama + on_device) + "|",
    ]

    def mib_over_ranks(per_rank: list) -> dict:  # every step's max over ranks, in MiB
        return {n: [max(vals) / 2**20 for vals in zip(*(pk[n] for pk in per_rank))] for n in names}

    mib = mib_over_ranks(peaks)
    reserved_mib = mib_over_ranks(reserved_peaks) if on_device else {}
    rows = {}
    for name in names:
        lo, hi = spans[name]
        med = statistics.median(mib[name])
        tokens = args.batch * args.seq_len / medians[name]
        cells = [name, f"{medians[name] * 1e3:.2f} [{lo * 1e3:.1f}-{hi * 1e3:.1f}]", f"{ours / medians[name]:.3f}"]
        cells += [f"{tokens:,.0f}"] if llama else []
        cells += [f"{host[name] * 1e3:.2f}", f"{med:.1f} [{min(mib[name]):.1f}-{max(mib[name]):.1f}]",
                  f"{statistics.median(mib[base]) / med:.3f}"]
        if on_device:
            res = reserved_mib[name]
            cells.append(f"{statistics.median(res):.1f} [{min(res):.1f}-{max(res):.1f}]")
        if comm[name][1] < 0:
            cells += ["(not counted: compiled)", "-"]
        else:
            cells += [str(comm[name][1]) if name != "ddp" else "(in C++)", f"{comm[name][0] / 2**20:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
        if name != "ddp":
            rows[name] = {"step_ms": medians[name] * 1e3, "peak_mib": med, "collectives": comm[name][1]}
            if llama:
                rows[name]["tokens_per_s"] = tokens
            if on_device:
                rows[name]["reserved_peak_mib"] = statistics.median(reserved_mib[name])
    return "\n".join(lines), rows


def emit(table: str, out: "str | None") -> None:
    """Print a markdown table (rank 0) and, with ``--out``, write it there too."""
    print(table, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
