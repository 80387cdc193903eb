"""torchrun --nproc-per-node 2 benchmarks/plan_vs_alloc.py --model wide [--param-dtype bf16] [--hsdp]

How far the planner's peak (``fully_shard.plan.simulate``: our runtime on the meta device and a
fake process group) is from the peak counted at the allocator (``benchmarks/alloc``) in a real
CPU/gloo run of the same model, settings and batch: ``bench_step.py``'s models, each block and the
root sharded with ``fully_shard`` at its defaults, AdamW. The real peak is the most bytes alive
during a step, above what was alive before the model was built, max over ranks, median [min-max]
over ``--repeats`` fresh builds x 3 steps (after 2 warm-up steps). The plan runs in a subprocess
(it needs a process without a process group) with ``backend="gloo"`` (gloo's staging copies).

Prints one markdown row (rank 0); ``--json FILE`` appends the numbers to FILE (one JSON per line).
Options: --model {llama,wide,deep-narrow} --param-dtype {fp32,bf16} --hsdp --dim D --layers L
         --batch B --seq-len S --repeats R --backend {gloo,nccl}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_step  # noqa: E402  (installs the counting allocator before any model exists)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

MiB = 2**20


def shard(model, blocks, mesh, args: argparse.Namespace) -> None:
    """Each block, then the root: ``fully_shard`` at its defaults, as bench_step shards ours."""
    from fully_shard import MixedPrecisionPolicy, fully_shard

    dtype = bench_step.PARAM_DTYPES[args.param_dtype]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def batch(args: argparse.Namespace, rank: int, world: int) -> tuple:
    """One rank's inputs and targets of step 0, as bench_step's ``Impl.step`` makes them."""
    if args.model == "llama":
        x, y = bench_step.synthetic_batch(0, args.batch, args.seq_len, 1024)
        return x.chunk(world)[rank], y.chunk(world)[rank]
    gen = torch.Generator().manual_seed(0)
    return torch.randn(args.batch, args.dim, generator=gen).chunk(world)[rank], None


def planned(args: argparse.Namespace, world: int) -> int:
    """The planner's peak for rank 0 (run here, in a process without a process group)."""
    from fully_shard.plan import simulate

    blocks: list = []

    def build():
        model, found = bench_step.make_model(args.model, args)
        blocks[:] = found
        return model

    mesh_shape = (2, world // 2) if args.hsdp else (world,)
    x, y = batch(args, 0, world)
    y = y.to("meta") if y is not None else None

    def loss(out):
        return bench_step.loss_fn(out, y) if y is not None else out.pow(2).mean()

    plan = simulate(build, x, mesh_shape=mesh_shape, shard_fn=lambda m, mesh: shard(m, blocks, mesh, args),
                    loss_fn=loss, backend=args.backend)
    return plan.peak_bytes


def measured(args: argparse.Namespace) -> list[int]:
    """Every measured step's allocator peak on this rank, ``args.repeats`` fresh builds x 3 steps."""
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if args.hsdp else init_device_mesh("cpu", (world,)))
    peaks: list[int] = []
    for _ in range(args.repeats):
        bench_step.gc.collect()
        before = bench_step.COUNTER.live()
        model, blocks = bench_step.make_model(args.model, args)
        shard(model, blocks, mesh, args)
        impl = bench_step.Impl("ours", model, args.model)
        impl.step(0, args)
        impl.step(1, args)
        peaks += bench_step.step_peaks(impl, args, before)
        del impl, model, blocks
    return peaks


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["llama", "wide", "deep-narrow"], default="wide")
    p.add_argument("--param-dtype", choices=sorted(bench_step.PARAM_DTYPES), default="fp32")
    p.add_argument("--hsdp", action="store_true")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="whose staging copies the plan counts (the real run is gloo)")
    p.add_argument("--json", default=None)
    p.add_argument("--plan-only", type=int, default=0, help=argparse.SUPPRESS)  # the subprocess
    args = p.parse_args()
    dim, layers = {"llama": (128, 4), "wide": (4096, 4), "deep-narrow": (64, 64)}[args.model]
    args.dim = args.dim if args.dim is not None else dim
    args.layers = args.layers if args.layers is not None else layers
    return args


def main() -> None:
    args = parse()
    if args.plan_only:
        print(json.dumps({"peak": planned(args, args.plan_only)}))
        return
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    rank = dist.get_rank()
    plan_peak = None
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                "MASTER_ADDR", "MASTER_PORT")}
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--plan-only", str(world)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        plan_peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    dist.barrier()
    mine = measured(args)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        worst = [max(v) for v in zip(*gathered)]
        med = statistics.median(worst)
        err = plan_peak / med - 1
        name = f"{args.model} dim {args.dim} x {args.layers}{' HSDP' if args.hsdp else ''} {args.param_dtype}"
        print(f"| {name} | {world} | {plan_peak / MiB:.2f} | {med / MiB:.2f} [{min(worst) / MiB:.2f}-"
              f"{max(worst) / MiB:.2f}] | {err * 100:+.1f}% |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"model": name, "world": world, "plan": plan_peak, "real": worst}) + "\n")
    bench_step.shutdown()


if __name__ == "__main__":
    main()
