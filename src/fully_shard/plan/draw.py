"""Pictures of a `Plan` (matplotlib, an optional dependency: ``pip install fully-shard[plot]``):
the memory timeline over the step, stacked by category, and the bytes each collective moves."""

from __future__ import annotations

from typing import Any

from ..tools.memory import CATEGORIES
from .simulate import GiB, Plan, from_trace

COLORS = {
    "sharded_params": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "unsharded_params": "#c44e52",
    "communication": "#8172b3",
    "buffers": "#da8bc3",
    "activations": "#937860",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "drawing a plan needs matplotlib, an optional dependency. Fix: pip install 'fully-shard[plot]' "
            "(or pip install matplotlib)."
        ) from None
    return plt


def draw(plan: Any, path: str, title: str = "") -> None:
    """Write a PNG: the live bytes of one rank at each point of the step (every collective and
    phase boundary), stacked by category (with ``CPUOffloadPolicy``, the host's bytes as a dotted
    line), and per collective the bytes it moves. ``plan``: a
    `Plan`, or a trace of a real run (``fully_shard.debug.trace(memory=True)``)."""
    if not isinstance(plan, Plan):
        plan = from_trace(plan)
    plt = _pyplot()
    fig, (mem, comm) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [3, 2]})
    _draw_memory(mem, plan, title)
    _draw_collectives(comm, plan)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _unit(nbytes: float) -> tuple[float, str]:
    """GiB for a big plan, MiB or KiB for a small one (a small model's peak is not "0.00 GiB")."""
    for size, name in ((GiB, "GiB"), (2**20, "MiB")):
        if nbytes >= size:
            return size, name
    return 1024, "KiB"


def _title(plan: Plan) -> str:
    """What the timeline holds: a trace of a real run may hold several forward/backward passes
    (micro-batches) and no optimizer step."""
    passes = sum(1 for s in plan.timeline if s.label == "forward end")
    what = "one training step" if passes <= 1 else f"{passes} forward/backward passes"
    if not any(s.label == "optimizer step" for s in plan.timeline):
        what += " (no optimizer step recorded)"
    return f"{what}, world {plan.world_size} (mesh {'x'.join(map(str, plan.mesh_shape))})"


def _draw_memory(mem: Any, plan: Plan, title: str) -> None:
    """The live bytes at each point of the step, stacked by category, with the peak (and the host's
    bytes, if any)."""
    xs = list(range(len(plan.timeline)))
    bottoms = [0.0] * len(xs)
    unit, name = _unit(max(plan.peak_bytes, plan.host_peak_bytes or 0))
    for cat in CATEGORIES:
        values = [s.by_category.get(cat, 0) / unit for s in plan.timeline]
        mem.bar(xs, values, bottom=bottoms, color=COLORS[cat], width=1.0, label=cat.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    mem.axhline(
        plan.peak_bytes / unit,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"peak {plan.peak_bytes / unit:.2f} {name}",
    )
    if any(s.host for s in plan.timeline):  # CPUOffloadPolicy: the host's bytes, beside the device's
        mem.plot(
            xs,
            [s.host / unit for s in plan.timeline],
            color="black",
            linestyle=":",
            linewidth=1.5,
            label=f"host (offloaded), peak {plan.host_peak_bytes / unit:.2f} {name}",
        )
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    ticks = [
        i for i, s in enumerate(plan.timeline) if not any(op in s.label for op in ops)
    ]  # phase boundaries
    mem.set_xticks(ticks, [plan.timeline[i].label for i in ticks], rotation=30, ha="right", fontsize=8)
    mem.set_ylabel(f"{name} live on one rank")
    mem.set_title(title or _title(plan))
    mem.legend(fontsize=8, loc="upper left", ncols=2)


def _draw_collectives(comm: Any, plan: Plan) -> None:
    """The bytes each collective of the step moves, in order."""
    colors = {"all_gather": "#4c72b0", "reduce_scatter": "#dd8452", "all_reduce": "#55a868"}
    unit, name = _unit(max((r.nbytes for r in plan.collectives), default=0))
    comm.bar(
        range(len(plan.collectives)),
        [r.nbytes / unit for r in plan.collectives],
        color=[colors.get(r.op, "gray") for r in plan.collectives],
    )
    comm.set_xticks(
        range(len(plan.collectives)),
        [f"{r.op.replace('_', '-')} {r.module}" for r in plan.collectives],
        rotation=90,
        fontsize=6,
    )
    comm.set_ylabel(f"{name} per collective")
    totals = ", ".join(
        f"{op.replace('_', '-')} {n / unit:.2f} {name}" for op, n in plan.bytes_per_step().items()
    )
    comm.set_title(f"collectives of the step ({totals})", fontsize=10)
