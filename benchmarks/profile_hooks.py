"""torchrun --nproc-per-node 2 benchmarks/profile_hooks.py [--model deep-narrow] [--unbucketed]

Host time spent inside the FSDP hooks, per sharded module, ours against PyTorch's
``fully_shard``: both label their hook work with ``record_function`` regions named ``FSDP::...``
(ours ``FSDP::pre_forward layers.0``, PyTorch's ``FSDP::pre_forward (layers.0)``). Under
``torch.profiler`` (CPU activity), the duration of every *outermost* ``FSDP::`` region (nested ones
are inside it) is summed per module and per kind of hook, over ``--steps`` profiled steps after
warm-up, and reported per step. A region's duration is the Python thread's wall time inside it:
our Python and kernels, and waits for collectives (PyTorch's FSDP2 waits for its CPU collectives
inside its hooks; ours mostly on gloo's threads, outside them). What runs outside such regions (autograd, the optimizer, the model's own
ops) is not counted here; the host CPU column of ``bench_step.py`` has the whole step.

Same models, options and seeds as ``bench_step.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import build, emit  # noqa: E402
from teardown import shutdown  # noqa: E402

# "FSDP::pre_forward layers.0" (ours), "FSDP::pre_forward (layers.0)" (PyTorch's)
_REGION = re.compile(r"^FSDP::(?P<kind>[A-Za-z_]+)(?: \(?(?P<module>[^)]*)\)?)?$")


def hook_times(name: str, args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """(microseconds per step by module, by hook kind) of the outermost FSDP regions."""
    impl = build(name, args)
    for s in range(args.warmup):
        impl.step(s, args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(args.steps):
            impl.step(args.warmup + s, args)
    by_module: dict[str, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    for event in prof.events():
        match = _REGION.match(event.name)
        if match is None:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("FSDP::"):
                nested = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        module = match.group("module") or "<root>"
        by_module[module] += event.cpu_time_total / args.steps
        by_kind[match.group("kind")] += event.cpu_time_total / args.steps
    return dict(by_module), dict(by_kind)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["llama", "wide", "deep-narrow"], default="deep-narrow")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--unbucketed", action="store_true", help="ours with set_bucket_bytes(0)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    defaults = {"llama": (128, 4), "wide": (4096, 4), "deep-narrow": (64, 64)}[args.model]
    args.dim = args.dim if args.dim is not None else defaults[0]
    args.layers = args.layers if args.layers is not None else defaults[1]
    args.param_dtype, args.hsdp, args.finite_check = "fp32", False, False

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    ours_name = "ours_unbucketed" if args.unbucketed else "ours"
    ours = hook_times(ours_name, args)
    theirs = hook_times("torch_fsdp2", args)
    if dist.get_rank() == 0:
        total_ours, total_theirs = sum(ours[0].values()), sum(theirs[0].values())
        modules = sorted(set(ours[0]) | set(theirs[0]), key=lambda m: (not m.startswith("<"), len(m), m))
        lines = [
            f"world {dist.get_world_size()}, {args.model}, rank 0, {args.steps} profiled steps; microseconds per step "
            f"the Python thread spends inside outermost FSDP:: regions (wall time: waits for collectives "
            f"included); ours = {ours_name}; torch {torch.__version__}",
            "",
            "| | ours | torch_fsdp2 | ours / torch |",
            "|---|---|---|---|",
            f"| **total per step** | {total_ours:.0f} | {total_theirs:.0f} | {total_ours / total_theirs:.3f} |",
        ]
        for kind in sorted(set(ours[1]) | set(theirs[1])):
            a, b = ours[1].get(kind, 0.0), theirs[1].get(kind, 0.0)
            lines.append(f"| hook `{kind}` | {a:.0f} | {b:.0f} | {a / b if b else float('nan'):.3f} |")
        per_module = [(m, ours[0].get(m, 0.0), theirs[0].get(m, 0.0)) for m in modules]
        per_block = [(m, a, b) for m, a, b in per_module if re.fullmatch(r"[0-9]+", m) or m.startswith("layers.")]
        if per_block:
            a = sum(x[1] for x in per_block) / len(per_block)
            b = sum(x[2] for x in per_block) / len(per_block)
            lines.append(f"| mean per block module ({len(per_block)}) | {a:.1f} | {b:.1f} | {a / b if b else float('nan'):.3f} |")
        lines.append("")
        lines.append("Per module (regions that name several modules, a bucket's, are its own row):")
        lines.append("")
        lines.append("| module | ours | torch_fsdp2 |")
        lines.append("|---|---|---|")
        for m, a, b in per_module:
            lines.append(f"| {m} | {a:.0f} | {b:.0f} |")
        emit("\n".join(lines), args.out)
    shutdown()


if __name__ == "__main__":
    main()
