"""Planning (issue #14, in part): ``fully_shard.plan.simulate`` runs our own runtime on the meta
device and a fake process group of any size in one process. Validated against real CPU/gloo runs
of the same model and settings, measured the same way (``fully_shard.plan.measure``): the
collectives (phase, module, op, dtype, bytes, group size) are equal, and the peak live tensor
bytes agree within 10%. A world of 1,024 runs in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rank_utils import cpu_mesh, world

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = dict(vocab_size=101, dim=48, n_layers=3, n_heads=4, hidden_dim=90, max_seq_len=32)
BATCH = (2, 16)  # one rank's batch


def _records(plan) -> list:
    return [(r.phase, r.module, r.op, str(r.dtype), r.nbytes, r.group_size) for r in plan.collectives]


def _simulated(mesh_shape: tuple[int, ...], steps: int = 2) -> dict:
    """``simulate`` in a fresh process (it needs one without a process group)."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {os.path.join(os.path.dirname(HERE), 'examples')!r})
from llama_model import Llama, LlamaConfig
from fully_shard.plan import simulate
plan = simulate(lambda: Llama(LlamaConfig(**{CFG!r})), torch.zeros({BATCH!r}, dtype=torch.long),
                mesh_shape={mesh_shape!r}, steps={steps})
print(json.dumps({{"peak": plan.peak_bytes, "params": plan.parameters, "world": plan.world_size,
    "collectives": [(r.phase, r.module, r.op, str(r.dtype), r.nbytes, r.group_size) for r in plan.collectives],
    "categories": plan.peak_snapshot.by_category, "fits": [plan.fits(plan.peak_bytes), plan.fits(plan.peak_bytes - 1)]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measured() -> dict:
    """The same model, settings and batch shape, really run on this rank (CPU/gloo)."""
    from llama_model import Llama, LlamaConfig

    from fully_shard.plan import default_shard_fn, measure

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG))
    default_shard_fn(model, cpu_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, CFG["vocab_size"], BATCH)
    plan = measure(model, x, opt, steps=2)
    return {"peak": plan.peak_bytes, "collectives": [list(r) for r in _records(plan)], "rank": world()[0]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_simulated_step_matches_a_real_run(ranks, world_size):
    simulated = _simulated((world_size,))
    real = ranks(world_size).run(_measured)
    for r in real:
        assert r["collectives"] == simulated["collectives"], (r["collectives"], simulated["collectives"])
        error = abs(simulated["peak"] - r["peak"]) / r["peak"]
        print(f"world {world_size} rank {r['rank']}: peak simulated {simulated['peak']} real {r['peak']} ({error:.2%})")
        assert error <= 0.10, (simulated["peak"], r["peak"])


def test_simulation_scales_to_a_thousand_ranks():
    """World 1,024 on the small model: the schedule of unbucketed blocks (at 1,024 ranks each
    block's padded parameters exceed the 1 MiB bucket budget; at world 2 they share buckets), and
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
    out = subprocess.run(
        [sys.executable, "-m", "fully_shard.plan", os.path.join(os.path.dirname(HERE), "examples", "plan_models.py") + ":llama_small",
         "--input-shape", "2x16", "--mesh", "2", "--mesh", "2x2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| ranks")]
    assert [r.split("|")[1:3] for r in rows] == [[" 2 ", " 2 "], [" 4 ", " 2x2 "]], out.stdout
    assert float(rows[1].split("|")[-2]) > 0  # HSDP: an all-reduce per step
