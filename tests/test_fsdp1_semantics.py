"""Issue #24: what FSDP1 scripts rely on beyond losses, each checked against PyTorch's own
``FullyShardedDataParallel`` running the same script (the oracle) and, for training, a float64
single-process reference: the class of an instance, an optimizer built before wrapping, names and
training-state rules around ``summon_full_params`` / ``apply`` / ``clip_grad_norm_``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from _parity import TOL64
from rank_utils import world
from test_fsdp1 import Block


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(7, 13), Block(13, 11), nn.Linear(11, 3)).double()
    model[0].register_buffer("seen", torch.zeros(2, dtype=torch.float64))
    return model


def _lib(which: str):
    if which == "ours":
        import fully_shard.fsdp1 as lib
    else:
        import torch.distributed.fsdp as lib
    return lib


def _wrap(which: str, model: nn.Module, use_orig_params: bool = True) -> nn.Module:
    lib = _lib(which)
    fsdp = lib.FullyShardedDataParallel
    extra = {} if which == "ours" else {"device_id": torch.device("cpu")}  # PyTorch's needs it on CPU
    for i in (0, 1):
        model[i] = fsdp(model[i], use_orig_params=use_orig_params, **extra)
    return fsdp(model, use_orig_params=use_orig_params, **extra)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen).double(), torch.randn(8, 3, generator=gen).double()


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _optimizer_before_wrapping(use_orig_params: bool) -> dict:
    """FSDP1 with use_orig_params=True keeps the original parameter objects: an optimizer built
    before wrapping trains the model. Ours swaps its references for the sharded parameters at its
    first step. With use_orig_params=False FSDP1 trains nothing (the optimizer holds parameters the
    model no longer has); ours refuses at the first step."""
    rank, w = world()
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before wrapping
    model = _wrap("ours", model, use_orig_params)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    error = ""
    diffs = []
    for step in range(3):
        x, y = _batch(step)
        loss = _loss(model, x.chunk(w)[rank], y.chunk(w)[rank])
        loss.backward()
        _loss(ref, x, y).backward()
        try:
            opt.step()
        except RuntimeError as e:
            error = str(e)
            break
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with _lib("ours").FullyShardedDataParallel.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            diffs.append((p - q).abs().max().item())
    return {"error": error, "diff": max(diffs)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_an_optimizer_built_before_wrapping_trains_with_use_orig_params(ranks, world_size):
    for r in ranks(world_size).run(_optimizer_before_wrapping, True):
        assert r["error"] == "" and r["diff"] <= TOL64, r


def test_an_optimizer_built_before_wrapping_is_refused_without_use_orig_params(ranks):
    for r in ranks(2).run(_optimizer_before_wrapping, False):
        assert "as it was before fully_shard" in r["error"], r


def _observe(which: str) -> dict:
    """What a script sees: the instance's class, names inside and outside summon_full_params, and
    which exception each misuse raises."""
    lib = _lib(which)
    fsdp = lib.FullyShardedDataParallel
    model = _wrap(which, _model())
    out: dict = {"type_is": type(model) is fsdp and type(model[0]) is fsdp}
    out["names_outside"] = [n for n, _ in model.named_parameters()]
    with fsdp.summon_full_params(model):
        out["names_inside"] = [n for n, _ in model.named_parameters()]
        out["buffers_inside"] = [n for n, _ in model.named_buffers()]
        out["shapes_inside"] = [tuple(p.shape) for p in model.parameters()]
    out["buffers_outside"] = [n for n, _ in model.named_buffers()]

    def raised(fn) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return f"{type(e).__name__}: {e}"
        return ""

    def nested_summon():
        with fsdp.summon_full_params(model):
            with fsdp.summon_full_params(model[0]):
                pass

    def apply_inside():
        with fsdp.summon_full_params(model):
            model.apply(lambda m: None)

    seen: list[str] = []

    def summon_in_forward(module, args):
        seen.append(raised(lambda: fsdp.summon_full_params(module).__enter__()))

    handle = model[1].module.register_forward_pre_hook(lambda m, args: summon_in_forward(model[1], args))
    x, y = _batch(0)
    _loss(model, x, y).backward()
    handle.remove()
    out["summon_in_forward"] = seen[0]
    out["nested_summon"] = raised(nested_summon)
    out["apply_inside"] = raised(apply_inside)
    model(x)  # a forward: the root is known, model[0] is not one
    out["clip_non_root"] = raised(lambda: model[0].clip_grad_norm_(1.0))
    out["rank0_writeback"] = raised(
        lambda: fsdp.summon_full_params(model, rank0_only=True, writeback=True).__enter__()
    )
    return out


def _both() -> dict:
    return {"ours": _observe("ours"), "theirs": _observe("theirs")}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_what_scripts_observe_matches_pytorch_fsdp1(ranks, world_size):
    for r in ranks(world_size).run(_both):
        ours, theirs = r["ours"], r["theirs"]
        assert ours["type_is"] and theirs["type_is"], r
        for key in ("names_outside", "names_inside", "buffers_inside", "buffers_outside", "shapes_inside"):
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
        for key in ("summon_in_forward", "nested_summon", "apply_inside", "clip_non_root", "rank0_writeback"):
            kind, _, words = theirs[key].partition(": ")
            assert kind and ours[key].startswith(kind + ": "), (key, ours[key], theirs[key])
            assert words.split(".")[0].split(" but ")[0] in ours[key], (key, ours[key], theirs[key])


def _low_precision_grads() -> dict:
    """MixedPrecision(bf16, keep_low_precision_grads=True): after backward every ``.grad`` is
    bfloat16, and SGD applied with them (by hand, in float32) leaves the parameters equal to
    PyTorch's FSDP1's bit for bit (world 2: the same reduction order)."""
    rank, w = world()
    out = {}
    for which in ("ours", "theirs"):
        lib = _lib(which)
        mp = lib.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, keep_low_precision_grads=True)
        extra = {} if which == "ours" else {"device_id": torch.device("cpu")}
        model = _model().float()
        for i in (0, 1):
            model[i] = lib.FullyShardedDataParallel(model[i], use_orig_params=True, mixed_precision=mp, **extra)
        model = lib.FullyShardedDataParallel(model, use_orig_params=True, mixed_precision=mp, **extra)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x, y = _batch(step)
            _loss(model, x.float().chunk(w)[rank], y.float().chunk(w)[rank]).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            with torch.no_grad():  # SGD on a float32 parameter with a bf16 gradient: by hand, in fp32
                for p in model.parameters():
                    if p.grad is not None:  # FSDP1: None where this rank holds none of it
                        p.add_(p.grad.float(), alpha=-0.1)
            opt.zero_grad()
        out[which] = {"dtypes": sorted({str(g.dtype) for g in grads.values()})}
        fsdp = lib.FullyShardedDataParallel
        with fsdp.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):  # the float32 parameters
            out[which]["params"] = list(model.state_dict().values())
    return out


def test_keep_low_precision_grads_matches_pytorch_fsdp1(ranks):
    for r in ranks(2).run(_low_precision_grads):
        ours, theirs = r["ours"], r["theirs"]
        assert ours["dtypes"] == theirs["dtypes"] == ["torch.bfloat16"], r
        # (PyTorch's gradients are flat slices of its flat parameter: compared through their effect)
        assert len(ours["params"]) == len(theirs["params"]) and all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"]))


def _summon_under_mixed_precision() -> dict:
    """Under MixedPrecision(param_dtype=bf16), summon_full_params shows the parameters in full
    precision (as FSDP1 does), and an edit written back lands in the float32 shards exactly."""
    out = {}
    for which in ("ours", "theirs"):
        lib = _lib(which)
        mp = lib.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        extra = {} if which == "ours" else {"device_id": torch.device("cpu")}
        model = _model().float()
        for i in (0, 1):
            model[i] = lib.FullyShardedDataParallel(model[i], use_orig_params=True, mixed_precision=mp, **extra)
        model = lib.FullyShardedDataParallel(model, use_orig_params=True, mixed_precision=mp, **extra)
        x, y = _batch(0)
        _loss(model, x.float(), y.float()).backward()  # a step's worth of use first
        fsdp = lib.FullyShardedDataParallel
        with fsdp.summon_full_params(model):
            seen = [(p.dtype, p.detach().clone()) for p in model.parameters()]
            with torch.no_grad():
                next(model.parameters()).mul_(3.0)
        with fsdp.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
            out[which] = {"seen": seen, "after": list(model.state_dict().values())}
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_summon_under_mixed_precision_shows_full_precision(ranks, world_size):
    for r in ranks(world_size).run(_summon_under_mixed_precision):
        ours, theirs = r["ours"], r["theirs"]
        assert [d for d, _ in ours["seen"]] == [d for d, _ in theirs["seen"]] == [torch.float32] * len(ours["seen"])
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours["seen"], theirs["seen"]))
        assert all(torch.equal(a, b) for a, b in zip(ours["after"], theirs["after"]))


def _no_shard(strategy: str) -> dict:
    """NO_SHARD (and any strategy at world 1, which FSDP1 turns into NO_SHARD): parameters and
    gradients are plain tensors a script can compare with plain ones; training equals PyTorch's
    FSDP1 bit for bit; inside summon_full_params the parameters are the ones that train (an edit
    persists without writeback, and their gradients are visible and kept, between forward and
    backward too)."""
    import warnings

    rank, w = world()
    out = {}
    for which in ("ours", "theirs"):
        lib = _lib(which)
        fsdp = lib.FullyShardedDataParallel
        extra = {} if which == "ours" else {"device_id": torch.device("cpu")}
        model = _model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in (0, 1):
                model[i] = fsdp(model[i], sharding_strategy=getattr(lib.ShardingStrategy, strategy), use_orig_params=True, **extra)
            model = fsdp(model, sharding_strategy=getattr(lib.ShardingStrategy, strategy), use_orig_params=True, **extra)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            x, y = _batch(step)
            _loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opt.step()
            if step < 2:
                opt.zero_grad()
        r = {
            "switched": any("switching to use `NO_SHARD`" in str(c.message) for c in caught),
            "strategy": model.sharding_strategy.name,
            "kinds": sorted({type(p).__name__ for p in model.parameters()}),
            "grad_kinds": sorted({type(p.grad).__name__ for p in model.parameters()}),
            "params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters()],
            "allclose": all(p.grad.allclose(p.grad.clone()) for p in model.parameters()),
        }
        with fsdp.summon_full_params(model, writeback=False):
            with torch.no_grad():
                next(model.parameters()).mul_(2.0)
        r["edited"] = next(model.parameters()).detach().clone()
        x, y = _batch(5)
        out_ = model(x.chunk(w)[rank])  # between forward and backward
        with fsdp.summon_full_params(model, with_grads=True):
            r["grads_inside"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        # (FSDP1 all-reduces old + new gradients where we add the reduced new ones to the old: the
        # same sum, rounded differently; compared from zero)
        opt.zero_grad()
        ((out_ - y.chunk(w)[rank]) ** 2).mean().backward()
        r["after_backward"] = [p.grad.clone() for p in model.parameters()]
        out[which] = r
    return out


@pytest.mark.parametrize("world_size, strategy", [(1, "FULL_SHARD"), (2, "NO_SHARD"), (4, "NO_SHARD")])
def test_no_shard_exposes_plain_tensors_as_pytorch_fsdp1(ranks, world_size, strategy):
    for r in ranks(world_size).run(_no_shard, strategy):
        ours, theirs = r["ours"], r["theirs"]
        for key in ("switched", "strategy", "kinds", "grad_kinds", "allclose"):
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
        assert ours["kinds"] == ["Parameter"] and ours["grad_kinds"] == ["Tensor"], ours
        assert ours["switched"] == (world_size == 1) and ours["strategy"] == "NO_SHARD", ours
        for key in ("params", "grads", "grads_inside", "after_backward"):
            assert len(ours[key]) == len(theirs[key]), key
            if world_size <= 2:  # the same reduction order: bit for bit
                assert all(torch.equal(a, b) for a, b in zip(ours[key], theirs[key])), key
            else:  # gloo's ring sums an element in an order set by its offset: a flat buffer's differs
                assert max((a - b).abs().max().item() for a, b in zip(ours[key], theirs[key])) <= TOL64, key
        assert torch.equal(ours["edited"], theirs["edited"]) and torch.equal(ours["edited"], 2 * ours["params"][0])


def _with_grads_writeback() -> dict:
    """summon_full_params(with_grads=True, writeback=True) on a sharded strategy: the full gradients
    are shown, and an edit of them is written back into each rank's gradient shard, as FSDP1 does
    (compared through the full gradients seen in a second summon)."""
    rank, w = world()
    out = {}
    for which in ("ours", "theirs"):
        fsdp = _lib(which).FullyShardedDataParallel
        model = _wrap(which, _model())
        x, y = _batch(0)
        _loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        with fsdp.summon_full_params(model, with_grads=True, writeback=True):
            before = [p.grad.clone() for p in model.parameters()]
            for p in model.parameters():
                p.grad *= 3.0
        with fsdp.summon_full_params(model, with_grads=True):
            after = [p.grad.clone() for p in model.parameters()]
        out[which] = {"before": before, "after": after}
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_summon_with_grads_writes_gradient_edits_back(ranks, world_size):
    for r in ranks(world_size).run(_with_grads_writeback):
        ours, theirs = r["ours"], r["theirs"]
        for side in (ours, theirs):  # the edit kept, exactly
            assert all(torch.equal(a, 3.0 * b) for a, b in zip(side["after"], side["before"]))
        if world_size == 2:  # the same reduction order: bit for bit
            assert all(torch.equal(a, b) for a, b in zip(ours["before"], theirs["before"]))
        else:  # a flat reduce-scatter vs per-parameter ones sum 4 float64 values in other orders
            assert max((a - b).abs().max().item() for a, b in zip(ours["before"], theirs["before"])) <= TOL64


def _low_precision_copy_and_replacement() -> dict:
    """keep_low_precision_grads: a model holding its bf16 gradients deep-copies (the copy's
    gradients equal, in bf16: a copy used to fail assigning them); the copy, and a parameter
    replaced by assignment, keep lowering when compiled whole (autograd accumulates there and a
    hook on each parameter lowers: a copy or a replacement gets the hook again)."""
    import copy

    import fully_shard.fsdp1 as lib

    rank, w = world()
    mp = lib.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True)
    model = lib.FullyShardedDataParallel(_model().float(), use_orig_params=True, mixed_precision=mp)
    x, y = _batch(0)
    _loss(model, x.float().chunk(w)[rank], y.float().chunk(w)[rank]).backward()
    twin = copy.deepcopy(model)
    copied = [torch.equal(a.grad.to_local(), b.grad.to_local()) and b.grad.dtype == torch.bfloat16
              for a, b in zip(model.parameters(), twin.parameters())]
    lin = twin[0].lin
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # taken over at once (the copy knows its places)
    twin.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    _loss(compiled, x.float().chunk(w)[rank], y.float().chunk(w)[rank]).backward()
    return {"copied": copied, "dtypes": sorted({str(p.grad.dtype) for p in twin.parameters()}),
            "replaced_lowered": twin[0].lin.weight.grad.dtype == torch.bfloat16}


def test_keep_low_precision_grads_survive_a_deepcopy_and_a_replaced_parameter(ranks):
    for r in ranks(2).run(_low_precision_copy_and_replacement):
        assert r["copied"] and all(r["copied"]), r
        assert r["dtypes"] == ["torch.bfloat16"] and r["replaced_lowered"], r
