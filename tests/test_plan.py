"""Planning (issue #14, in part): ``fully_shard.plan.simulate`` runs our own runtime on the meta
device and a fake process group of any size in one process. Validated against real CPU/gloo runs
of the same model and settings, measured the same way (``fully_shard.plan.measure``): the
collectives (phase, module, op, dtype, bytes, group size) are equal, and the peak live tensor
bytes agree within 10%. A world of 1,024 runs in CI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import fresh_process
from rank_utils import cpu_mesh, world

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = dict(vocab_size=101, dim=48, n_layers=3, n_heads=4, hidden_dim=90, max_seq_len=32)
BATCH = (2, 16)  # one rank's batch


def _records(plan) -> list:
    return [(r.phase, r.module, r.op, str(r.dtype), r.nbytes, r.group_size) for r in plan.collectives]


def _tp_shard(model, mesh) -> None:
    """Tensor parallel blocks over mesh["tp"], then fully_shard over the other dims: mesh["dp"]
    (2-D parallelism) or mesh["rep", "shard"] (HSDP x TP on a 3-D mesh)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from fully_shard import fully_shard
    from train_tp_fsdp import BLOCK_PLAN

    dp = mesh["dp"] if mesh.ndim == 2 else mesh["rep", "shard"]
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], BLOCK_PLAN)
        layer.attention.n_heads //= mesh["tp"].size()
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)


def _names(shape: tuple[int, ...]) -> tuple[str, ...]:
    return ("dp", "tp") if len(shape) == 2 else ("rep", "shard", "tp")


def _simulated(mesh_shape: tuple[int, ...], steps: int = 2, tp: bool = False, offload: bool = False,
               cfg: dict = CFG, batch: tuple[int, int] = BATCH, backend: str = "nccl") -> dict:
    """``simulate`` in a fresh process (it needs one without a process group; `fresh_process`)."""
    extra = f", mesh_dim_names={_names(mesh_shape)!r}, shard_fn=test_plan._tp_shard" if tp else ""
    if offload:
        extra = ", shard_fn=test_plan._offload_shard"
    extra += f", backend={backend!r}"
    code = f"""
import json, sys, torch
sys.path.insert(0, {os.path.join(os.path.dirname(HERE), 'examples')!r})
sys.path.insert(0, {HERE!r})
from llama_model import Llama, LlamaConfig
from fully_shard.plan import simulate
import test_plan
plan = simulate(lambda: Llama(LlamaConfig(**{cfg!r})), torch.zeros({batch!r}, dtype=torch.long),
                mesh_shape={mesh_shape!r}, steps={steps}{extra})
print(json.dumps({{"peak": plan.peak_bytes, "params": plan.parameters, "world": plan.world_size,
    "collectives": [(r.phase, r.module, r.op, str(r.dtype), r.nbytes, r.group_size) for r in plan.collectives],
    "categories": plan.peak_snapshot.by_category, "fits": [plan.fits(plan.peak_bytes), plan.fits(plan.peak_bytes - 1)],
    "start": [plan.timeline[0].total, plan.timeline[0].host, plan.timeline[0].by_category],
    "combined": max(s.total + s.host for s in plan.timeline),
    "timeline": [(s.label, s.total, s.by_category["communication"]) for s in plan.timeline]}}))
"""
    out = fresh_process.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _offload_shard(model, mesh) -> None:
    from fully_shard import CPUOffloadPolicy
    from fully_shard.plan import default_shard_fn

    default_shard_fn(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))


def _measured(tp: tuple[int, ...] = (), offload: bool = False, cfg: dict = CFG, batch: tuple[int, int] = BATCH) -> dict:
    """The same model, settings and batch shape, really run on this rank (CPU/gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    from llama_model import Llama, LlamaConfig

    from fully_shard.plan import default_shard_fn, measure

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg))
    if tp:
        _tp_shard(model, init_device_mesh("cpu", tp, mesh_dim_names=_names(tp)))
    elif offload:
        _offload_shard(model, cpu_mesh())
    else:
        default_shard_fn(model, cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg["vocab_size"], batch)
    plan = measure(model, x, opt, steps=2)
    return {"peak": plan.peak_bytes, "collectives": [list(r) for r in _records(plan)], "rank": world()[0],
            "combined": max(s.total + s.host for s in plan.timeline)}


@pytest.mark.parametrize("world_size,tp", [(2, ()), (4, ()), (4, (2, 2)), (4, (2, 1, 2))])
def test_simulated_step_matches_a_real_run(ranks, world_size, tp):
    """1-D FSDP at 2 and 4 ranks, 2 dp x 2 tp, and HSDP x TP on a 3-D (2 rep, 1 shard, 2 tp) mesh
    (tensor-parallel blocks: FSDP's collectives and the TP layers' own, DTensor's, in one list)."""
    simulated = _simulated(tp or (world_size,), tp=bool(tp))
    real = ranks(world_size).run(_measured, tp)
    dtensor = [c for c in simulated["collectives"] if c[0].startswith("dtensor_")]
    if tp:
        # Per block: forward, the two row-wise outputs (attention.wo, feed_forward.w2) Partial ->
        # Replicate; backward, the five column-wise inputs' gradients (wq, wk, wv, w1, w3). Each is
        # an all-reduce of one rank's activations (tokens x dim, fp32) over the tp group.
        act = BATCH[0] * BATCH[1] * CFG["dim"] * 4
        layers = CFG["n_layers"]
        assert [(c[0], c[2], c[4], c[5]) for c in dtensor] == (
            [("dtensor_forward", "all_reduce", act, 2)] * (2 * layers) + [("dtensor_backward", "all_reduce", act, 2)] * (5 * layers)
        ), dtensor
        assert [c[1] for c in dtensor if c[0] == "dtensor_forward"] == [
            f"layers.{i}.{m}" for i in range(layers) for m in ("attention", "feed_forward")
        ]
    else:
        assert dtensor == []
    for r in real:
        assert r["collectives"] == simulated["collectives"], (r["collectives"], simulated["collectives"])
        error = abs(simulated["peak"] - r["peak"]) / r["peak"]
        print(f"world {world_size} rank {r['rank']}: peak simulated {simulated['peak']} real {r['peak']} ({error:.2%})")
        assert error <= 0.10, (simulated["peak"], r["peak"])


def test_gloo_staging_copies_are_counted_at_each_collective():
    """``backend="gloo"``: at each collective the plan adds what gloo allocates while it runs (a
    flat copy of an all-gather's output, a clone of a reduce-scatter's input), as communication;
    the rest of the step is counted as for NCCL (nothing staged), so the peak is the larger of the
    two (here the activations' peak stays higher). ``benchmarks/plan_vs_alloc.py`` checks the sum against the allocator."""
    nccl, gloo = _simulated((2,)), _simulated((2,), backend="gloo")
    assert nccl["collectives"] == gloo["collectives"]
    sizes = iter(c[4] for c in gloo["collectives"])  # the reported step's, in issue order
    staged_totals = []
    for (label, total, comm), (label_n, total_n, comm_n) in zip(gloo["timeline"], nccl["timeline"]):
        assert label == label_n
        op = label.split()[1] if len(label.split()) == 3 else ""
        staged = next(sizes) if op in ("all_gather", "reduce_scatter") else 0
        assert (total - total_n, comm - comm_n) == (staged, staged), label
        staged_totals.append(total)
    assert next(sizes, None) is None
    assert gloo["peak"] == max(nccl["peak"], *staged_totals)


def test_an_unknown_backend_is_refused_before_any_work():
    from fully_shard.plan import simulate

    with pytest.raises(ValueError, match=r"unknown collective backend 'mpi'.*Fix: pass backend='nccl'"):
        simulate(lambda: torch.nn.Linear(2, 2), torch.zeros(1, 2), mesh_shape=(2,), backend="mpi")


def test_simulated_attention_at_a_long_sequence_matches_a_real_run(ranks):
    """A 512-token sequence, where attention's ``S x S`` probabilities (4 MiB a block) would be most
    of the step if kept: the CPU runs a fused kernel that keeps none, and so does the simulation
    (plan/attention.py); the meta device's own math path would overestimate the peak several times."""
    cfg, batch = dict(CFG, max_seq_len=512), (1, 512)
    simulated = _simulated((2,), cfg=cfg, batch=batch)
    for r in ranks(2).run(_measured, (), False, cfg, batch):
        assert r["collectives"] == simulated["collectives"]
        error = abs(simulated["peak"] - r["peak"]) / r["peak"]
        print(f"S=512 rank {r['rank']}: peak simulated {simulated['peak']} real {r['peak']} ({error:.2%})")
        assert error <= 0.10, (simulated["peak"], r["peak"])


def test_simulated_offload_matches_a_real_run(ranks):
    """CPUOffloadPolicy at world 2: the same collectives as a real CPU/gloo run; on the host, exactly
    the shards and AdamW's two states at the step's start (on the device only the module buffers);
    device + host within 10% of the real run's (on a CPU the host is the device, so only the sum
    compares)."""
    plain, simulated = _simulated((2,)), _simulated((2,), offload=True)
    device, host, categories = simulated["start"]
    shards = plain["start"][2]["sharded_params"]
    assert host == 3 * shards and device == categories["buffers"] == plain["start"][2]["buffers"]
    assert simulated["peak"] < plain["peak"]
    for r in ranks(2).run(_measured, (), True):
        assert r["collectives"] == simulated["collectives"], (r["collectives"], simulated["collectives"])
        error = abs(simulated["combined"] - r["combined"]) / r["combined"]
        print(f"offload rank {r['rank']}: device + host simulated {simulated['combined']} real {r['combined']} ({error:.2%})")
        assert error <= 0.10


def test_simulation_scales_to_a_thousand_ranks():
    """World 1,024 on the small model: the schedule of unbucketed blocks (at 1,024 ranks each
    block's padded parameters exceed the default bucket budget; at world 2 they share buckets), and
    every collective exactly as large as 1,024 ranks' padded shards make it."""
    from llama_model import Llama, LlamaConfig

    w = 1024
    big, small = _simulated((w,)), _simulated((2,))
    assert big["world"] == w and big["fits"] == [True, False]
    assert [tuple(c[:3]) for c in big["collectives"]] == [
        ("forward", "<root>", "all_gather"), ("forward", "layers.0", "all_gather"), ("forward", "layers.1", "all_gather"),
        ("forward", "layers.2", "all_gather"), ("backward_prefetch", "layers.2", "all_gather"),
        ("backward_prefetch", "layers.1", "all_gather"), ("backward", "layers.2", "reduce_scatter"),
        ("backward_prefetch", "layers.0", "all_gather"), ("backward", "layers.1", "reduce_scatter"),
        ("backward", "layers.0", "reduce_scatter"), ("end_of_backward", "<root>", "reduce_scatter"),
    ]
    model = Llama(LlamaConfig(**CFG))
    groups = {"<root>": [p for n, p in model.named_parameters() if not n.startswith("layers.")]}
    groups.update({f"layers.{i}": list(layer.parameters()) for i, layer in enumerate(model.layers)})
    shard = {name: sum(-(-p.shape[0] // w) * (p.numel() // p.shape[0]) for p in ps) for name, ps in groups.items()}
    for phase, module, op, dtype, nbytes, group_size in big["collectives"]:
        assert group_size == w and dtype == "torch.float32", (module, op)
        # All-gather: every rank's padded shards. Reduce-scatter: the same, plus one used-count per parameter.
        expected = w * 4 * (shard[module] + (len(groups[module]) if op == "reduce_scatter" else 0))
        assert nbytes == expected, (phase, module, op, nbytes, expected)
    assert sum(c[2] == "reduce_scatter" for c in big["collectives"]) == len(groups)
    assert big["categories"]["sharded_params"] < small["categories"]["sharded_params"]  # 1/1024 vs 1/2 of the model


def test_command_line_prints_one_row_per_mesh():
    out = subprocess.run(  # the real command line; the rest run in forked processes (`fresh_process`)
        [sys.executable, "-m", "fully_shard.plan", os.path.join(os.path.dirname(HERE), "examples", "plan_models.py") + ":llama_small",
         "--input-shape", "2x16", "--mesh", "2", "--mesh", "2x2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| ranks")]
    assert [r.split("|")[1:3] for r in rows] == [[" 2 ", " 2 "], [" 4 ", " 2x2 "]], out.stdout
    assert float(rows[1].split("|")[14]) > 0  # HSDP: an all-reduce per step
    assert float(rows[0].split("|")[15]) > 0  # the estimated step time
    assert "Time: h100-nvlink-ib400-fp32, compute at 50 TFLOP/s" in out.stdout
    # Tensor parallel through a shard_fn on a named (dp, tp) mesh: DTensor's collectives get a column.
    models = os.path.join(os.path.dirname(HERE), "examples", "plan_models.py")
    out = fresh_process.run(
        [sys.executable, "-m", "fully_shard.plan", models + ":llama_small", "--input-shape", "2x16", "--mesh", "2x2",
         "--mesh-dim-names", "dp,tp", "--shard-fn", models + ":tp_shard"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    head, row = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert head.split("|")[15].strip() == "DTensor (TP) GiB/step" and float(row.split("|")[15]) > 0, out.stdout
    bad = fresh_process.run([sys.executable, "-m", "fully_shard.plan", models + ":llama_small", "--input-shape", "2x16",
                          "--mesh", "2x2x2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "name them (--mesh-dim-names) and pass --shard-fn" in bad.stderr
    # --recommend: the usual settings at world 4 (FSDP: reshard True x {default bucket, 1 GiB, offload},
    # False x {device, offload}; fp32 and bf16), and the user's shard_fn as one more, ranked.
    out = fresh_process.run(
        [sys.executable, "-m", "fully_shard.plan", models + ":llama_small", "--input-shape", "2x16", "--mesh", "2x2",
         "--mesh-dim-names", "dp,tp", "--shard-fn", models + ":tp_shard", "--recommend", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    head, *options = out.stdout.strip().splitlines()
    assert head.startswith("world 4: 11 settings simulated on h100-nvlink-ib400-bf16, 11 fit in 1 GiB per rank"), head
    assert len(options) == 11 and sum("--shard-fn" in o and "tp_shard on 2x2" in o for o in options) == 1, out.stdout


def test_compute_rate_measured_on_this_machine():
    """``measure_flops`` times the model here and reports the rate the time model counts with: a
    one-rank plan of the same model and batch, priced at that rate, computes for the measured time."""
    from llama_model import Llama, LlamaConfig

    from fully_shard.plan import Plan, measure_flops

    x = torch.zeros(BATCH, dtype=torch.long)
    rate = measure_flops(lambda: Llama(LlamaConfig(**CFG)), x, device="cpu", repeats=2)
    model = Llama(LlamaConfig(**CFG))
    n = sum(p.numel() for p in model.parameters())
    assert (rate.parameters, rate.tokens, rate.device) == (n, BATCH[0] * BATCH[1], "cpu")
    assert rate.seconds > 0 and rate.flops == 6 * n * rate.tokens / rate.seconds
    assert rate.optimizer_seconds > 0 and rate.optimizer_elements_per_s == n / rate.optimizer_seconds
    from fully_shard.plan import PRESETS

    assert rate.memory_bytes_per_s > 0
    here = rate.on(PRESETS["h100-nvlink-ib400-fp32"])
    assert (here.flops, here.optimizer_elements_per_s, here.memory_bytes_per_s, here.intra) == (
        rate.flops, rate.optimizer_elements_per_s, rate.memory_bytes_per_s, PRESETS["h100-nvlink-ib400-fp32"].intra)
    plan = Plan((1,), 0, [], [], module_params={"": n}, tokens=rate.tokens)
    assert plan.estimate("h100-nvlink-ib400-fp32", flops=rate.flops).compute_s == pytest.approx(rate.seconds, rel=1e-12)
    with pytest.raises(ValueError, match="no tensor to count tokens"):
        measure_flops(lambda: Llama(LlamaConfig(**CFG)), {}, device="cpu")
    out = fresh_process.run(
        [sys.executable, "-m", "fully_shard.plan", os.path.join(os.path.dirname(HERE), "examples", "plan_models.py") + ":llama_small",
         "--input-shape", "2x16", "--mesh", "2", "--flops", "measure"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "measured on this machine (cpu): forward + backward" in out.stdout, out.stdout


def test_collective_and_step_time_model():
    """The alpha-beta prices and the overlap rule, on a hand-made plan: exact arithmetic."""
    from fully_shard.debug import CollectiveRecord
    from fully_shard.plan import Cluster, Link, Plan
    from fully_shard.plan.timing import collective_seconds

    # Copies free at first (memory_bytes_per_s infinite); priced at the end.
    cluster = Cluster(gpus_per_node=4, intra=Link(1e-6, 100e9), inter=Link(10e-6, 10e9), flops=1e12,
                      memory_bytes_per_s=float("inf"))
    assert collective_seconds("all_gather", 4 * 10**9, 4, cluster) == 3 * 1e-6 + 0.75 * 4 * 10**9 / 100e9  # intra
    assert collective_seconds("reduce_scatter", 8 * 10**9, 8, cluster, (0, 7)) == 7 * 10e-6 + 7 / 8 * 8 * 10**9 / 10e9  # inter
    # Two ranks on two nodes (HSDP's replicas, ranks 0 and 4): the inter-node link, however few they are.
    assert collective_seconds("all_reduce", 10**9, 2, cluster, (0, 4)) == 2 * (10e-6 + 0.5 * 10**9 / 10e9)
    assert collective_seconds("all_reduce", 10**9, 2, cluster) == 2 * (1e-6 + 0.5 * 10**9 / 100e9)
    assert collective_seconds("all_gather", 10**9, 1, cluster) == 0.0

    def rec(phase, module, op, nbytes):
        return CollectiveRecord(0, phase, module, op, torch.float32, nbytes, 4, "g")

    ag, rs = 4 * 10**8, 8 * 10**8  # 3 us + 3 ms; 3 us + 6 ms
    records = [rec("forward", "<root>", "all_gather", ag), rec("forward", "a", "all_gather", ag),
               rec("backward", "a", "all_gather", ag), rec("backward", "a", "reduce_scatter", rs),
               rec("end_of_backward", "<root>", "reduce_scatter", rs)]
    # 10^9 params in "a", 10^8 in the root, 1 token: forward 2 ms and 0.2 ms at 1 TFLOP/s.
    plan = Plan((4,), 0, [], records, module_params={"": 10**8, "a": 10**9}, tokens=1)
    t = plan.estimate(cluster)
    g, r = collective_seconds("all_gather", ag, 4, cluster), collective_seconds("reduce_scatter", rs, 4, cluster)
    forward = g + max(0.2e-3, g) + max(2e-3, 0.0)  # the root overlaps a's all-gather; a overlaps nothing
    backward = max(2 * 2.2e-3, r) + g + r  # the first all-gather and the last reduction exposed, the rest overlapped
    assert t.step_s == pytest.approx(forward + backward, rel=1e-12) and t.compute_s == pytest.approx(3 * 2.2e-3)
    assert t.communication_s == pytest.approx(3 * g + 2 * r)

    # Tensor parallel: DTensor's all-reduces block their unit's compute (forward: a's 2 ms grows by
    # one; backward: the pass's compute grows by two).
    tp = collective_seconds("all_reduce", 10**8, 4, cluster)
    plan.collectives = [*records[:2], rec("dtensor_forward", "a.attention", "all_reduce", 10**8), *records[2:4],
                        rec("dtensor_backward", "a.mlp", "all_reduce", 10**8), rec("dtensor_backward", "a", "all_reduce", 10**8),
                        records[4]]
    t = plan.estimate(cluster)
    forward = g + max(0.2e-3, g) + max(2e-3 + tp, 0.0)
    backward = max(2 * 2.2e-3 + 2 * tp, r) + g + r
    assert t.step_s == pytest.approx(forward + backward, rel=1e-12) and t.compute_s == pytest.approx(3 * 2.2e-3)
    assert t.communication_s == pytest.approx(3 * g + 2 * r + 3 * tp)

    # Offload and the optimizer: a's 10^8 offloaded bytes go to the device before each of its
    # all-gathers and back after its reduce-scatter (on the host link, with the collective); the
    # host steps 10^8 elements, the device 10^9, after backward.
    plan.collectives = records
    plan.module_offload_bytes, plan.offloaded_elements, plan.device_elements = {"a": 10**8}, 10**8, 10**9
    t = plan.estimate(cluster)
    copy = cluster.host.latency_s + 10**8 / cluster.host.bytes_per_s
    forward = g + max(0.2e-3, g + copy) + max(2e-3, 0.0)
    backward = max(2 * 2.2e-3, r + copy) + (g + copy) + r  # a's reduction (and its copy back) overlaps compute
    host, device = 10**8 / cluster.host_optimizer_elements_per_s, 10**9 / cluster.optimizer_elements_per_s
    assert t.step_s == pytest.approx(forward + backward + host + device, rel=1e-12)
    assert (t.host_optimizer_s, t.optimizer_s) == (host, device)
    assert t.communication_s == pytest.approx(3 * g + 2 * r + 3 * copy)

    # fully_shard's copies on the compute stream at 10^11 B/s: each all-gather's copy-out and each
    # reduce-scatter's copy-in move twice the collective's bytes; a forward copy-out precedes its
    # module's compute, backward's join backward's compute.
    cluster = dataclasses.replace(cluster, memory_bytes_per_s=1e11)
    plan.module_offload_bytes, plan.offloaded_elements, plan.device_elements = {}, 0, 0
    t = plan.estimate(cluster)
    cg, cr = 2 * ag / 1e11, 2 * rs / 1e11  # 8 ms, 16 ms
    forward = g + max(0.2e-3 + cg, g) + max(2e-3 + cg, 0.0)
    backward = max(2 * 2.2e-3 + cg + cr + cr, r) + g + r
    assert t.step_s == pytest.approx(forward + backward, rel=1e-12) and t.copy_s == pytest.approx(3 * cg + 2 * cr)
    assert t.exposed_s == pytest.approx(forward + backward - 3 * 2.2e-3 - t.copy_s)


def test_recommend_ranks_the_settings_that_fit():
    code = f"""
import json, sys, torch
sys.path.insert(0, {os.path.join(os.path.dirname(HERE), 'examples')!r})
from llama_model import Llama, LlamaConfig
from fully_shard.plan import Cluster, Link, recommend
cluster = Cluster(8, Link(5e-6, 300e9), Link(12e-6, 40e9), 100e12)
build, x = (lambda: Llama(LlamaConfig(**{CFG!r}))), torch.zeros({BATCH!r}, dtype=torch.long)
kw = dict(world_size=16, cluster=cluster, bucket_sizes=(None, 0))
probe = recommend(build, x, bytes_per_rank=2**40, **kw)
budget = sorted(o.plan.peak_bytes for o in probe)[len(probe) // 2]
options = recommend(build, x, bytes_per_rank=budget, **kw)
sys.path.insert(0, {HERE!r})
import test_plan
from fully_shard.plan import Candidate
few = dict(shard_sizes=[], param_dtypes=("fp32",), bucket_sizes=(None,), offload=(False,))
tp = Candidate("tp", (8, 2), test_plan._tp_shard, ("dp", "tp"))
more = recommend(build, x, world_size=16, cluster=cluster, bytes_per_rank=2**40, int8_all_gather=(True, False),
                 candidates=[tp], **few)
def row(o):
    ag = o.plan.bytes_per_step()
    return ["x".join(map(str, o.mesh_shape)), o.label or ("int8" if o.int8_all_gather else o.param_dtype),
            len(o.plan.collectives) - sum(r.phase.startswith("dtensor_") for r in o.plan.collectives), ag["all_gather"],
            ag.get("dtensor_all_reduce", 0), int(o.label == "tp" and str(o).startswith("mesh      8x2  tp (params fp32)")),
            str(o.reshard_after_forward)]
print(json.dumps({{"budget": budget, "options": [[list(o.mesh_shape), str(o.reshard_after_forward), o.param_dtype,
    o.plan.peak_bytes, o.time.step_s, o.fits, o.bucket_bytes, o.offload, o.plan.host_peak_bytes, len(o.plan.collectives)]
    for o in options], "extra": [row(o) for o in more]}}))
"""
    out = fresh_process.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    options, budget = result["options"], result["budget"]
    extra = result["extra"]
    # int8 all-gathers (opt-in): the same schedule, a quarter of the fp32 all-gather bytes and then
    # some (a float32 scale per row); the TP candidate on a (8 dp, 2 tp) mesh: its label, DTensor's
    # all-reduces priced, ranked with the rest.
    by = {(o[0], o[1], o[6]): o for o in extra}
    assert len(extra) == len(by) == 7  # each setting simulated once
    assert sorted(by) == sorted([("16", k, r) for k in ("int8", "fp32") for r in ("True", "False", "8")] + [("8x2", "tp", "None")])
    for r in ("True", "False", "8"):
        int8, fp32 = by[("16", "int8", r)], by[("16", "fp32", r)]
        assert int8[2] == fp32[2] and fp32[3] / 4 < int8[3] < fp32[3] / 2, (int8, fp32)
    tp = by[("8x2", "tp", "None")]
    assert tp[4] > 0 and tp[5] == 1, tp
    # FSDP over 16 (reshard True / False / 8) and HSDP 2x8 (True / False), each in fp32 and bf16,
    # each offloaded or not; reshard True on the device also with bucketing off (0).
    expected = []
    for mesh, reshards in (((16,), ("True", "False", "8")), ((2, 8), ("True", "False"))):
        for r in reshards:
            for d in ("fp32", "bf16"):
                expected += [(mesh, r, d, None, False), (mesh, r, d, None, True)] + ([(mesh, r, d, 0, False)] if r == "True" else [])
    key = {(tuple(o[0]), o[1], o[2], o[6], o[7]): o for o in options}
    assert sorted(key, key=str) == sorted(expected, key=str) and len(options) == len(expected)
    fitting = [o for o in options if o[5]]
    assert fitting and len(fitting) < len(options)
    assert all(o[3] <= budget for o in fitting) and all(o[3] > budget for o in options if not o[5])
    assert [o[4] for o in fitting] == sorted(o[4] for o in fitting)  # fastest first
    assert options[: len(fitting)] == fitting  # the ones that fit come first
    for (mesh, r, d, bucket, off), o in key.items():
        if off:  # shards, gradients and optimizer state on the host: less on the device, and a host peak
            on_device = key[(mesh, r, d, None, False)]
            assert o[8] > 0 and o[3] < on_device[3] and on_device[8] == 0, (mesh, r, d)
        if bucket == 0:  # bucketing off: one all-gather per block where the default shares them
            assert o[9] > key[(mesh, r, d, None, False)][9], (mesh, r, d)


def _measured_picture(path: str) -> dict:
    """A real run's measured plan drawn like a simulated one; and a user's own loop (two
    micro-batches, then the optimizer) traced with memory and drawn from the trace."""
    from llama_model import Llama, LlamaConfig

    from fully_shard.debug import trace
    from fully_shard.plan import default_shard_fn, draw, from_trace, measure

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG))
    shapes = [p.shape for p in model.parameters()]
    default_shard_fn(model, cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, CFG["vocab_size"], BATCH)
    plan = measure(model, x, opt)
    checks = {"measured timeline": len(plan.timeline) == len(plan.collectives) + 5}
    with trace(memory=True, optimizers=[opt]) as t:
        for _ in range(2):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    snapshots = t.memory.counter.timeline
    # This rank's padded shards (2 ranks: ceil(rows / 2) rows each); its gradients and AdamW's two
    # states are of its own rows only (rank 0: ceil(rows / 2), rank 1: the rest).
    shards = sum(-(-s[0] // 2) * (s.numel() // s[0]) * 4 for s in shapes)
    rank = world()[0]
    own = sum((-(-s[0] // 2) if rank == 0 else s[0] // 2) * (s.numel() // s[0]) * 4 for s in shapes)
    checks["a snapshot per collective"] = len(snapshots) == len(t.records) and t.step == 1
    checks["two steps"] = {r.step for r in t.records} == {0, 1}
    checks["shards"] = [s.by_category["sharded_params"] for s in snapshots] == [shards] * len(snapshots)
    # AdamW: two states of this rank's rows, and a 4-byte step count per parameter (on the CPU).
    n = len(shapes)
    checks["optimizer state"] = [s.by_category["optimizer_state"] for s in snapshots] == [2 * own + 4 * n] * len(snapshots)
    # The second micro-batch holds, at every point, the first's reduced gradients (each views its
    # reduce-scatter output: the padded rows and a 4-byte used-count per parameter) and, up to the
    # first reduce-scatter, what the first held there (unreduced gradients); after it, nothing of
    # its own: each reduction of the second is added into them and freed before the next
    # reduce-scatter is issued (until 2026-11-29 the bucket's reduced output was still alive at
    # the root's reduce-scatter).
    first = [s.by_category["gradients"] for s, r in zip(snapshots, t.records) if r.step == 0]
    second = [s.by_category["gradients"] for s, r in zip(snapshots, t.records) if r.step == 1]
    ops = [r.op for r in t.records if r.step == 0]
    rs = ops.index("reduce_scatter")
    expected = [shards + 4 * n + (a if i <= rs else 0) for i, a in enumerate(first)]
    checks["gradients"] = len(first) == len(second) and second == expected
    if world()[0] == 0:
        draw(plan, path)
        draw(t, path + ".trace.png")
        for p in (path, path + ".trace.png"):
            with open(p, "rb") as f:
                checks[p] = f.read(8) == b"\x89PNG\r\n\x1a\n"
    checks["from_trace"] = from_trace(t, step=1).collectives == [r for r in t.records if r.step == 1]
    return checks


def test_plans_are_drawn_from_simulated_and_real_runs(ranks, tmp_path):
    for checks in ranks(2).run(_measured_picture, str(tmp_path / "real.png")):
        assert all(checks.values()), [k for k, v in checks.items() if not v]
    out = fresh_process.run(
        [sys.executable, "-m", "fully_shard.plan", os.path.join(os.path.dirname(HERE), "examples", "plan_models.py") + ":llama_small",
         "--input-shape", "2x16", "--mesh", "4", "--png", str(tmp_path / "sim")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "sim-4.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_live_bytes_counts_resizes_and_wrapper_subclasses():
    """The counter itself, on plain CPU tensors: creation, frees, both resizes, and a wrapper
    subclass (TwoTensor, as all-gather extensions use) counted by the tensors it wraps."""
    from torch.testing._internal.two_tensor import TwoTensor

    from fully_shard.plan import LiveBytes

    counter = LiveBytes("cpu")
    outside = TwoTensor(torch.zeros(4), torch.zeros(4))  # made before counting starts
    host = torch.ones(8)  # 32 bytes, tracked as the host's below (on a CPU, host and device are one)
    with counter:
        a = torch.empty(100)  # 400 bytes
        assert counter.current == 400
        a.resize_(300)  # Tensor.resize_ grows the storage
        assert counter.current == 1200 and counter.peak == 1200
        a.untyped_storage().resize_(0)  # the engine's way to free an unsharded parameter
        assert counter.current == 0
        b = torch.empty(10, dtype=torch.float64)
        assert counter.current == 80
        del b
        assert counter.current == 0
        counter.track([outside])  # tracked by its two 16-byte inner tensors
        assert counter.current == 32
        doubled = outside * 2  # made inside: the op's two inner outputs
        assert counter.current == 64 and isinstance(doubled, TwoTensor)
        del doubled
        assert counter.current == 32
        counter.track([host], host=True)
        derived = host * 2  # from host storages only: the host's too
        assert (counter.current, counter.host_current) == (32, 32 + 32)
        sparse = torch.eye(2).to_sparse() * 3  # a sparse op beside host tensors: no storage to read
        assert sparse.is_sparse and counter.host_current == 64
        del derived
        assert counter.host_current == 32
    assert counter.peak == 1200 and counter.host_peak == 64


def test_a_memory_trace_without_a_root_says_so():
    from fully_shard.debug import trace
    from fully_shard.plan import from_trace

    with trace(memory=True) as t:
        torch.ones(3) * 2
    with pytest.raises(ValueError, match="no fully_shard root ran inside this trace"):
        from_trace(t)
    with trace() as t:
        pass
    with pytest.raises(ValueError, match="counted no memory"):
        from_trace(t)


def test_simulated_attention_is_fused_where_the_devices_fuse_it():
    """`FusedAttentionOnMeta` on meta tensors: the same output shape as SDPA for every call, no
    ``S x S`` tensor where a fused kernel would run (causal, float and bool masks, GQA), and SDPA
    itself (its math path or its error) where none would."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fully_shard.plan import LiveBytes
    from fully_shard.plan.attention import FusedAttentionOnMeta

    B, H, S, E = 1, 4, 256, 8

    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, device="meta", dtype=dtype, requires_grad=dtype.is_floating_point)

    def run(*args, **kwargs):
        counter = LiveBytes("meta")
        with FusedAttentionOnMeta(), counter:
            out = F.scaled_dot_product_attention(*args, **kwargs)
            out.sum().backward()
        return out.shape, counter.peak

    square = S * S * 4  # one head's fp32 scores
    q, k, v = t(B, H, S, E), t(B, H, S, E), t(B, H, S, E)
    fused = [
        ((q, k, v), {"is_causal": True}),
        ((q, k, v), {"attn_mask": t(B, 1, S, S, dtype=torch.bool)}),  # kept as one float mask, not per head
        ((q, t(B, 2, S, E), t(B, 2, S, E)), {"enable_gqa": True, "is_causal": True}),
        ((q, k, v), {"scale": 0.5, "dropout_p": 0.1}),
    ]
    for args, kwargs in fused:
        shape, peak = run(*args, **kwargs)
        assert shape == (B, H, S, E) and peak < 2 * square, (kwargs, peak)
    shape, peak = run(q, k, t(B, H, S, 12))  # value's head dim differs: no fused kernel takes it
    assert shape == (B, H, S, 12) and peak > H * square
    with sdpa_kernel([SDPBackend.MATH]):  # math only, as the user asked
        assert run(q, k, v, is_causal=True)[1] > H * square
    with pytest.raises(RuntimeError):  # SDPA's own error: causal and a mask together
        run(q, k, v, attn_mask=t(B, 1, S, S), is_causal=True)


def test_bad_builders_and_huge_meshes_get_clear_errors():
    """Issue #23: a builder that does not exist, or raises, and a mesh too large to simulate are named
    with the fix, before any allocation (not a raw traceback, nor a MemoryError)."""
    models = os.path.join(os.path.dirname(HERE), "examples", "plan_models.py")
    cases = {
        f"{models}:nope": "no function 'nope' in",
        "examples_nofile.py:x": "no file 'examples_nofile.py'",
        "no_module_xyz:x": "cannot import 'no_module_xyz'",
    }
    for builder, expected in cases.items():
        out = fresh_process.run([sys.executable, "-m", "fully_shard.plan", builder, "--input-shape", "2x16", "--mesh", "2"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and expected in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = fresh_process.run([sys.executable, "-m", "fully_shard.plan", f"{models}:llama_small", "--input-shape", "2x16",
                          "--mesh", "1000000000"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "1,000,000,000 ranks" in out.stderr and "Fix:" in out.stderr, out.stderr[-2000:]
    code = """
import torch
from fully_shard.plan import simulate
from fully_shard.plan.simulate import BuilderError
def build():
    raise KeyError("weights.bin")
try:
    simulate(build, torch.zeros(1, 2), mesh_shape=(2,))
except BuilderError as e:
    assert "build_model() raised KeyError" in str(e) and "Fix" in str(e) and isinstance(e.__cause__, KeyError), e
    print("refused")
"""
    out = fresh_process.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "refused", out.stderr[-2000:]


def test_what_a_newcomer_hit_with_the_planner(tmp_path):
    """Issue #25 item 6: a float model with the default token-id input is refused (the real run
    would fail); an nn.Sequential is sharded child by child and the summary names the groups; the
    loss can be named; a small plan is drawn in MiB with a title saying what the timeline holds."""
    models = tmp_path / "models.py"
    models.write_text(
        "import torch\n"
        "def wide():\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])\n"
        "def mean_loss(out):\n"
        "    return out.float().pow(2).mean()\n"
    )
    run = lambda *a: fresh_process.run([sys.executable, "-m", "fully_shard.plan", f"{models}:wide", "--mesh", "2", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    bad = run("--input-shape", "4x256")
    assert bad.returncode != 0 and "has no nn.Embedding, but the input is torch.int64" in bad.stderr, bad.stderr
    assert "Fix: --input-dtype float" in bad.stderr and "Traceback" not in bad.stderr
    ok = run("--input-shape", "4x256", "--input-dtype", "float", "--loss", f"{models}:mean_loss", "--png", str(tmp_path / "p"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "All-gather groups: 0+1+2." in ok.stdout, ok.stdout  # each child sharded (one bucket)
    assert ok.stdout.startswith("197,376 parameters;"), ok.stdout
    assert f"Loss: {models}:mean_loss." in ok.stdout
    from fully_shard.plan.draw import _title, _unit
    from fully_shard.plan import simulate

    plan = simulate(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.zeros(2, 8), mesh_shape=(2,))
    assert _unit(plan.peak_bytes) == (1024, "KiB") and _unit(3 * 2**30) == (2**30, "GiB")
    assert _title(plan) == "one training step, world 2 (mesh 2)"
    two = dataclasses.replace(plan, timeline=[s for s in plan.timeline if s.label != "optimizer step"] * 2)
    assert _title(two) == "2 forward/backward passes (no optimizer step recorded), world 2 (mesh 2)"
