"""Issue #28 item 3: ``FlatShard`` (one contiguous range of the flattened parameter per rank, no
row padding). Trains equal to the default layout (to the bit where a sum has at most 2 terms) and
to a single-process float64 reference; all-gathers move the unpadded bytes; state dicts and DCP
checkpoints interchange with the default layout, across world sizes; bad input is refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from _parity import STEPS, TOL64, make_mlp, mlp_batch
from rank_utils import cpu_mesh, global_mean, world


def _flat(param):
    from fully_shard import FlatShard

    return FlatShard()


def _shard(model, flat: bool, mesh=None, reshard=True):
    from fully_shard import fully_shard

    fn = _flat if flat else None
    for block in model[:3]:
        fully_shard(block, mesh=mesh or cpu_mesh(), reshard_after_forward=reshard, shard_placement_fn=fn)
    fully_shard(model, mesh=mesh or cpu_mesh(), shard_placement_fn=fn)
    return model


def _train(model, steps=STEPS, reference=False):
    """AdamW steps on `mlp_batch`: this rank's slice (losses averaged over ranks), or the whole
    batch for the single-process ``reference``."""
    rank, w = (0, 1) if reference else world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = (t.chunk(w)[rank] for t in mlp_batch(step))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if reference else global_mean(loss))
    return losses


def _flat_vs_default(mesh_shape=None, reshard=True) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fully_shard import debug

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    ref = make_mlp()
    flat, default = (
        _shard(copy.deepcopy(ref), True, mesh, reshard),
        _shard(copy.deepcopy(ref), False, mesh, reshard),
    )
    shapes = {n: (tuple(p.shape), p.placements) for n, p in flat.named_parameters()}
    with debug.trace() as t:
        a = _train(flat)
    gathered = sum(r.nbytes for r in t.select(op="all_gather", step=0))
    with debug.trace() as t:
        b = _train(default)
    gathered_default = sum(r.nbytes for r in t.select(op="all_gather", step=0))
    ref_losses = _train(ref, reference=True)
    fs, ds = flat.state_dict(), default.state_dict()
    theirs = dict(ref.named_parameters())
    return {
        "shapes": shapes,
        "losses_equal": a == b,
        "loss_diff_ref": max(abs(x - y) for x, y in zip(a, ref_losses)),
        "state_dict_like_default": all(
            fs[k].shape == ds[k].shape
            and fs[k].placements == ds[k].placements
            and fs[k].to_local().shape == ds[k].to_local().shape
            for k in ds
        ),
        "params_equal": all(torch.equal(fs[k].to_local(), ds[k].to_local()) for k in ds),
        "param_diff_ref": max((fs[k].full_tensor() - theirs[k].detach()).abs().max().item() for k in ds),
        "gathered": gathered,
        "gathered_default": gathered_default,
    }


def _gathered_bytes(w: int, flat: bool) -> int:
    """What one step's forward all-gathers receive at world ``w`` (float64; each block and the root
    once, resharded blocks once more in backward)."""
    if w == 1:
        return 0  # nothing to gather
    model = make_mlp()
    groups = [list(b.parameters()) for b in model[:3]] + [list(model[3].parameters())]
    total = 0
    for i, params in enumerate(groups):
        if flat:
            per_rank = sum(math.ceil(p.numel() / w) for p in params)
        else:
            per_rank = sum(math.ceil(p.shape[0] / w) * (p.numel() // p.shape[0]) for p in params)
        total += w * per_rank * 8 * (2 if i < 3 else 1)  # the root's default keeps its parameters
    return total


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_flat_trains_as_the_default_layout_with_less_padding(ranks, world_size):
    for r in ranks(world_size).run(_flat_vs_default):
        print(f"world {world_size}: {dict((k, v) for k, v in r.items() if k != 'shapes')}")
        # Between steps the module and the optimizer see 1-D DTensors of numel elements.
        assert r["shapes"]["0.0.weight"] == ((91,), (Shard(0),)), r["shapes"]
        assert r["state_dict_like_default"], r
        if world_size <= 2:  # the sums of at most 2 terms: one value whatever the order
            assert r["losses_equal"] and r["params_equal"], r
        assert r["loss_diff_ref"] <= TOL64 and r["param_diff_ref"] <= TOL64, r
        assert r["gathered"] == _gathered_bytes(world_size, True), r
        assert r["gathered_default"] == _gathered_bytes(world_size, False), r
        if world_size == 4:
            assert r["gathered"] < r["gathered_default"], r


def test_flat_on_an_hsdp_mesh_and_kept_after_forward(ranks):
    for r in ranks(4).run(_flat_vs_default, (2, 2), False):
        assert r["shapes"]["0.0.weight"][1] == (torch.distributed.tensor.Replicate(), Shard(0)), r
        assert (
            r["state_dict_like_default"] and r["loss_diff_ref"] <= TOL64 and r["param_diff_ref"] <= TOL64
        ), r


def _dcp(path: str, save_flat: bool, load_flat: bool, saving: bool) -> dict:
    import torch.distributed.checkpoint as dcp

    model = _shard(make_mlp(), save_flat if saving else load_flat)
    if saving:
        _train(model, 2)
        dcp.save(model.state_dict(), checkpoint_id=path)
        return {k: v.full_tensor() for k, v in model.state_dict().items()}
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    out = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # and it trains on from there like the model that saved it would
    return out


@pytest.mark.parametrize("save_flat,load_flat", [(True, False), (False, True), (True, True)])
def test_dcp_checkpoints_interchange_with_the_default_layout_across_world_sizes(
    ranks, tmp_path, save_flat, load_flat
):
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_dcp, path, save_flat, load_flat, True)[0]
    for loaded in ranks(2).run(_dcp, path, save_flat, load_flat, False):
        assert saved.keys() == loaded.keys()
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def _full_state_dict_round_trip() -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    ref = make_mlp()
    model = _shard(copy.deepcopy(ref), True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    equal_to_ref = all(torch.equal(full[k], v.detach()) for k, v in ref.named_parameters())
    full_copy = {k: v.clone() for k, v in full.items()}  # set_model_state_dict distributes in place
    other = make_mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    loaded = _shard(other, True)
    set_model_state_dict(loaded, full, options=StateDictOptions(full_state_dict=True))
    back = {k: v.full_tensor() for k, v in loaded.state_dict().items()}
    # a wrong shape refused with nothing loaded, naming the parameter's own shape
    before = {k: v.full_tensor() for k, v in loaded.state_dict().items()}
    bad = _shard(make_mlp(), True).state_dict()
    bad["0.0.weight"] = torch.zeros(13, 8, dtype=torch.float64)
    try:
        loaded.load_state_dict(bad)
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    still = all(torch.equal(loaded.state_dict()[k].full_tensor(), before[k]) for k in before)
    return {
        "equal_to_ref": equal_to_ref,
        "loaded": all(torch.equal(back[k], full_copy[k]) for k in full_copy),
        "refused": refused,
        "unchanged_after_refusal": still,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_state_dicts_reconstruct_exactly(ranks, world_size):
    for r in ranks(world_size).run(_full_state_dict_round_trip):
        assert r["equal_to_ref"] and r["loaded"] and r["unchanged_after_refusal"], r
        assert "'0.0.weight' is (13, 8), the model's (13, 7)" in r["refused"], r["refused"]


def _tp_refused() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fully_shard import fully_shard

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    try:
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=_flat)
    except ValueError as e:
        return (
            str(e)
            + f" | still a TP DTensor: {isinstance(model[0].weight, DTensor) and model[0].weight.placements}"
        )
    return "no error"


def test_flat_shard_of_a_tensor_parallel_parameter_is_refused_with_the_fix(ranks):
    for message in ranks(2).run(_tp_refused):
        assert "returned FlatShard() for parameter '0.weight', a tensor-parallel DTensor" in message, message
        assert "Fix: return None or Shard(dim)" in message and "(Shard(dim=0),)" in message, message


def _codec_refused() -> str:
    from fully_shard.quant import Int8AllGather

    model = _shard(make_mlp().float(), True)
    try:
        model.set_all_gather_codec(Int8AllGather())
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_all_gather_codec_on_flat_parameters_is_refused_with_the_fix(ranks):
    for message in ranks(2).run(_codec_refused):
        assert (
            "parameter '3.weight' is sharded flat (codecs gather dim-0 shards); nothing was changed"
            in message
        ), message
        assert "Fix: leave it out" in message, message


def _meta_init() -> dict:
    from fully_shard import unsharded

    out = {}
    for flat in (True, False):
        with torch.device("meta"):
            model = make_mlp()
        _shard(model, flat)
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        # Module code that reads a flat parameter between steps sees the 1-D shard: initialise
        # inside unsharded(writeback=True), where every parameter has its own shape.
        with unsharded(model, writeback=True):
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.reset_parameters()
        out[flat] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"equal": all(torch.equal(out[True][k], out[False][k]) for k in out[False])}


@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_init_inside_unsharded_equals_the_default_layout(ranks, world_size):
    for r in ranks(world_size).run(_meta_init):
        assert r["equal"], r


def _through_checkpoint_wrapper(where: str) -> dict:
    """torch's checkpoint_wrapper renames state-dict keys with hooks of its own: ``where`` "wrapper"
    shards the wrapper (torchtitan), "root" only the root over wrapped blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fully_shard import fully_shard

    out = {}
    for flat in (True, False):
        model = make_mlp()
        for i in range(3):
            model[i] = checkpoint_wrapper(model[i])
            if where == "wrapper":
                fully_shard(model[i], shard_placement_fn=_flat if flat else None)
        fully_shard(model, shard_placement_fn=_flat if flat else None)
        _train(model, 2)
        out[flat] = model
    sd_flat, sd_default = out[True].state_dict(), out[False].state_dict()
    same = sd_flat.keys() == sd_default.keys() and all(
        sd_flat[k].shape == sd_default[k].shape
        and torch.equal(sd_flat[k].full_tensor(), sd_default[k].full_tensor())
        for k in sd_default
    )
    out[True].load_state_dict(sd_default)  # the default layout's state dict into the flat model
    back = out[True].state_dict()
    return {
        "same": same,
        "loaded": all(torch.equal(back[k].full_tensor(), sd_default[k].full_tensor()) for k in back),
    }


@pytest.mark.parametrize("where", ["wrapper", "root"])
def test_flat_state_dicts_through_checkpoint_wrapper(ranks, where):
    for r in ranks(2).run(_through_checkpoint_wrapper, where):
        assert r["same"] and r["loaded"], r


def _steps(model, opt, steps, first=0):
    rank, w = world()
    for step in range(first, first + steps):
        x, y = (t.chunk(w)[rank] for t in mlp_batch(step))
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_state(opt) -> dict:
    """The optimizer's state dict, tensors full (keys: index, state name)."""
    out = {}
    for index, entry in opt.state_dict()["state"].items():
        for k, v in entry.items():
            out[(index, k)] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()  # (may be live)
    return out


def _optim_dcp(path: str, save_flat: bool, load_flat: bool, saving: bool) -> dict:
    """Model and optimizer through DCP, the way torchtitan checkpoints (`get_*_state_dict`, then
    `set_*_state_dict`): saved after 2 steps, loaded into a fresh run (another layout and world
    size), which then steps once more. Returns the full optimizer state as saved / as loaded,
    and after the extra step the full parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _shard(make_mlp(), save_flat if saving else load_flat)
    opt = _adamw(model)
    if saving:
        _steps(model, opt, 2)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
        return {"optim": _full_state(opt)}
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _full_state(opt)
    live = {name: tuple(v.shape) for name, v in opt.state[next(iter(model.parameters()))].items()}
    _steps(model, opt, 1, first=2)
    return {
        "optim": loaded,
        "live": live,
        "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("save_flat,load_flat", [(True, False), (False, True), (True, True)])
def test_optimizer_checkpoints_interchange_with_the_default_layout_across_world_sizes(
    ranks, tmp_path, save_flat, load_flat
):
    """Saved at world 4, loaded at world 2 into either layout: the optimizer state equals the
    saved one to the bit, and the flat run's next step equals the default layout's from the same
    checkpoint (to the bit: world 2)."""
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_optim_dcp, path, save_flat, load_flat, True)[0]
    loaded = ranks(2).run(_optim_dcp, path, save_flat, load_flat, False)
    reference = loaded[0] if not load_flat else ranks(2).run(_optim_dcp, path, save_flat, False, False)[0]
    for r in loaded:
        assert saved["optim"].keys() == r["optim"].keys()
        assert all(torch.equal(saved["optim"][k], r["optim"][k]) for k in saved["optim"]), r["optim"]
        # the flat run steps its state as the 1-D DTensor the parameter is
        assert r["live"]["exp_avg"] == ((91,) if load_flat else (13, 7)), r["live"]
        assert all(torch.equal(reference["params"][k], r["params"][k]) for k in reference["params"])


def _optim_round_trip() -> dict:
    """`optimizer.state_dict()` of a flat run shows the default layout's form (equal to a default
    run's); loaded with plain `load_state_dict` into a fresh optimizer before its first step (then
    taken to the flat form by that step), and after one (through the load hook), it steps on as
    the original does."""
    ref = make_mlp()
    flat_model, default_model = _shard(copy.deepcopy(ref), True), _shard(copy.deepcopy(ref), False)
    flat_opt, default_opt = _adamw(flat_model), _adamw(default_model)
    _steps(flat_model, flat_opt, 2)
    _steps(default_model, default_opt, 2)
    shown, default_shown = _full_state(flat_opt), _full_state(default_opt)
    shapes = {k: tuple(v.shape) for k, v in flat_opt.state_dict()["state"][0].items()}
    saved = flat_opt.state_dict()
    model_state = {k: v.detach().clone() for k, v in flat_model.state_dict().items()}
    results = {}
    for when in ("before_first_step", "after_a_step", "full_flat"):
        model = _shard(make_mlp(), True)
        model.load_state_dict(model_state)
        opt = _adamw(model)
        if when == "after_a_step":  # the load hook installed by a first step, of zero learning rate
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.param_groups[0]["lr"] = 1e-2
            opt.zero_grad()
        given = copy.deepcopy(saved)  # (load_state_dict keeps the tensors it is given)
        if when == "full_flat":  # the matrices' state as full 1-D tensors (the flat form's full state)
            for entry in given["state"].values():
                for k, v in entry.items():
                    if v.dim() == 2:
                        entry[k] = v.full_tensor().reshape(-1)
        opt.load_state_dict(given)
        _steps(model, opt, 1, first=2)
        results[when] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    _steps(flat_model, flat_opt, 1, first=2)
    after = {k: v.full_tensor() for k, v in flat_model.state_dict().items()}
    return {
        "shapes": shapes,
        "state_equal_default": all(torch.equal(shown[k], default_shown[k]) for k in shown),
        "state_diff_default": max(float((shown[k] - default_shown[k]).abs().max()) for k in shown),
        "continued": {when: all(torch.equal(after[k], r[k]) for k in after) for when, r in results.items()},
    }


def _assert_default_form(r: dict, world_size: int) -> None:
    """A flat run's optimizer state as shown: the default layout's shapes and values."""
    assert r["shapes"] == {"step": (), "exp_avg": (13, 7), "exp_avg_sq": (13, 7)}, r
    if world_size <= 2:  # the sums of at most 2 terms: one value whatever the order
        assert r["state_equal_default"], r
    assert r["state_diff_default"] <= TOL64, r


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_optimizer_state_dicts_show_the_default_layout_and_load_back(ranks, world_size):
    for r in ranks(world_size).run(_optim_round_trip):
        _assert_default_form(r, world_size)
        assert r["continued"] == {"before_first_step": True, "after_a_step": True, "full_flat": True}, r


def _optimizer_compiled_after_an_eager_step() -> dict:
    """The recipe of docs/planning.md for a compiled optimizer step: its first step eager (our step
    pre-hook puts on the flat-state hooks there; under compile it stands aside, so a step compiled
    from the first would show the 1-D form), then ``torch.compile(opt.step)``: the state dict shows
    the default layout's form, equal to a default-layout run stepped the same way; no new graph
    after the first compiled step."""
    from torch._dynamo.utils import counters

    from test_traced import _fresh_compiler

    _fresh_compiler()
    ref = make_mlp()
    out = {}
    for flat in (True, False):
        model = _shard(copy.deepcopy(ref), flat)
        opt = _adamw(model)
        _steps(model, opt, 1)
        eager_step = opt.step
        opt.step = torch.compile(eager_step, backend="aot_eager")
        graphs = []
        for step in range(1, 4):
            _steps(model, opt, 1, first=step)
            graphs.append(counters["stats"]["unique_graphs"])
        opt.step = eager_step
        shapes = {k: tuple(v.shape) for k, v in opt.state_dict()["state"][0].items()}
        out[flat] = (_full_state(opt), shapes, graphs)
        counters.clear()
    flat_state, default_state = out[True][0], out[False][0]
    return {
        "shapes": out[True][1],
        "state_diff_default": max(float((flat_state[k] - default_state[k]).abs().max()) for k in default_state),
        "state_equal_default": all(torch.equal(flat_state[k], default_state[k]) for k in default_state),
        "graphs_after_each_compiled_step": [g for _, _, g in out.values()],
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_an_optimizer_compiled_after_an_eager_step_shows_the_default_layout(ranks, world_size):
    for r in ranks(world_size).run(_optimizer_compiled_after_an_eager_step):
        _assert_default_form(r, world_size)
        assert r["graphs_after_each_compiled_step"] == [[1, 1, 1], [1, 1, 1]], r  # the step's body, once


def _full_optim_state(hsdp: bool, broadcast: bool) -> dict:
    """`get_optimizer_state_dict(full_state_dict=True)` of a flat run: each state in its parameter's
    shape, equal to the default layout's (float64 rounding at world 4); loaded back with
    `set_optimizer_state_dict` (from rank 0 only when ``broadcast``), the next step equals the
    original's."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    ref = make_mlp()
    flat_model, default_model = (
        _shard(copy.deepcopy(ref), True, mesh),
        _shard(copy.deepcopy(ref), False, mesh),
    )
    flat_opt, default_opt = _adamw(flat_model), _adamw(default_model)
    _steps(flat_model, flat_opt, 2)
    _steps(default_model, default_opt, 2)
    options = StateDictOptions(full_state_dict=True)
    full, default = (
        get_optimizer_state_dict(flat_model, flat_opt, options=options),
        get_optimizer_state_dict(default_model, default_opt, options=options),
    )
    shapes = {k: tuple(v.shape) for k, v in full["state"]["0.0.weight"].items()}
    diff = max(
        float((full["state"][n][k] - v).abs().max())
        for n in default["state"]
        for k, v in default["state"][n].items()
    )
    model = _shard(copy.deepcopy(ref), True, mesh)
    model.load_state_dict({k: v.detach().clone() for k, v in flat_model.state_dict().items()})
    opt = _adamw(model)
    given = copy.deepcopy(full) if not broadcast or world()[0] == 0 else {}
    set_optimizer_state_dict(
        model, opt, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    )
    _steps(model, opt, 1, first=2)
    _steps(flat_model, flat_opt, 1, first=2)
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), flat_model.parameters())
    )
    return {"shapes": shapes, "diff_default": diff, "continued": same}


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_full_optimizer_state_dicts_and_broadcast_from_rank0(ranks, hsdp):
    for broadcast in (False, True):
        for r in ranks(4).run(_full_optim_state, hsdp, broadcast):
            assert r["shapes"] == {"step": (), "exp_avg": (13, 7), "exp_avg_sq": (13, 7)}, r
            assert r["diff_default"] <= TOL64 and r["continued"], r


def _broadcast_into_materialized() -> str:
    """The stated limit: `set_model_state_dict(..., broadcast_from_rank0=True)` into a flat-sharded
    model whose parameters hold memory fails inside torch (it copies rank 0's rows straight into
    each live 1-D local tensor, before any hook of ours runs). Every rank raises at the same
    entry, so none waits in a broadcast the others never join (no hang)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = make_mlp()
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = _shard(copy.deepcopy(ref), True)
    given = full if world()[0] == 0 else {}
    try:
        set_model_state_dict(
            model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
    except RuntimeError as e:  # torch's copy: a size or broadcast-shape mismatch, not a timeout
        message = str(e)
        mismatch = "must match the size" in message or "doesn't match the broadcast shape" in message
        return f"{type(e).__name__}: {'shape mismatch' if mismatch else message}"
    return "loaded"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broadcast_from_rank0_into_a_materialized_flat_model_raises_on_every_rank(ranks, world_size):
    results = ranks(world_size).run(_broadcast_into_materialized)
    assert results == ["RuntimeError: shape mismatch"] * world_size, results


def _broadcast_into_meta(hsdp: bool = False) -> dict:
    """`set_model_state_dict(..., broadcast_from_rank0=True)` into a model built on the meta device
    and flat-sharded (rank 0 holds the full state dict): torch hands each parameter's rows in the
    flat global shape (its placements applied to the full tensor); loaded as the default layout's
    rows. Then it trains equal to the flat-sharded model built from the same weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    ref = make_mlp()
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        model = make_mlp()
    _shard(model, True, mesh)
    given = {k: v.clone() for k, v in full.items()} if world()[0] == 0 else {}
    set_model_state_dict(
        model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    loaded = all(torch.equal(v.full_tensor(), full[k]) for k, v in model.state_dict().items())
    flat_live = {n: tuple(p.shape) for n, p in model.named_parameters()}["0.0.weight"]
    built = _shard(copy.deepcopy(ref), True, mesh)
    same_losses = _train(model, 2) == _train(built, 2)
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), built.parameters())
    )
    return {"loaded": loaded, "flat_live": flat_live, "trains_the_same": same_losses and same}


@pytest.mark.parametrize("world_size,hsdp", [(1, False), (2, False), (4, False), (4, True)])
def test_broadcast_from_rank0_into_a_meta_device_model(ranks, world_size, hsdp):
    for r in ranks(world_size).run(_broadcast_into_meta, hsdp):
        assert r == {"loaded": True, "flat_live": (91,), "trains_the_same": True}, r
