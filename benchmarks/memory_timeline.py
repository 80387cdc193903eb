"""torchrun --nproc-per-node 2 benchmarks/memory_timeline.py --model wide --png docs/memory-wide.png

Live CPU bytes over one training step, ours and PyTorch's ``fully_shard`` side by side (rank 0),
same model, seed and batch as ``bench_step.py``. Sampled at every block's forward / backward
boundary and at the phase ends; the total is the allocator's (``benchmarks/alloc``, every storage
counted), with the highest value it reached since the sample before drawn as a line over it.

The split by category comes from each implementation's own bookkeeping: for ours the runtime's
accounting of what it holds (``live_buffers`` of every state and of the root: sharded / unsharded
parameters, gradients, communication buffers) and the optimizer's state; for
PyTorch's, what its public surface shows (the parameters registered at that moment, drawn as
sharded though a computing block's are unsharded, their ``.grad``, the optimizer's state). The rest ("other") is activations, autograd's saved tensors and, for PyTorch's, its
unsharded parameters and buffers, which it does not expose. For ours it also prints how far the
allocator is from the runtime's accounting plus the optimizer state and what autograd saved (a
``saved_tensors_hooks`` count): what is left is the step's inputs, outputs and gradients in flight.

Options: --model {wide,llama,deep-narrow} --dim D --layers L --batch B --seq-len S
         --param-dtype {fp32,bf16} --in-flight N (ours) --png FILE
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import weakref

import bench_step  # installs the allocator referee before any model exists
import torch
import torch.distributed as dist
from torch import nn

COUNTER = bench_step.COUNTER
CATEGORIES = ["sharded_params", "unsharded_params", "gradients", "communication", "optimizer_state", "other"]
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#cccccc"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


Sized = dict  # storage id -> (category, bytes)


def _bytes_by_category(storages: dict[int, tuple[str, int]]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in storages.values():
        out[category] = out.get(category, 0) + nbytes
    return out


def ours_categories(impl: bench_step.Impl) -> Sized:
    """The runtime's own accounting of what it holds (``live_buffers``), plus the optimizer's state."""
    ctx = impl.model._get_fsdp_state().ctx
    sized: dict[int, tuple[str, int]] = {}
    for category, t in [b for s in ctx.states for b in s.live_buffers()] + ctx.live_buffers():
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            sized.setdefault(storage._cdata, (category, storage.nbytes()))
    _add_optimizer_state(impl.opt, sized)
    return sized


def _add_optimizer_state(opt: torch.optim.Optimizer, sized: dict[int, tuple[str, int]]) -> None:
    for entry in opt.state.values():
        for v in entry.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:  # not the step counters
                storage = _local(v).untyped_storage()
                sized.setdefault(storage._cdata, ("optimizer_state", storage.nbytes()))


def torch_categories(impl: bench_step.Impl) -> Sized:
    """What PyTorch's fully_shard shows publicly: sharded parameters, their .grad, optimizer state."""
    sized: dict[int, tuple[str, int]] = {}
    for p in impl.model.parameters():
        s = _local(p).untyped_storage()
        sized.setdefault(s._cdata, ("sharded_params", s.nbytes()))
        if p.grad is not None:
            g = _local(p.grad).untyped_storage()
            sized.setdefault(g._cdata, ("gradients", g.nbytes()))
    _add_optimizer_state(impl.opt, sized)
    return sized


class SavedActivations:
    """What autograd saves for backward (weakly: a tensor counts while it lives), so a sample can
    tell activations from memory nobody accounts for."""

    def __init__(self) -> None:
        self.saved: list[weakref.ref] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(weakref.ref(t))
        return t

    def bytes_beyond(self, sized: Sized) -> int:
        seen, total = set(sized), 0
        for ref in self.saved:
            t = ref()
            if t is not None and t.device.type == "cpu":
                storage = _local(t).untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += storage.nbytes()
        return total


def record_step(impl: bench_step.Impl, args: argparse.Namespace, blocks: list[nn.Module]) -> list[dict]:
    """One step's samples: label, phase, allocator live and peak since the sample before, categories."""
    categorize = ours_categories if impl.name.startswith("ours") else torch_categories
    samples: list[dict] = []
    phase = ["forward"]

    saved = SavedActivations()

    def sample(label: str) -> None:
        live, peak = COUNTER.live(), COUNTER.peak()
        sized = categorize(impl)
        cats = _bytes_by_category(sized)
        cats["other"] = max(live - sum(cats.values()), 0)
        activations = saved.bytes_beyond(sized)
        samples.append({"label": label, "phase": phase[0], "live": live, "peak": peak, "cats": cats,
                        "activations": activations, "unexplained": cats["other"] - activations})
        COUNTER.reset_peak()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: sample(f"fwd {i}")))
        handles.append(block.register_full_backward_pre_hook(lambda m, g, i=i: sample(f"bwd {i}")))
    gc.collect()
    COUNTER.reset_peak()
    sample("start")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        if args.model == "llama":
            x, y = bench_step.synthetic_batch(0, args.batch, args.seq_len, 1024)
            loss = bench_step.loss_fn(impl.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        else:
            x = torch.randn(args.batch, impl.width, generator=gen).chunk(world)[rank]
            loss = impl.model(x).pow(2).mean()
    sample("loss")
    phase[0] = "backward"
    loss.backward()
    sample("backward end")
    phase[0] = "optimizer"
    impl.opt.step()
    impl.opt.zero_grad()
    sample("optimizer end")
    for h in handles:
        h.remove()
    return samples


def draw(results: dict[str, list[dict]], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
    for ax, (name, samples) in zip(axes, results.items()):
        x = list(range(len(samples)))
        stacks = [[s["cats"][c] / 2**20 for s in samples] for c in CATEGORIES]
        ax.stackplot(x, *stacks, labels=CATEGORIES, colors=COLORS, step="post")
        ax.step(x, [s["peak"] / 2**20 for s in samples], where="pre", color="black", lw=1,
                label="allocator peak since the sample before")
        for phase, shade in (("forward", "#f4f4ff"), ("backward", "#fff4f4"), ("optimizer", "#f4fff4")):
            idx = [i for i, s in enumerate(samples) if s["phase"] == phase]
            if idx:
                ax.axvspan(idx[0] - 0.5, idx[-1] + 0.5, color=shade, zorder=-1)
                ax.text((idx[0] + idx[-1]) / 2, 0, phase, ha="center", va="bottom", fontsize=8)
        top = max(s["peak"] for s in samples) / 2**20
        ax.set_title(f"{name}: peak {top:.1f} MiB (rank 0)")
        ax.set_xticks(x, [s["label"] for s in samples], rotation=90, fontsize=6)
        ax.set_ylabel("live MiB") if ax is axes[0] else None
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["llama", "wide", "deep-narrow"], default="wide")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--param-dtype", choices=sorted(bench_step.PARAM_DTYPES), default="fp32")
    p.add_argument("--in-flight", type=int, default=None, help="ours with set_collectives_in_flight(N)")
    p.add_argument("--png", default=None, help="write the picture here (rank 0)")
    args = p.parse_args()
    defaults = {"llama": (128, 4), "wide": (4096, 4), "deep-narrow": (64, 64)}[args.model]
    args.dim = args.dim if args.dim is not None else defaults[0]
    args.layers = args.layers if args.layers is not None else defaults[1]
    args.hsdp, args.finite_check = False, False
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    ours = "ours" if args.in_flight is None else f"ours_in_flight_{args.in_flight}"
    results = {}
    for name in (ours, "torch_fsdp2"):
        gc.collect()
        impl = bench_step.build(name, args)
        blocks = [m for m in impl.model.modules() if m is not impl.model and hasattr(m, "reshard")]
        for s in range(2):  # lazy init, optimizer state
            impl.step(s, args)
        dist.barrier()
        start = time.perf_counter()
        results[name] = record_step(impl, args, blocks)
        if dist.get_rank() == 0:
            top = max(s["peak"] for s in results[name]) / 2**20
            print(f"{name}: peak {top:.1f} MiB over {len(results[name])} samples "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
            if name.startswith("ours"):  # the runtime's accounting against the allocator
                worst = max(results[name], key=lambda s: abs(s["unexplained"]))
                print(f"  allocator - (runtime accounting + optimizer state + saved activations): at most "
                      f"{worst['unexplained'] / 2**20:+.2f} MiB (at '{worst['label']}', where saved activations "
                      f"are {worst['activations'] / 2**20:.2f} MiB)", flush=True)
        del impl, blocks
    if dist.get_rank() == 0 and args.png:
        title = f"{args.model} ({args.layers} x dim {args.dim}), {args.param_dtype}, world {dist.get_world_size()}, CPU/gloo"
        draw(results, title, args.png)
        print("wrote", args.png)
    bench_step.shutdown()


if __name__ == "__main__":
    sys.exit(main())
