"""Traps a user can walk into after ``fully_shard`` (issue #11): each either trains exactly like the
single-process reference (float64) and PyTorch's ``fully_shard``, or fails with a clear error that
leaves the model untouched."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from _parity import TOL64, _mlp_loss, make_mlp, max_abs_diff, mlp_batch, shard_mlp
from rank_utils import full, global_mean, max_param_diff, world


def _freeze_then_thaw() -> dict:
    """Block 1 frozen after fully_shard for two steps, then unfrozen for two."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref, theirs = copy.deepcopy(model), copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    shard_mlp(theirs, "nested", True, torch_fully_shard)
    models = (model, ref, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    loss_diff, frozen_moved = 0.0, []
    for step in range(6):
        for m in models:
            m[1].requires_grad_(not 2 <= step < 4)
        before = [t.detach().full_tensor().clone() for t in model[1].parameters()]
        x, y = mlp_batch(step)
        losses = []
        for m, opt in zip(models, opts):
            xs, ys = (x, y) if m is ref else (x.chunk(w)[rank], y.chunk(w)[rank])
            loss = _mlp_loss(m, xs, ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item() if m is ref else global_mean(loss))
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
        moved = any(not torch.equal(a, b.detach().full_tensor()) for a, b in zip(before, model[1].parameters()))
        frozen_moved.append(moved)
    return {"loss_diff": loss_diff, "param_diff": max_param_diff(model, ref), "vs_torch": max_abs_diff(model, theirs),
            "moved": frozen_moved}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_requires_grad_changed_after_fully_shard_is_honoured(ranks, world_size):
    for r in ranks(world_size).run(_freeze_then_thaw):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r
        assert r["moved"] == [True, True, False, False, True, True], r["moved"]
        if world_size <= 2:  # same reduction order as PyTorch's (at 4, buckets may order a sum differently)
            assert r["vs_torch"] == 0.0, r


def _foreign_prefetch_target() -> dict:
    from fully_shard import fully_shard

    a, b = make_mlp(), make_mlp()
    for m in (a, b):
        shard_mlp(m, "nested", True, fully_shard)
    a[0].set_modules_to_forward_prefetch([b[1]])
    x, y = mlp_batch(0)
    try:
        a(x)
        error = ""
    except ValueError as e:
        error = str(e)
    a.reset_iter_state()
    a[0].set_modules_to_forward_prefetch([a[1]])  # the fix: a module of this model
    _mlp_loss(a, x, y).backward()
    return {"error": error, "unsharded_left": any(s.group is not None and s.group.is_unsharded for s in a._fsdp_states(True))}


def test_prefetch_target_of_another_model_is_named(ranks):
    (r,) = ranks(1).run(_foreign_prefetch_target)
    assert "module '0' (Sequential): set_modules_to_forward_prefetch names a Sequential that is not under the same " \
           "root module" in r["error"], r["error"]
    assert not r["unsharded_left"]


def _nested_unsharded() -> dict:
    """Nested blocks: the inner one's exit keeps the outer's parameters; writes land once, on the
    outer exit; a block that raises writes nothing back."""
    from fully_shard import fully_shard, unsharded

    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    with torch.no_grad():
        with unsharded(model, writeback=True):
            model[0][0].weight.add_(1.0)
            with unsharded(model[0]):  # inner, no writeback: its exit must not free the outer's tensors
                model[0][0].weight.mul_(2.0)
            inner_kept = model[0][0].weight.shape == ref[0][0].weight.shape
            model[2][0].bias.sub_(0.5)
        ref[0][0].weight.add_(1.0).mul_(2.0)
        ref[2][0].bias.sub_(0.5)
        raised = False
        try:
            with unsharded(model, writeback=True):
                model[1][0].weight.zero_()
                raise KeyError("boom")
        except KeyError:
            raised = True
    left = any(s.group is not None and s.group.is_unsharded for s in model._fsdp_states(True))
    after = max_abs_diff(model, ref)
    # And training afterwards equals the reference.
    from _parity import _train_pair

    trained = _train_pair(model, ref, mlp_batch, _mlp_loss, 3)
    return {"inner_kept": inner_kept, "raised": raised, "left": left, "after": after, **trained}


@pytest.mark.parametrize("world_size", [1, 2])
def test_nested_unsharded_blocks_and_an_exception_inside_writeback(ranks, world_size):
    for r in ranks(world_size).run(_nested_unsharded):
        assert r["inner_kept"] and r["raised"] and not r["left"], r
        assert r["after"] == 0.0, r  # the edits exactly, once; the failed block's zeroing not at all
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _state_dict_while_unsharded() -> dict:
    from torch.distributed.tensor import DTensor

    from fully_shard import fully_shard

    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    expected = {k: v.detach().full_tensor() for k, v in model.state_dict().items()}
    for m in (model, *model[:3]):  # every group, full-size now
        m.unshard()
    full_size = model[0][0].weight.shape == ref[0][0].weight.shape
    sd = model.state_dict()
    all_dtensors = all(isinstance(v, DTensor) for v in sd.values())
    same = all(torch.equal(v.full_tensor(), expected[k]) for k, v in sd.items())
    still_unsharded = model[0][0].weight.shape == ref[0][0].weight.shape
    # Loading while unsharded lands in the shards, and the next forward uses it.
    with torch.no_grad():
        for t in ref.parameters():
            t.mul_(0.5)
    from torch.distributed.tensor import distribute_tensor

    new_sd = {k: distribute_tensor(v.detach(), sd[k].device_mesh, sd[k].placements) for k, v in ref.state_dict().items()}
    model.load_state_dict(new_sd)
    x, y = mlp_batch(0)
    rank, w = world()
    loss = global_mean(_mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]))
    for m in (model, *model[:3]):
        m.reshard()
    return {"full_size": full_size, "all_dtensors": all_dtensors, "same": same, "still_unsharded": still_unsharded,
            "loss_diff": abs(loss - _mlp_loss(ref, x, y).item())}


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dict_and_load_while_unsharded_use_the_shards(ranks, world_size):
    for r in ranks(world_size).run(_state_dict_while_unsharded):
        assert r["full_size"] and r["all_dtensors"] and r["same"] and r["still_unsharded"], r
        assert r["loss_diff"] <= TOL64, r


class _OddParams(torch.nn.Module):
    """A size-0 trainable parameter and a complex one, both on the loss's path. The complex one's
    dim 0 divides every world size tested: with uneven shards, DTensor's ``view_as_real`` (which
    Adam/AdamW use for complex parameters) returns a copy, so those optimizers never update it
    (a PyTorch limitation, shared by its fully_shard; fully_shard warns about it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 4)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))
        self.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.complex128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + self.empty.sum(0)
        return (h.to(torch.complex128) * self.phase).abs()


def _odd_params() -> dict:
    from fully_shard import fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_OddParams(), torch.nn.Linear(4, 3)).double()
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    loss_diff = 0.0
    for step in range(4):
        x, y = mlp_batch(step)
        loss = _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])
        loss.backward()
        empty_grad = tuple(model[0].empty.grad.shape)
        opt.step()
        opt.zero_grad()
        ref_loss = _mlp_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diff = max(loss_diff, abs(global_mean(loss) - ref_loss.item()))
    diffs = [(a.detach().full_tensor() - b.detach()).abs().max().item() if b.numel() else 0.0
             for a, b in zip(model.parameters(), ref.parameters())]
    return {"loss_diff": loss_diff, "param_diff": max(diffs), "empty_grad": empty_grad,
            "phase_dtype": str(model[0].phase.dtype)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_size_zero_and_complex_parameters_train_like_the_reference(ranks, world_size):
    for r in ranks(world_size).run(_odd_params):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r
        assert r["empty_grad"] == (0, 4) and r["phase_dtype"] == "torch.complex128", r


def _optimizer_traps() -> dict:
    import warnings

    from fully_shard import fully_shard

    x, y = mlp_batch(0)
    rank, w = world()
    out = {}
    # An optimizer built before fully_shard.
    model = make_mlp()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard_mlp(model, "nested", True, fully_shard)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    try:
        early.step()
        out["early"] = ""
    except RuntimeError as e:
        out["early"] = str(e)
    # Blocks sharded, the root not: its own parameters (model[3]) are never synchronised.
    model = make_mlp()
    for block in model[:3]:
        fully_shard(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # warned once per optimizer
            _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opt.step()
    out["root_missing"] = [str(c.message) for c in caught if "plain parameter" in str(c.message)]
    # The same, on purpose: ignored_params says so, and nothing is said.
    model = make_mlp()
    fully_shard(model[0])
    fully_shard(model, ignored_params=set(model[1].parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
    out["ignored"] = [str(c.message) for c in caught if "plain parameter" in str(c.message)]
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_built_before_fully_shard_or_root_left_unsharded_is_reported(ranks, world_size):
    for r in ranks(world_size).run(_optimizer_traps):
        assert "AdamW holds parameter '0.0.weight' as it was before fully_shard" in r["early"], r["early"]
        assert "Fix: build the optimizer after fully_shard" in r["early"]
        if world_size == 1:  # one rank: nothing can drift
            assert r["root_missing"] == [], r
        else:
            assert len(r["root_missing"]) == 1 and "steps 2 plain parameter(s) (shapes (3, 3), (3,))" in r["root_missing"][0], r
        assert r["ignored"] == [], r


def _zero_grad_after_no_sync(held_apart: bool) -> dict:
    """A no-sync backward, then model.zero_grad(): the next (syncing) backward reduces only its own
    gradients, as in the reference. ``held_apart``: float64 compute with an fp32 reduction, whose
    sums without sync are held apart in fp32 (`FSDPParam.unsynced_leaf`); the reference is then
    the same sharded model without the abandoned micro-batch (equal to the bit)."""
    from fully_shard import MixedPrecisionPolicy, fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32) if held_apart else MixedPrecisionPolicy()
    shard_mlp(model, "nested", True, functools.partial(fully_shard, mp_policy=mp))
    if held_apart:
        shard_mlp(ref, "nested", True, functools.partial(fully_shard, mp_policy=mp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = mlp_batch(0)
    model.set_requires_gradient_sync(False)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()  # abandoned accumulation
    held = sum(fp.unsynced_grad is not None for m in model.modules() if hasattr(m, "_get_fsdp_state")
               for g in m._get_fsdp_state().own for fp in g.params)
    model.zero_grad()
    left = sum(fp.unsynced_grad is not None for m in model.modules() if hasattr(m, "_get_fsdp_state")
               for g in m._get_fsdp_state().own for fp in g.params)
    model.set_requires_gradient_sync(True)
    x, y = mlp_batch(1)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    opt.step()
    if held_apart:
        _mlp_loss(ref, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    else:
        _mlp_loss(ref, x, y).backward()
    ref_opt.step()
    if held_apart:
        equal = all(torch.equal(full(a), full(b)) for a, b in zip(model.parameters(), ref.parameters()))
        return {"equal": equal, "held": held, "left": left}
    return {"param_diff": max_param_diff(model, ref), "held": held, "left": left}


@pytest.mark.parametrize("world_size", [1, 2])
def test_model_zero_grad_drops_an_unsynced_accumulation(ranks, world_size):
    for r in ranks(world_size).run(_zero_grad_after_no_sync, False):
        assert r["param_diff"] <= TOL64 and r["held"] == r["left"] == 0, r
    for r in ranks(world_size).run(_zero_grad_after_no_sync, True):  # the MLP's 12 parameters held apart
        assert r["equal"] and (r["held"], r["left"]) == (12, 0), r


def _post_accumulate_hooks() -> dict:
    """register_post_accumulate_grad_hook on the sharded parameters fires once per reduction, with
    .grad already the reduced gradient; an optimizer-in-backward recipe (one SGD per parameter,
    stepped from its hook) trains like the reference."""
    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    calls = {name: 0 for name, _ in model.named_parameters()}
    opts = {}
    for name, p in model.named_parameters():
        opts[p] = torch.optim.SGD([p], lr=0.1)

        def hook(param, name=name):
            calls[name] += 1
            opts[param].step()
            opts[param].zero_grad()

        p.register_post_accumulate_grad_hook(hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"calls": sorted(set(calls.values())), "param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_post_accumulate_grad_hooks_fire_on_the_reduced_gradient(ranks, world_size):
    for r in ranks(world_size).run(_post_accumulate_hooks):
        assert r["calls"] == [3] and r["param_diff"] <= TOL64, r


def _inference_mode_first() -> dict:
    """The very first forward under torch.inference_mode (an evaluation before training), then
    training: equals the reference."""
    from _parity import _train_pair

    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    x, _ = mlp_batch(0)
    with torch.inference_mode():
        evaluated = model(x.chunk(w)[rank])
    with torch.no_grad():
        eval_diff = (evaluated - ref(x).chunk(w)[rank]).abs().max().item()
    return {"eval_diff": eval_diff, **_train_pair(model, ref, mlp_batch, _mlp_loss, 3)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_inference_mode_forward_before_training(ranks, world_size):
    for r in ranks(world_size).run(_inference_mode_first):
        assert r["eval_diff"] <= TOL64 and r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _finite_check(mode: str, bad_rank: int) -> dict:
    """One rank's batch makes block 1's gradient NaN (an inf input times zero weights would be too
    clever: a NaN in the input row is plain)."""
    from fully_shard import NonFiniteGradients, fully_shard

    rank, w = world()
    model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    model.set_grad_finite_check(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"errors": [], "reports": []}
    for step in range(3):
        x, y = mlp_batch(step)
        x, y = x.chunk(w)[rank].clone(), y.chunk(w)[rank]
        if step == 1 and rank == bad_rank:
            x[0, 0] = float("nan")
        try:
            _mlp_loss(model, x, y).backward()
        except NonFiniteGradients as e:
            out["errors"].append((step, str(e), [(r.param, r.ranks) for r in e.report]))
            opt.zero_grad()
            continue
        if mode == "report":
            report = model.nonfinite_grads()
            out["reports"].append((step, [(r.param, r.ranks) for r in report]))
            if report:
                opt.zero_grad()
                continue
        opt.step()
        opt.zero_grad()
    out["finite_after"] = all(bool(torch.isfinite(p.detach().to_local()).all()) for p in model.parameters())
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", ["raise", "report"])
def test_finite_check_names_parameters_and_ranks(ranks, world_size, mode):
    bad = world_size - 1
    every = [f"0.0.{n}" for n in ("weight", "bias")] + [f"0.2.{n}" for n in ("weight", "bias")]
    for r in ranks(world_size).run(_finite_check, mode, bad):
        assert r["finite_after"], r
        if mode == "raise":
            assert len(r["errors"]) == 1 and r["errors"][0][0] == 1, r
            step, message, report = r["errors"][0]
            assert "non-finite gradients (NaN/Inf) before the reduction: '3.weight' on rank(s) [%d]" % bad in message
            names = [name for name, _ in report]
        else:
            assert r["errors"] == [] and [s for s, rep in r["reports"] if rep] == [1], r
            report = dict(r["reports"])[1]
            names = [name for name, _ in report]
        assert set(every) <= set(names) and all(ranks_ == (bad,) for _, ranks_ in report), report


class _Routed(torch.nn.Module):
    """Three experts in one fully_shard group; each sample goes to one expert, and an expert
    with no sample on this rank does not run (MoE routing). Expert 2 gets no sample anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(7, 7) for _ in range(3)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if len(idx):
                y = y.index_add(0, idx, expert(x[idx]))
        return y


class _MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, 7)
        self.moe = _Routed()
        self.out = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.moe(self.inp(x), route)))


def _rank_divergent_routing() -> dict:
    """Samples 0-3 of the global batch go to expert 0, 4-7 to expert 1: at world 2 and 4 each rank
    uses one expert only, and ranks disagree on which. Equals the single-process model, and expert
    2 (no sample anywhere) keeps grad None and its weights, as there."""
    from fully_shard import fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = _MoE().double()
    ref = copy.deepcopy(model)
    fully_shard(model.moe)
    fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref)]
    route = torch.arange(8) // 4
    loss_diff, unused_grad = 0.0, []
    for step in range(4):
        x, y = mlp_batch(step)
        loss = ((model(x.chunk(w)[rank], route.chunk(w)[rank]) - y.chunk(w)[rank]) ** 2).mean()
        loss.backward()
        unused_grad.append(model.moe.experts[2].weight.grad is None)
        ref_loss = ((ref(x, route) - y) ** 2).mean()
        ref_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss_diff = max(loss_diff, abs(global_mean(loss) - ref_loss.item()))
    return {"loss_diff": loss_diff, "param_diff": max_param_diff(model, ref), "unused_grad_none": all(unused_grad)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_divergent_routing_in_one_group_equals_the_reference(ranks, world_size):
    for r in ranks(world_size).run(_rank_divergent_routing):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64 and r["unused_grad_none"], r


class _Stack(torch.nn.Module):
    """Four same-shaped residual blocks; ``skip`` names one this rank leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(7, 7) for _ in range(4)])
        self.skip = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = x + torch.tanh(block(x))
        return x


def _divergent_schedule(kind: str) -> dict:
    """On a fresh process group with the schedule check on (2 s timeout), rank 1 diverges: it skips
    block 1 in forward, or it skips the backward (the group's own timeout: 4 s). Every rank that sees
    it raises, naming it. Or it does not diverge: it is 5 s late ("late"), or its check is off
    ("one_sided"); then both train."""
    import datetime
    import time
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from fully_shard import debug, fully_shard

    rank, w = world()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4 if kind == "skip_backward" else 60))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = _Stack().double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_bucket_bytes(0)  # one collective per block, so a skipped block shows as one
    x, _ = mlp_batch(0)
    if not (kind == "one_sided" and rank == 1):
        debug.set_schedule_check(True, timeout=2.0)
    dist.barrier()
    start = time.monotonic()
    error, kind_of_error = "", ""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if kind == "skip_block" and rank == 1:
                model.skip = 1
            if kind == "late" and rank == 1:
                time.sleep(5.0)
            out = model(x.chunk(w)[rank]).sum()
            if not (kind == "skip_backward" and rank == 1):
                out.backward()
    except debug.ScheduleDivergence as e:
        error, kind_of_error = str(e), type(e).__name__
    finally:
        dist.barrier()  # a rank turning its check off while another still checks would read as "off"
        debug.set_schedule_check(False)
        model.reset_iter_state()
    trained = all(p.grad is not None for p in model.parameters()) if not error else False
    return {"error": error, "type": kind_of_error, "seconds": time.monotonic() - start, "trained": trained,
            "warnings": [str(m.message) for m in caught if "schedule check" in str(m.message)]}


@pytest.mark.parametrize("world_size", [2])
def test_schedule_check_names_a_rank_that_skips_a_block(ranks, world_size):
    r0, r1 = ranks(world_size).run(_divergent_schedule, "skip_block")
    for r in (r0, r1):
        assert "ranks disagree on collective #2 on process group" in r["error"], r
        # Linear(7, 7) over 2 ranks: 4 padded rows of 7 weights + 4 of bias = 32 float64 per rank.
        assert "rank 0: all_gather of 'blocks.1' (float64, 512 bytes) [forward]" in r["error"], r
        assert "rank 1: all_gather of 'blocks.2' (float64, 512 bytes) [forward]" in r["error"], r
        assert "The last collective all ranks agreed on: #1: all_gather of 'blocks.0'" in r["error"], r
        assert r["seconds"] < 30, r


@pytest.mark.parametrize("world_size", [2])
def test_schedule_check_names_a_rank_that_skips_backward(ranks, world_size):
    r0, r1 = ranks(world_size).run(_divergent_schedule, "skip_backward")
    # Forward gathered the 4 blocks (#1-#4); backward starts by gathering the last one again.
    # Rank 1 issues nothing more: rank 0 can only tell it is late (warned at 2 s), and says so at the
    # group's timeout (4 s), as late, not divergent (in a training loop rank 1's next forward would
    # disagree with rank 0's backward at once).
    assert r0["type"] == "LateRank", r0
    assert "rank(s) [1] did not reach collective #5 on process group" in r0["error"], r0
    assert "all_gather of 'blocks.3' (float64, 512 bytes) [backward]" in r0["error"], r0
    assert "within the process group's timeout (4 s): late, stopped or hung" in r0["error"], r0
    assert "The last collective all ranks agreed on: #4" in r0["error"] and "Fix:" in r0["error"], r0
    assert len(r0["warnings"]) == 1 and "waiting (late is not divergent)" in r0["warnings"][0], r0
    assert r1["error"] == "", r1
    assert 4 <= r0["seconds"] < 30, r0


@pytest.mark.parametrize("world_size", [2])
def test_schedule_check_waits_for_a_late_rank(ranks, world_size):
    """Issue #23: rank 1 is 5 s late (the check's timeout is 2 s): not a divergence. Rank 0 warns once
    that it waits, and both train."""
    r0, r1 = ranks(world_size).run(_divergent_schedule, "late")
    for r in (r0, r1):
        assert r["error"] == "" and r["trained"], r
    assert len(r0["warnings"]) == 1 and "rank(s) [1] have not reached collective #1" in r0["warnings"][0], r0
    assert r1["warnings"] == [], r1


@pytest.mark.parametrize("world_size", [2])
def test_schedule_check_on_one_rank_only_says_so_and_trains(ranks, world_size):
    """Issue #23: the check on rank 0 only. It used to blame rank 1 with a false divergence; rank 0 now
    sees rank 1 never turned it on, says so with the fix, stops checking that group, and both train."""
    r0, r1 = ranks(world_size).run(_divergent_schedule, "one_sided")
    for r in (r0, r1):
        assert r["error"] == "" and r["trained"], r
    assert len(r0["warnings"]) == 1 and "it is off on rank(s) [1]" in r0["warnings"][0], r0
    assert "Fix: turn it on on every rank" in r0["warnings"][0], r0
    assert r1["warnings"] == [], r1


def _watchdog_dump() -> dict:
    """Rank 1 joins the first all-gather 3 s late; rank 0's watchdog (1 s) dumps the FSDP state
    and the stacks to stderr while it waits, and the step then completes normally."""
    import sys
    import tempfile
    import time

    from fully_shard import debug, fully_shard

    rank, w = world()
    model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    x, y = mlp_batch(0)
    debug.set_watchdog(1.0)
    saved = sys.stderr
    with tempfile.TemporaryFile("w+") as f:
        sys.stderr = f
        try:
            if rank == 1:
                time.sleep(3.0)
            _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        finally:
            sys.stderr = saved
            debug.set_watchdog(None)
        f.seek(0)
        dumped = f.read()
    return {"dumped": dumped}


def test_watchdog_dumps_state_and_stacks_of_a_long_wait(ranks):
    r0, r1 = ranks(2).run(_watchdog_dump)
    out = r0["dumped"]
    assert "fully_shard watchdog: rank 0 has waited more than 1 s for the all_gather of '<root>' (forward)" in out, out
    assert "root Sequential: iteration FORWARD" in out and "module '<root>': FORWARD, group SHARDED, all-gather in flight" in out, out
    assert "Python stacks of every thread:" in out and "_watchdog_dump" in out, out
    assert r1["dumped"] == "", r1  # rank 1 never waited long


def _tied_outside_every_call() -> dict:
    """lm_head.weight = embed.weight, only embed sharded (root not): lm_head still holds the original
    tensor, so the optimizer over model.parameters() would step a weight the embedding no longer
    uses. Named at the first step."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(11, 6)
    model.lm_head = torch.nn.Linear(6, 11, bias=False)
    model.lm_head.weight = model.embed.weight
    fully_shard(model.embed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.arange(4)
    model.lm_head(model.embed(tokens)).sum().backward()
    try:
        opt.step()
        return {"error": ""}
    except RuntimeError as e:
        return {"error": str(e)}


def test_weight_tied_outside_every_call_is_named(ranks):
    for r in ranks(2).run(_tied_outside_every_call):
        assert "SGD holds parameter 'weight' as it was before fully_shard" in r["error"], r
        assert "a weight tied outside every call" in r["error"] and "apply fully_shard to the root" in r["error"], r


def _load_with_one_wrong_shape(after_forward: bool) -> dict:
    """A state dict with one key of the wrong shape (the last block's weight): refused before any
    key is loaded (PyTorch loads the others first), the model as it was, training goes on."""
    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    if after_forward:  # the root's parameters are unsharded at the load
        model(mlp_batch(0)[0].chunk(w)[rank])
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    donor = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    last = [k for k in donor if k.endswith("weight")][-1]
    donor[last] = torch.zeros(donor[last].shape[0] + 1, *donor[last].shape[1:], dtype=donor[last].dtype)
    try:
        model.load_state_dict(donor)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    unchanged = all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())
    if after_forward:
        model.reshard()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref))
    for step in range(2):
        x, y = mlp_batch(step)
        for m, o, xs, ys in ((model, opt, x.chunk(w)[rank], y.chunk(w)[rank]), (ref, ref_opt, x, y)):
            _mlp_loss(m, xs, ys).backward()
            o.step()
            o.zero_grad()
    return {"message": message, "last": last, "unchanged": unchanged, "param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("after_forward", [False, True])
def test_a_state_dict_with_a_wrong_shape_is_refused_before_anything_loads(ranks, world_size, after_forward):
    for r in ranks(world_size).run(_load_with_one_wrong_shape, after_forward):
        assert f"'{r['last']}' is (" in r["message"] and "nothing was loaded" in r["message"], r
        assert "Fix:" in r["message"] and r["unchanged"] and r["param_diff"] <= TOL64, r


def _optimizer_after_a_dry_run(reshard_first: bool) -> dict:
    """A grad-enabled forward without backward (a dry run), then the optimizer: the root's parameters
    are unsharded at that moment, so it holds tensors the model never trains through. Refused at the
    first step, naming the cause and the fix; after model.reshard() it trains like the reference."""
    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    model(mlp_batch(0)[0].chunk(w)[rank])  # dry run: the root keeps its parameters for a backward
    if reshard_first:
        model.reshard()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref))
    message = "no error"
    for step in range(2):
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        try:
            opt.step()
        except RuntimeError as e:
            return {"message": str(e)}
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"message": message, "param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("reshard_first", [False, True])
def test_an_optimizer_built_while_unsharded_is_refused(ranks, world_size, reshard_first):
    for r in ranks(world_size).run(_optimizer_after_a_dry_run, reshard_first):
        if reshard_first:
            assert r["message"] == "no error" and r["param_diff"] <= TOL64, r
        else:
            assert "in its unsharded form" in r["message"] and "Fix:" in r["message"], r
            assert "model.reshard()" in r["message"], r


def _forward_inside_unsharded(writeback: bool) -> dict:
    """Evaluate, edit a weight, evaluate again, all inside ``unsharded()``: a forward inside the block
    keeps the parameters unsharded (it resharded them, and the write-back then crashed: issue #23),
    and the edit is written back (or dropped) as the block says."""
    from fully_shard import fully_shard, unsharded

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    x, _ = mlp_batch(0)
    with torch.no_grad():
        with unsharded(model, writeback=writeback):
            first = model(x) - ref(x)
            model[0][0].weight.add_(0.5)
            inside = (model(x) - _edited(ref)(x)).abs().max().item()
        after = model(x)
    expected = _edited(ref) if writeback else ref
    return {"first": first.abs().max().item(), "inside": inside, "after": (after - expected(x)).abs().max().item(),
            "param_diff": max_param_diff(model, expected)}


def _edited(ref):
    edited = copy.deepcopy(ref)
    with torch.no_grad():
        edited[0][0].weight.add_(0.5)
    return edited


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("writeback", [True, False])
def test_a_forward_inside_unsharded_keeps_the_block_and_its_edits(ranks, world_size, writeback):
    for r in ranks(world_size).run(_forward_inside_unsharded, writeback):
        assert max(r.values()) <= TOL64, r


def _gradient_penalty() -> dict:
    """A gradient penalty: autograd.grad(create_graph=True) through the sharded blocks, then a backward
    through that graph. The first backward keeps the parameters unsharded (grad mode is on in it),
    so the second one can use them (it crashed on freed storage: issue #23); trains like float64."""
    from torch.distributed.tensor import DTensor

    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref))

    def loss(m, x, y):
        x = x.clone().requires_grad_(True)
        out = _mlp_loss(m, x, y)
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        return out + g.pow(2).sum()

    for step in range(3):
        x, y = mlp_batch(step)
        loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()
        # Each rank's loss is a mean over its slice plus its slice's penalty: their average over ranks.
        sum(loss(ref, xs, ys) for xs, ys in zip(x.chunk(w), y.chunk(w))).div(w).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, ref), "resharded": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_gradient_penalty_through_sharded_blocks_trains_like_the_reference(ranks, world_size):
    for r in ranks(world_size).run(_gradient_penalty):
        assert r["param_diff"] <= TOL64 and r["resharded"], r
