"""python benchmarks/plan_vs_real.py [--model 1b] [--offload]

How far `fully_shard.plan` is from a real step on this machine, at world 1 (one process; NCCL
on a GPU, gloo on a CPU): the same model, settings and batch

* simulated (`plan.simulate`, in a subprocess: it needs a process without a process group),
* measured by the same counter on the real run (`plan.measure`: live tensor bytes),
* and, on an accelerator, the allocator's own peak (``torch.cuda.max_memory_allocated``, minus
  what was allocated before the model was built: the math libraries' workspaces, e.g. cuBLAS's
  32 MiB per stream on Hopper, are the process's, not the step's),

and the time model (`Plan.estimate` at the compute rate `plan.measure_flops` finds here; at
world 1 there is no communication) against the median measured step (forward, backward,
optimizer). Prints one markdown row per quantity with the errors, for `docs/planning.md`.

Options: --model {small,1b} (the 1.1B Llama needs a GPU with ~24 GiB) --batch B --seq-len S
         --steps N (timed steps) --offload (CPUOffloadPolicy: also compares host bytes)
         --json FILE (the numbers, for tests/test_gpu.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from llama_model import Llama, LlamaConfig  # noqa: E402

MODELS = {
    "small": dict(vocab_size=1024, dim=256, n_layers=4, n_heads=4, hidden_dim=688, max_seq_len=2048),
    "1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=16, hidden_dim=5632, max_seq_len=2048),
}


def _shard(model, mesh, offload: bool) -> None:
    from fully_shard import CPUOffloadPolicy
    from fully_shard.plan import default_shard_fn

    default_shard_fn(model, mesh, offload_policy=CPUOffloadPolicy() if offload else None)


def simulated(args: argparse.Namespace, rates: dict) -> dict:
    """The plan (in a fresh process) and its step time on one device at the ``rates`` measured here."""
    code = f"""
import functools, json, sys, torch
sys.path.insert(0, {os.path.join(HERE, '..', 'examples')!r}); sys.path.insert(0, {HERE!r})
from llama_model import Llama, LlamaConfig
from fully_shard.plan import Cluster, Link, simulate
import plan_vs_real
plan = simulate(lambda: Llama(LlamaConfig(**{MODELS[args.model]!r})), torch.zeros({args.batch}, {args.seq_len}, dtype=torch.long),
                mesh_shape=(1,), shard_fn=functools.partial(plan_vs_real._shard, offload={args.offload!r}))
here = Cluster(1, Link(0.0, 1.0), Link(0.0, 1.0), **{rates!r})  # one device: no links crossed
t = plan.estimate(here)
print(json.dumps({{"peak": plan.peak_bytes, "host": plan.host_peak_bytes, "estimate_s": t.step_s, "copy_s": t.copy_s,
                  "combined": max(s.total + s.host for s in plan.timeline)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    try:
        from fully_shard.plan import measure, measure_flops

        build = lambda: Llama(LlamaConfig(**MODELS[args.model]))  # noqa: E731
        x = torch.randint(0, MODELS[args.model]["vocab_size"], (args.batch, args.seq_len), device=device)
        rate = measure_flops(build, x, device=device)  # before the sharded model exists: its memory is freed
        sim = simulated(args, {"flops": rate.flops, "optimizer_elements_per_s": rate.optimizer_elements_per_s,
                               "memory_bytes_per_s": rate.memory_bytes_per_s})
        # What the process holds before the model exists (the input, and the math libraries' workspaces,
        # e.g. cuBLAS's per stream, made by measure_flops): not the model's step, which the plan is about.
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(0)
        with torch.device(device):
            model = build()
        mesh = init_device_mesh(device.type, (1,))
        _shard(model, mesh, args.offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        real = measure(model, x, opt, steps=2)
        allocator = torch.cuda.max_memory_allocated() - before if cuda else None
        times = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step = statistics.median(times)

        def err(a: float, b: float) -> str:
            return f"{(a - b) / b:+.1%}"

        gib = 2**30
        print(f"{args.model} Llama, batch {args.batch} x {args.seq_len}, world 1 on {device}"
              + (", CPUOffloadPolicy" if args.offload else "") + f", torch {torch.__version__}\n")
        print("| quantity | simulated / estimated | measured | error |")
        print("|---|---|---|---|")
        if cuda or not args.offload:  # offloaded on a CPU, the real run's gradients are the device's
            print(f"| peak live tensor bytes (plan.measure) | {sim['peak'] / gib:.3f} GiB | {real.peak_bytes / gib:.3f} GiB | "
                  f"{err(sim['peak'], real.peak_bytes)} |")
        if allocator is not None:
            print(f"| peak vs max_memory_allocated | {sim['peak'] / gib:.3f} GiB | {allocator / gib:.3f} GiB | "
                  f"{err(sim['peak'], allocator)} |")
        if args.offload and cuda:
            print(f"| host peak | {sim['host'] / gib:.3f} GiB | {real.host_peak_bytes / gib:.3f} GiB | "
                  f"{err(sim['host'], real.host_peak_bytes)} |")
        elif args.offload:  # on a CPU the host is the device: only the sum compares
            both = max(s.total + s.host for s in real.timeline)
            print(f"| device + host at the timeline's fullest point (a CPU's host is its device) | {sim['combined'] / gib:.3f} GiB | "
                  f"{both / gib:.3f} GiB | {err(sim['combined'], both)} |")
        print(f"| step time (compute at {rate.flops / 1e12:.3f} TFLOP/s, AdamW at {rate.optimizer_elements_per_s:.3g} "
              f"elements/s, copies at {rate.memory_bytes_per_s / 1e9:.1f} GB/s, all measured here; of it copies "
              f"{sim['copy_s'] * 1e3:.1f} ms) | {sim['estimate_s'] * 1e3:.1f} ms | "
              f"{step * 1e3:.1f} ms (median of {len(times)}, {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) | "
              f"{err(sim['estimate_s'], step)} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"simulated": sim, "measured_peak": real.peak_bytes, "measured_host": real.host_peak_bytes,
                           "max_memory_allocated": allocator, "estimate_s": sim["estimate_s"], "step_s": step}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
