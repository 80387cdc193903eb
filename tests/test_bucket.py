"""Buckets (bucket.py): consecutive small groups share one all-gather and one reduce-scatter.

Asserted with the collective trace (exact schedules), against the float64 single-process
reference, and bit for bit against the unbucketed run and PyTorch's ``fully_shard`` where every
sum has at most two terms (world <= 2: one possible value, whatever the buffer layout).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from _parity import STEPS, TOL64, _mlp_loss, _train_pair, check, max_abs_diff
from rank_utils import cpu_mesh, max_param_diff, world

BLOCKS = 8
DIM = 5  # divides by neither 2 nor 4: every rank count pads


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class DeepNarrow(nn.Sequential):
    """8 tiny blocks and a head; ``skip`` names a block the forward leaves out (on every rank)."""

    skip: int = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self):
            if i != self.skip:
                x = block(x)
        return x


def deep_narrow() -> DeepNarrow:
    torch.manual_seed(0)
    return DeepNarrow(*[Residual() for _ in range(BLOCKS)], nn.Linear(DIM, 3)).double()


def shard(model: nn.Module, shard_fn) -> None:
    for block in list(model)[:BLOCKS]:
        shard_fn(block, mesh=cpu_mesh())
    shard_fn(model, mesh=cpu_mesh())  # the root's group: the head


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=gen, dtype=torch.float64), torch.randn(
        8, 3, generator=gen, dtype=torch.float64
    )


def _train(model: nn.Module, steps: int = STEPS) -> None:
    rank, w = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()


def _records(trace, step: int) -> list[tuple[str, str, str]]:
    return [(r.phase, r.op, r.module) for r in trace.select(step=step)]


def _unsharded_bytes(model: nn.Module) -> int:
    return sum(
        p.padded_unsharded.untyped_storage().nbytes()
        for m in model.modules()
        if "_fsdp_state" in m.__dict__ and m.__dict__["_fsdp_state"].group is not None
        for p in m.__dict__["_fsdp_state"].group.params
    )


BUCKET = "+".join(str(i) for i in range(BLOCKS))
BUCKET_BACKWARD = "+".join(str(i) for i in reversed(range(BLOCKS)))


def _default_bucketing() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import debug, fully_shard

    model = deep_narrow()
    ref, unbucketed, theirs = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    shard(model, fully_shard)
    shard(unbucketed, fully_shard)
    unbucketed.set_bucket_bytes(0)
    shard(theirs, torch_fully_shard)
    with debug.trace() as t:
        out = _train_pair(model, ref, batch, _mlp_loss, STEPS)
    _train(unbucketed)
    _train(theirs)
    out["records"] = _records(t, 1)
    out["vs_unbucketed"] = max_abs_diff(model, unbucketed)
    out["vs_torch"] = max_abs_diff(model, theirs)
    out["unsharded_after"] = _unsharded_bytes(model)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_small_blocks_share_one_all_gather_and_one_reduce_scatter(ranks, world_size):
    results = ranks(world_size).run(_default_bucketing)
    check(results, "bucketed deep-narrow vs single process (float64)")
    for r in results:
        assert r["unsharded_after"] == 0
        if world_size == 1:  # one rank communicates nothing
            assert r["records"] == []
        else:
            # Forward: the root's head, then the 8 blocks in one all-gather. Backward: the root
            # prefetches the blocks (the module that ran before it); their gradients go in one
            # reduce-scatter at the end of backward (the first block's input needs no gradient,
            # so no signal fires for it earlier), then the root's.
            assert r["records"] == [
                ("forward", "all_gather", "<root>"),
                ("forward", "all_gather", BUCKET),
                ("backward_prefetch", "all_gather", BUCKET),
                ("end_of_backward", "reduce_scatter", "<root>"),
                ("end_of_backward", "reduce_scatter", BUCKET_BACKWARD),
            ], r["records"]
        if world_size <= 2:  # two-term sums: the same bits whatever the buffer layout
            assert r["vs_unbucketed"] == 0.0 and r["vs_torch"] == 0.0, r
        else:  # a sum of 4 terms may be ordered differently in a bigger buffer; each run is
            # within TOL64 of the float64 reference (checked above for ours), so of each other
            assert r["vs_unbucketed"] <= 2 * TOL64 and r["vs_torch"] <= 2 * TOL64, r


def _budget() -> dict:
    from fully_shard import debug, fully_shard

    model = deep_narrow()
    ref = copy.deepcopy(model)
    shard(model, fully_shard)
    from fully_shard.runtime.bucket import collective_bytes

    group = model[0]._get_fsdp_state().group
    block_bytes, cost = group.unsharded_bytes(), collective_bytes(group)
    # Gathered parameters and gradients in fp32, their copies, the reduced shard: 2 S + S / W.
    out_cost = 2 * block_bytes + block_bytes // group.info.world_size
    model.set_bucket_bytes(3 * cost)  # 3 blocks per bucket: 3 + 3 + 2
    alive: list[int] = []
    root_bytes = model._get_fsdp_state().group.unsharded_bytes()
    for block in list(model)[:BLOCKS]:
        block.register_forward_pre_hook(lambda *_: alive.append(_unsharded_bytes(model) - root_bytes))
    with debug.trace() as t:
        out = _train_pair(model, ref, batch, _mlp_loss, 2)
    out["gathers"] = [r.module for r in t.select(step=1, op="all_gather", phase="forward")]
    out["most_alive"] = max(alive)
    out["block_bytes"] = block_bytes
    out["cost"], out["expected_cost"] = cost, out_cost
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_byte_budget_sets_bucket_size_and_bounds_unsharded_memory(ranks, world_size):
    results = ranks(world_size).run(_budget)
    check(results, "3-block buckets vs single process (float64)")
    for r in results:
        assert r["gathers"] == ["<root>", "0+1+2", "3+4+5", "6+7"], r["gathers"]
        assert r["cost"] == r["expected_cost"], r
        # In forward, at most one bucket of blocks is unsharded at a time.
        assert r["most_alive"] == 3 * r["block_bytes"], r


def _off_schedule() -> dict:
    from fully_shard import debug, fully_shard

    model = deep_narrow()
    unbucketed = copy.deepcopy(model)
    for m in (model, unbucketed):
        shard(m, fully_shard)
        m[3].set_reshard_after_forward(False)  # keeps its parameters: leaves the bucket's schedule
        m[5].set_gradient_divide_factor(1.0)  # another division: its own reduce-scatter
    unbucketed.set_bucket_bytes(0)
    with debug.trace() as t:
        _train(model)
    _train(unbucketed)
    return {"records": _records(t, 1), "vs_unbucketed": max_abs_diff(model, unbucketed)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_members_with_other_settings_communicate_alone(ranks, world_size):
    for r in ranks(world_size).run(_off_schedule):
        # Block 3 keeps its parameters after forward: it gathers alone, once. The bucket sends
        # gradients with one division together: 7 and 6 when 5 (a sum) arrives, 5 when 4
        # arrives; 3 reduces alone; 4, 2, 1 wait for 0, the bucket's last in backward, whose
        # gradients come at the end of backward (its input needs none).
        assert r["records"] == [
            ("forward", "all_gather", "<root>"),
            ("forward", "all_gather", "0+1+2+4+5+6+7"),
            ("forward", "all_gather", "3"),
            ("backward_prefetch", "all_gather", "0+1+2+4+5+6+7"),
            ("backward", "reduce_scatter", "7+6"),
            ("backward", "reduce_scatter", "5"),
            ("backward", "reduce_scatter", "3"),
            ("end_of_backward", "reduce_scatter", "<root>"),
            ("end_of_backward", "reduce_scatter", "4+2+1+0"),
        ], r["records"]
        if world_size <= 2:
            assert r["vs_unbucketed"] == 0.0, r
        else:  # both within TOL64 of the float64 math (see _parity.TOL64)
            assert r["vs_unbucketed"] <= 2 * TOL64, r


def _skips_and_eval() -> dict:
    """Block 5 skipped on every rank on odd steps; a no-grad evaluation forward between steps."""
    from fully_shard import fully_shard

    model = deep_narrow()
    ref = copy.deepcopy(model)
    shard(model, fully_shard)
    rank, w = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    left_unsharded = []
    for step in range(4):
        model.skip = ref.skip = 5 if step % 2 else -1
        x, y = batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        left_unsharded.append(_unsharded_bytes(model))
        with torch.no_grad():
            model(x.chunk(w)[rank])
        left_unsharded.append(_unsharded_bytes(model))
    vs_ref = max_param_diff(model, ref)
    copied = copy.deepcopy(model)  # a bucketed model copies into an independent one
    _train(model, 2)
    _train(copied, 2)
    return {"left": left_unsharded, "vs_ref": vs_ref, "copy_diff": max_abs_diff(model, copied)}


@pytest.mark.parametrize("world_size", [2])
def test_skipped_member_and_eval_forward_leave_nothing_unsharded(ranks, world_size):
    for r in ranks(world_size).run(_skips_and_eval):
        assert r["vs_ref"] <= TOL64, r
        assert r["left"] == [0] * 8, r["left"]  # after each step, and after each no-grad forward
        assert r["copy_diff"] == 0.0


def _bad_settings() -> list[str]:
    from fully_shard import fully_shard

    model = deep_narrow()
    shard(model, fully_shard)
    errors = []
    for value in (-1, True, 1.5):
        try:
            model.set_bucket_bytes(value)
        except ValueError as e:
            errors.append(str(e))
    model(batch(0)[0])  # lazy init: the root is known now
    try:
        model[2].set_bucket_bytes(0)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_set_bucket_bytes_rejects_bad_values_and_non_roots(ranks):
    (errors,) = ranks(1).run(_bad_settings)
    assert len(errors) == 4, errors
    assert all("set_bucket_bytes expects a byte count >= 0" in e for e in errors[:3]), errors
    assert "not a root" in errors[3] and "call it on the root module (DeepNarrow)" in errors[3], errors[3]
