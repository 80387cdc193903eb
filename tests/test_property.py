"""Property-based: generated models, shapes and options, each trained for two steps.

For every example (a chain of blocks with generated widths, dim 0 smaller than the world, frozen
weights, a non-contiguous weight, a size-0 parameter, 2-D weights sharded on dim 1; layouts
nested / list / root-only;
``reshard_after_forward`` on or off; buckets on or off; world 1 or 2) the result is either equal
to the single-process reference (float64 on both sides, within `TOL64`), or ``fully_shard``
raised a clear error (ValueError / TypeError) and left the model untouched. Never a crash, a hang
or a half-sharded model.

CI runs a bounded, derandomized number of examples at world 1 and 2 (seconds). A longer run, also
at world 4: ``FULLY_SHARD_PROPERTY_EXAMPLES=600 FULLY_SHARD_PROPERTY_WORLDS=1,2,4 python -m pytest
tests/test_property.py`` (600 examples pass in about a minute on the CI machine type).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from _parity import TOL64  # noqa: E402
from rank_utils import global_mean, max_param_diff, world  # noqa: E402

EXAMPLES = int(os.environ.get("FULLY_SHARD_PROPERTY_EXAMPLES", "12"))
WORLDS = [int(w) for w in os.environ.get("FULLY_SHARD_PROPERTY_WORLDS", "1,2").split(",")]


class Chain(nn.Module):
    def __init__(self, dims: list[int], empty: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], 2)
        self.empty = nn.Parameter(torch.zeros(0, dims[-1])) if empty else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.empty is not None:
            x = x + self.empty.sum(0)
        return self.head(x)


def _build(cfg: dict) -> Chain:
    torch.manual_seed(cfg["seed"])
    model = Chain(cfg["dims"], cfg["empty"]).double()
    for block, frozen in zip(model.blocks, cfg["frozen"]):
        block[0].weight.requires_grad_(not frozen)
    if cfg["noncontig"]:
        lin = model.blocks[0][0]
        lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t(), requires_grad=lin.weight.requires_grad)
    return model


def _untouched(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    from fully_shard import FSDPModule

    return not any(isinstance(m, FSDPModule) for m in model.modules()) and not any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def _run(cfg: dict) -> dict:
    from fully_shard import fully_shard

    from torch.distributed.tensor import Shard

    rank, w = world()
    model = _build(cfg)
    ref = copy.deepcopy(model)
    placement = (lambda p: Shard(1) if p.ndim == 2 else None) if cfg["shard_dim1"] else None
    try:
        if cfg["layout"] == "nested":
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=cfg["reshard"], shard_placement_fn=placement)
        elif cfg["layout"] == "list":
            fully_shard(list(model.blocks), reshard_after_forward=cfg["reshard"], shard_placement_fn=placement)
        fully_shard(model, shard_placement_fn=placement)
    except (ValueError, TypeError) as e:
        return {"error": str(e), "untouched": _untouched(model)}
    if not cfg["bucket"]:
        model.set_bucket_bytes(0)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
            for m in (model, ref)]
    loss_diff = 0.0
    for step in range(2):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4, cfg["dims"][0], generator=gen, dtype=torch.float64)
        y = torch.randn(4, 2, generator=gen, dtype=torch.float64)
        loss = ((model(x.chunk(w)[rank]) - y.chunk(w)[rank]) ** 2).mean()
        loss.backward()
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss_diff = max(loss_diff, abs(global_mean(loss) - ref_loss.item()))
    return {"error": "", "loss_diff": loss_diff, "param_diff": max_param_diff(model, ref)}


configs = st.fixed_dictionaries(
    {
        "dims": st.lists(st.integers(1, 9), min_size=2, max_size=4),
        "frozen": st.lists(st.booleans(), min_size=3, max_size=3),
        "noncontig": st.booleans(),
        "empty": st.booleans(),
        "layout": st.sampled_from(["nested", "list", "root_only"]),
        "reshard": st.booleans(),
        "bucket": st.booleans(),
        "shard_dim1": st.booleans(),
        "world": st.sampled_from(WORLDS),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.fixture(scope="module")
def pools(ranks):
    return ranks


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 12,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cfg=configs)
def test_generated_models_train_like_the_reference_or_fail_cleanly(pools, cfg):
    for r in pools(cfg["world"]).run(_run, cfg):
        if r["error"]:
            assert r["untouched"], (cfg, r)
            assert "Fix" in r["error"] or "fix" in r["error"], (cfg, r)  # an error names the fix
        else:
            assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, (cfg, r)
