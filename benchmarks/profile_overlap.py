"""torchrun --nproc-per-node 1 benchmarks/profile_overlap.py --device cuda [bench_step.py's model options]

Do the collectives overlap compute? (issue #27's GPU section.) For each implementation named by
``--impl`` (bench_step.py's row names: ``ours+model`` is the whole model compiled with the default
``collectives="bucket"``, ``ours+model:overlap`` with Inductor's overlap scheduler,
``torch_fsdp2+blocks`` PyTorch's fully_shard with each block compiled), a few warm-up steps, then
one step under ``torch.profiler`` with device activity. From the trace's kernels: the device time
of the communication kernels (NCCL's), of everything else (compute), and the part of the
communication time during which a compute kernel ran on another stream at the same moment (the
overlap). Writes each trace (gzipped Chrome trace) and a markdown table under ``--out-dir``.

At world 1 NCCL's "collectives" are copies on one rank; the overlap column then says whether they
run on a stream of their own beside compute, not what a multi-GPU job hides.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402


def kernels(trace: dict) -> list[tuple[float, float, int, str]]:
    """(start, end, stream, name) of every device kernel in a Chrome trace, microseconds."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            start = float(ev["ts"])
            out.append((start, start + float(ev.get("dur", 0)), int(ev.get("args", {}).get("stream", ev.get("tid", 0))),
                        ev.get("name", "")))
    return out


def is_comm(name: str) -> bool:
    return "nccl" in name.lower()


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap_of(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Microseconds of the union of ``comm`` covered by the union of ``compute``."""
    total, cu = 0.0, union(compute)
    for a, b in union(comm):
        for c, d in cu:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--impl", action="append", default=[])
    p.add_argument("--model", default="llama")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--param-dtype", default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", default="profile-out")
    args = p.parse_args()
    args.hsdp, args.finite_check, args.compile_backend = False, False, "inductor"
    impls = args.impl or ["ours+model", "torch_fsdp2+blocks"]
    device = bench_step.init_distributed(args.device)
    torch._dynamo.config.recompile_limit = 64
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in impls:
        impl = bench_step.build(name, args)
        for s in range(args.warmup):
            impl.step(s, args)
        bench_step.synchronize(device)
        with profile(activities=activities) as prof:
            impl.step(args.warmup, args)
            bench_step.synchronize(device)
        path = os.path.join(args.out_dir, f"trace-{name.replace(':', '_').replace('+', '_')}-rank{dist.get_rank()}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
        ks = kernels(trace)
        comm = [(a, b) for a, b, _, n in ks if is_comm(n)]
        compute = [(a, b) for a, b, _, n in ks if not is_comm(n)]
        comm_us = sum(b - a for a, b in union(comm))
        compute_us = sum(b - a for a, b in union(compute))
        hidden = overlap_of(comm, compute)
        streams = sorted({s for _, _, s, n in ks if is_comm(n)})
        span = (max(b for _, b, _, _ in ks) - min(a for a, _, _, _ in ks)) if ks else 0.0
        rows.append((name, len(comm), streams, comm_us, compute_us, hidden, span))
        if dist.get_rank() == 0:  # as it comes: a run cut short keeps what it measured
            print(f"{name}: {len(comm)} comm kernels on streams {streams}, comm {comm_us / 1e3:.2f} ms, compute "
                  f"{compute_us / 1e3:.2f} ms, comm under compute {hidden / 1e3:.2f} ms, span {span / 1e3:.2f} ms",
                  flush=True)
        del impl
        torch.accelerator.empty_cache() if device.type != "cpu" else None
    if dist.get_rank() == 0:
        lines = [f"world {dist.get_world_size()}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
                 f"torch {torch.__version__}, llama dim {args.dim} x {args.layers} layers, {args.param_dtype}, "
                 f"batch {args.batch} x {args.seq_len}; one profiled step after {args.warmup} warm-up steps\n",
                 "| implementation | comm kernels | their streams | comm time, ms | compute time, ms | "
                 "comm time under compute, ms (%) | kernels' span, ms |",
                 "|---|---|---|---|---|---|---|"]
        for name, n, streams, c, k, h, span in rows:
            pct = f"{100 * h / c:.0f}%" if c else "-"
            lines.append(f"| {name} | {n} | {streams} | {c / 1e3:.2f} | {k / 1e3:.2f} | {h / 1e3:.2f} ({pct}) | "
                         f"{span / 1e3:.2f} |")
        table = "\n".join(lines) + "\n"
        print(table)
        with open(os.path.join(args.out_dir, "overlap.md"), "w") as f:
            f.write(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
