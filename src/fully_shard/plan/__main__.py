"""python -m fully_shard.plan BUILDER --input-shape 1x2048 --mesh 8 --mesh 512 --mesh 64x8

Simulate one training step of a model (``BUILDER``: ``package.module:function`` or
``path/to/file.py:function``, a function taking no arguments that returns the model) at each
mesh (``N`` for FSDP over N ranks, ``RxS`` for HSDP: R replicas of S shards) and print, per mesh,
the peak live tensor memory of one rank, what it holds at its peak, and what the collectives move
per step. The input is one rank's batch: zeros of ``--input-shape`` and ``--input-dtype`` (values do
not matter: every tensor is on the meta device).

Each row also estimates the step time (`timing.estimate`) on ``--cluster`` (a preset; default the
H100 one in the parameter dtype), computing at the preset's rate or at ``--flops``: a number of
FLOP/s, or ``measure`` to time the model's forward and backward on this machine (`measure_flops`:
it builds the model for real here).

``--shard-fn module:function`` applies ``fully_shard`` your way (``function(model, mesh)``), and
with ``--mesh-dim-names dp,tp`` the meshes may have any dims (e.g. ``--mesh 64x8`` as dp x tp
with `examples/plan_models.py`'s ``tp_shard``); DTensor's collectives are then listed too.

Options: --steps N (default 2: the reported step has optimizer state) --param-dtype {fp32,bf16}
         (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) --optimizer {adamw,adam,sgd,none}
         --backend {nccl,gloo} (whose staging copies count: plan/staging.py)
         --cluster PRESET --flops {N,measure}
         --recommend GIB (rank the usual settings at each mesh's world size: plan.recommend)
         --png PREFIX (a picture per mesh; needs matplotlib: pip install 'fully-shard[plot]')
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from .simulate import BuilderError, GiB, Plan, simulate
from .staging import STAGED
from ..tools.memory import CATEGORIES
from .timing import PRESETS, StepTime

if TYPE_CHECKING:
    from .compute import ComputeRate

DTYPES = {"long": torch.long, "int": torch.int32, "float": torch.float32, "bf16": torch.bfloat16}


def load_builder(spec: str) -> Callable[[], Any]:
    """``module:function`` or ``file.py:function``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SystemExit(f"BUILDER must be module:function or path/to/file.py:function, got {spec!r}")
    if where.endswith(".py") and not os.path.isfile(where):
        raise SystemExit(f"BUILDER {spec!r}: no file {where!r} (from {os.getcwd()})")
    try:
        module = _import(where)
    except ImportError as e:
        raise SystemExit(f"BUILDER {spec!r}: cannot import {where!r}: {e}") from e
    found = getattr(module, name, None)
    if not callable(found):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SystemExit(
            f"BUILDER {spec!r}: no function {name!r} in {where!r}"
            + (f" (it has: {', '.join(public[:12])})" if public else "")
        )
    return found


def _import(where: str) -> Any:
    if not where.endswith(".py"):
        return importlib.import_module(where)
    sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
    module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def parse_mesh(text: str, ndim: int | None = None) -> tuple[int, ...]:
    """``N`` or ``RxS`` (or, with ``--mesh-dim-names``, one size per name)."""
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh takes N or RxS (e.g. 512 or 64x8), got {text!r}") from None
    if min(shape) < 1:
        raise SystemExit(f"--mesh takes positive sizes, got {text!r}")
    if ndim is not None and len(shape) != ndim:
        raise SystemExit(f"--mesh {text!r} has {len(shape)} dims, but --mesh-dim-names names {ndim}")
    if ndim is None and len(shape) not in (1, 2):
        raise SystemExit(
            f"--mesh takes N or RxS, got {text!r}; for more dims name them (--mesh-dim-names) and pass "
            "--shard-fn"
        )
    return shape


def _gib(nbytes: int) -> str:
    v = nbytes / GiB
    return f"{v:.2f}" if v >= 0.01 or v == 0 else f"{v:.1e}"


_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def table(plans: list[Plan], times: list[StepTime] | None = None) -> str:
    """One row per plan: peak per rank, what is live at the peak point, bytes per step (and the
    estimated step time, when ``times`` are given)."""
    tp = any(k.startswith("dtensor_") for plan in plans for k in plan.bytes_per_step())
    head = (
        "| ranks | mesh | peak GiB/rank | at the peak point | sharded params | gradients | optimizer | "
        "unsharded params | comm buffers | buffers | activations | all-gather GiB/step | reduce-scatter "
        "GiB/step | all-reduce GiB/step |"
    )
    if tp:
        head += " DTensor (TP) GiB/step |"
    if times is not None:
        head += " est. step ms | exposed comm ms |"
    rows = [head, "|" + "---|" * (14 + tp + (2 if times is not None else 0))]
    for i, plan in enumerate(plans):
        rows.append(_row(plan, times[i] if times is not None else None, tp))
    return "\n".join(rows)


def _row(plan: Plan, time: StepTime | None, tp: bool) -> str:
    """One plan's row of `table` (with a DTensor column if ``tp``, the step time if ``time``)."""
    cats = plan.peak_snapshot.by_category
    moved = plan.bytes_per_step()
    cells = [str(plan.world_size), "x".join(map(str, plan.mesh_shape))]
    cells += [_gib(plan.peak_bytes), _gib(plan.peak_snapshot.total)]
    cells += [_gib(cats[k]) for k in CATEGORIES]
    cells += [_gib(moved.get(op, 0)) for op in _OPS]
    if tp:
        cells.append(_gib(sum(n for k, n in moved.items() if k.startswith("dtensor_"))))
    if time is not None:
        cells += [f"{time.step_s * 1e3:.3g}", f"{time.exposed_s * 1e3:.3g}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    names, meshes, shape, flops = _checked(args)
    cluster = args.cluster or f"h100-nvlink-ib400-{args.param_dtype}"
    build = load_builder(args.builder)
    shard_fn = load_builder(args.shard_fn) if args.shard_fn else None
    inputs = torch.zeros(shape, dtype=DTYPES[args.input_dtype])
    _check_input_dtype(build, inputs, args.builder)
    if args.recommend is not None:
        recommend_table(args, build, inputs, meshes, names, shard_fn)
        return
    plans = _simulate_meshes(args, build, inputs, meshes, names, shard_fn)
    priced = PRESETS[cluster]
    if args.flops == "measure":
        rate = _measure(build, inputs, args.param_dtype)
        flops, priced = rate.flops, rate.on(priced)
    times = [plan.estimate(priced, flops=flops) for plan in plans]
    print(_summary(plans[0], shape, args, cluster, flops))
    print(table(plans, times))
    if args.png:
        from .draw import draw

        for plan in plans:
            path = f"{args.png}-{'x'.join(map(str, plan.mesh_shape))}.png"
            draw(plan, path)
            print(f"wrote {path}")


def _check_input_dtype(build: Callable[[], Any], inputs: torch.Tensor, name: str) -> None:
    """On the meta device a float layer takes an integer input without complaint, where the real
    run fails: refuse token ids for a model with no embedding to read them."""
    if inputs.is_floating_point():
        return
    with torch.device("meta"):
        model = build()
    if not any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) for m in model.modules()):
        raise SystemExit(
            f"{name} has no nn.Embedding, but the input is {inputs.dtype} (token ids, the default): the real "
            "run would fail where the simulation on the meta device does not. Fix: --input-dtype float (or "
            "bf16) for a model that takes features."
        )


def _parser() -> argparse.ArgumentParser:
    """The command line: what to simulate here, how to price and show it (`_add_report_options`)."""
    p = argparse.ArgumentParser(prog="python -m fully_shard.plan", description=__doc__.splitlines()[0])
    p.add_argument("builder")
    p.add_argument("--input-shape", required=True, help="one rank's batch, e.g. 1x2048")
    p.add_argument("--input-dtype", default="long", choices=sorted(DTYPES))
    p.add_argument("--mesh", action="append", required=True, help="N or RxS; repeat for several")
    p.add_argument(
        "--mesh-dim-names", default=None, help="names of the mesh dims, e.g. dp,tp (with --shard-fn)"
    )
    p.add_argument(
        "--shard-fn",
        default=None,
        help="module:function or file.py:function taking (model, mesh) and applying fully_shard (and TP)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--loss",
        default=None,
        help="module:function or file.py:function taking the model's output and returning the loss "
        "(default: output.sum())",
    )
    p.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"])
    p.add_argument(
        "--backend",
        default="nccl",
        choices=sorted(STAGED),
        help="whose staging copies count at each collective: nccl (none), gloo (CPU runs)",
    )
    _add_report_options(p)
    return p


def _add_report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster",
        default=None,
        choices=sorted(PRESETS),
        help="preset for the time estimate (default: h100-nvlink-ib400 in the parameter dtype)",
    )
    p.add_argument(
        "--flops", default=None, help="compute rate for the estimate: FLOP/s, or 'measure' (on this machine)"
    )
    p.add_argument(
        "--recommend",
        type=float,
        default=None,
        metavar="GIB",
        help="rank the usual settings (plan.recommend) at each --mesh's world size by what fits in GIB per "
        "rank and estimated step time; with --shard-fn, yours is ranked too",
    )
    p.add_argument(
        "--png",
        default=None,
        help="write PREFIX-<mesh>.png per mesh: memory timeline and collectives (matplotlib)",
    )


def _checked(
    args: argparse.Namespace,
) -> tuple[tuple[str, ...] | None, list[tuple[int, ...]], tuple[int, ...], float | None]:
    """Every option checked before any simulation runs; returns the mesh dim names, the meshes,
    the input shape and the ``--flops`` rate (None: the preset's, or measured)."""
    if args.shard_fn and args.param_dtype != "fp32":
        raise SystemExit(
            "--param-dtype sets the default shard_fn's MixedPrecisionPolicy; with --shard-fn, pass mp_policy "
            "to fully_shard in your function"
        )
    names = tuple(args.mesh_dim_names.split(",")) if args.mesh_dim_names else None
    if names is not None and args.shard_fn is None:
        raise SystemExit("--mesh-dim-names needs --shard-fn (a function (model, mesh) that uses the names)")
    meshes = [parse_mesh(m, len(names) if names else None) for m in args.mesh]
    try:
        shape = tuple(int(n) for n in args.input_shape.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"--input-shape takes sizes joined by x (e.g. 1x2048), got {args.input_shape!r}"
        ) from None
    if args.recommend is not None and (
        args.recommend <= 0 or args.flops is not None or args.png or args.param_dtype != "fp32"
    ):
        raise SystemExit(
            "--recommend GIB takes a positive budget, prices each setting on --cluster (it tries both "
            "parameter dtypes), and draws nothing: leave out --flops, --png and --param-dtype"
        )
    return names, meshes, shape, _parse_flops(args.flops)


def _parse_flops(text: str | None) -> float | None:
    """``--flops`` as FLOP/s; None when not given or 'measure'."""
    if text is None or text == "measure":
        return None
    try:
        flops = float(text)
    except ValueError:
        raise SystemExit(f"--flops takes FLOP/s (e.g. 4e14) or 'measure', got {text!r}") from None
    if flops <= 0:
        raise SystemExit(f"--flops must be positive, got {text!r}")
    return flops


def _simulate_meshes(
    args: argparse.Namespace,
    build: Callable[[], Any],
    inputs: torch.Tensor,
    meshes: list[tuple[int, ...]],
    names: tuple[str, ...] | None,
    shard_fn: Callable[..., Any] | None,
) -> list[Plan]:
    """One plan per mesh, in the parameter dtype, with the optimizer and steps of ``args``."""
    mp = None
    if args.param_dtype == "bf16":
        from ..layouts.policy import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return [
        simulate(
            build,
            inputs,
            mesh_shape=m,
            mesh_dim_names=names,
            shard_fn=shard_fn,
            mp_policy=mp,
            steps=args.steps,
            optimizer=None if args.optimizer == "none" else args.optimizer,
            backend=args.backend,
            loss_fn=load_builder(args.loss) if args.loss else None,
        )
        for m in meshes
    ]


def _measure(build: Callable[[], Any], inputs: torch.Tensor, param_dtype: str) -> ComputeRate:
    """``--flops measure``: the model's rates on this machine (`measure_flops`), printed."""
    from .compute import measure_flops

    rate = measure_flops(build, inputs, dtype=torch.bfloat16 if param_dtype == "bf16" else None)
    print(
        f"measured on this machine ({rate.device}): forward + backward {rate.seconds * 1e3:.1f} ms = "
        f"{rate.flops / 1e12:.3f} TFLOP/s; AdamW step {rate.optimizer_seconds * 1e3:.1f} ms = "
        f"{rate.optimizer_elements_per_s:.3g} elements/s; copies {rate.memory_bytes_per_s / 1e9:.1f} GB/s"
    )
    return rate


def _summary(
    plan: Plan, shape: tuple[int, ...], args: argparse.Namespace, cluster: str, flops: float | None
) -> str:
    """The paragraph above the table: the model, the batch, the settings, how bytes and time are
    counted."""
    rate_text = (
        f"{flops / 1e12:.3f} TFLOP/s" if flops is not None else f"{PRESETS[cluster].flops / 1e12:.0f} TFLOP/s"
    )
    return (
        f"{_count(plan.parameters)} parameters; one rank's batch {tuple(shape)}; params "
        f"{args.param_dtype}; optimizer {args.optimizer}; live tensor bytes of rank 0, last of {args.steps} "
        "steps. 'peak' is the op-level peak; the categories split the timeline point with the most bytes "
        f"('at the peak point'); the difference is one op's temporaries. Time: {cluster}, compute at "
        f"{rate_text}. Loss: {args.loss or 'output.sum()'}. {_groups(plan)}\n"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def _groups(plan: Plan) -> str:
    """Which modules communicate as groups (what the shard function sharded), in order."""
    seen: list[str] = []
    for r in plan.collectives:
        if r.op == "all_gather" and r.module not in seen:
            seen.append(r.module)
    shown = ", ".join(seen[:6]) + (f", ... ({len(seen)} in all)" if len(seen) > 6 else "")
    return f"All-gather groups: {shown}." if seen else "No all-gather (nothing sharded)."


def recommend_table(
    args: argparse.Namespace,
    build: Callable[[], Any],
    inputs: torch.Tensor,
    meshes: list[tuple[int, ...]],
    names: tuple[str, ...] | None,
    shard_fn: Callable[..., Any] | None,
) -> None:
    """``--recommend GIB``: `recommend`'s ranking at each mesh's world size (your shard_fn on that mesh
    as a `Candidate`), the settings that fit first, fastest first."""
    from .recommend import Candidate, recommend

    cluster = args.cluster or "h100-nvlink-ib400-bf16"
    for mesh in meshes:
        world = math.prod(mesh)
        mine = (
            [Candidate(f"--shard-fn {args.shard_fn} on {'x'.join(map(str, mesh))}", mesh, shard_fn, names)]
            if shard_fn
            else []
        )
        options = recommend(
            build,
            inputs,
            world_size=world,
            bytes_per_rank=int(args.recommend * GiB),
            cluster=cluster,
            candidates=mine,
            steps=args.steps,
            optimizer=None if args.optimizer == "none" else args.optimizer,
        )
        fit = sum(o.fits for o in options)
        print(
            f"world {world}: {len(options)} settings simulated on {cluster}, {fit} fit in {args.recommend:g} "
            "GiB per rank (fitting ones first, fastest first):"
        )
        for o in options:
            print(f"  {o}")


if __name__ == "__main__":
    try:
        main()
    except (BuilderError, ValueError) as e:  # the user's input: the message says what to fix
        raise SystemExit(f"fully_shard.plan: {e}") from None
