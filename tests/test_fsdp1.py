"""FSDP1 on our engine (issue #13): ``fully_shard.fsdp1.FullyShardedDataParallel`` against
PyTorch's ``FullyShardedDataParallel(use_orig_params=True)`` built with the same arguments.

At world 2 the two reduce each element as one sum of two terms (and divide by powers of two),
so losses and parameters are compared bit for bit; at world 4 gloo's summation order depends on
the buffer layout (FSDP1's flat parameters differ from ours), so both are compared with the
float64 single-process reference instead.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _parity import TOL64, check
from rank_utils import global_mean, world


class Block(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.lin = nn.Linear(a, b)
        self.norm = nn.LayerNorm(b)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


def _model(dtype: torch.dtype) -> nn.Module:
    """Blocks with dims dividing by neither 2 nor 4, and a head outside every block."""
    torch.manual_seed(0)
    return nn.Sequential(Block(7, 13), Block(13, 11), Block(11, 5), nn.Linear(5, 3)).to(dtype)


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)


def _libs():
    import torch.distributed.fsdp as theirs
    import torch.distributed.fsdp.wrap as theirs_wrap

    import fully_shard.fsdp1 as ours
    import fully_shard.fsdp1.wrap as ours_wrap

    return {"ours": (ours, ours_wrap), "theirs": (theirs, theirs_wrap)}


def _kwargs(lib, wrap, case: dict, mesh) -> dict:
    kwargs: dict = {"sharding_strategy": lib.ShardingStrategy[case.get("strategy", "FULL_SHARD")], "use_orig_params": True}
    policy = case.get("policy", "module")
    if policy == "module":
        kwargs["auto_wrap_policy"] = wrap.ModuleWrapPolicy({Block})
    elif policy == "transformer":
        kwargs["auto_wrap_policy"] = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    elif policy == "size":
        kwargs["auto_wrap_policy"] = functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=100)
    elif policy == "custom":
        kwargs["auto_wrap_policy"] = wrap.CustomPolicy(lambda m: isinstance(m, Block) and m.lin.in_features != 13)
    if "mp" in case:
        kwargs["mixed_precision"] = lib.MixedPrecision(param_dtype=case["mp"], reduce_dtype=case.get("reduce", case["mp"]))
    if case.get("offload"):
        kwargs["cpu_offload"] = lib.CPUOffload(offload_params=True)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    if case.get("forward_prefetch"):
        kwargs["forward_prefetch"] = True
    return kwargs


def _train(model, opt, case: dict, dtype: torch.dtype, steps: int, split) -> list[float]:
    rank, w = split
    micro = case.get("no_sync", 1)
    losses = []
    for step in range(steps):
        x, y = _batch(step, dtype)
        x, y = x.chunk(w)[rank], y.chunk(w)[rank]
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
            with ctx:
                loss = ((model(xm) - ym) ** 2).mean() / micro
                loss.backward()
            total += loss.item()
        if case.get("clip"):
            norm = model.clip_grad_norm_(0.05) if hasattr(model, "clip_grad_norm_") else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            case.setdefault("_norms", []).append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _full(lib, model) -> dict:
    with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def _fsdp1_parity(case: dict) -> dict:
    """Ours and PyTorch's FSDP1 with the same arguments (and a float64 reference) on the same data."""
    rank, w = world()
    dtype = case.get("dtype", torch.float64)
    mesh = None
    if case.get("strategy", "").startswith("HYBRID") or case.get("strategy") == "_HYBRID_SHARD_ZERO2":
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    for tag, (lib, wrap) in _libs().items():
        # PyTorch's FSDP1 cannot run these on CPU in float64: CPUOffload pins memory (needs an
        # accelerator), clip_grad_norm_ asks vector_norm for float32 (refused for float64 grads).
        if tag == "theirs" and (case.get("offload") or case.get("clip")):
            continue
        extra = {} if tag == "ours" else {"device_id": torch.device("cpu")}
        model = lib.FullyShardedDataParallel(_model(dtype), **_kwargs(lib, wrap, case, mesh), **extra)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        c = dict(case)
        from fully_shard import debug

        with debug.trace() as trace:
            losses = _train(model, opt, c, dtype, 3, (rank, w))
        if tag == "ours":  # step 0 records the order; then blocks 0 and 1 each prefetch the next
            results["prefetches"] = [trace.count(phase="forward_prefetch", step=s) for s in range(3)]
        wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, lib.FullyShardedDataParallel))
        results[tag] = {"losses": losses, "state": _full(lib, model), "norms": c.get("_norms", []),
                        "wrapped": [n.replace("_fsdp_wrapped_module.", "") for n in wrapped]}
    ref = _model(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    c = dict(case)
    ref_losses = _train(ref, ref_opt, c, dtype, 3, (0, 1))
    ours = results["ours"]
    theirs = results.get("theirs", ours)
    ref_sd = ref.state_dict()
    return {
        "vs_torch_loss": max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])),
        "vs_torch_param": max((ours["state"][k] - theirs["state"][k]).abs().max().item() for k in theirs["state"]),
        "same_keys": list(ours["state"]) == list(theirs["state"]) == list(ref_sd),
        "wrapped": (ours["wrapped"], theirs["wrapped"]),
        "loss_diff": max(abs(global_mean(torch.tensor(a, dtype=torch.float64)) - b) for a, b in zip(ours["losses"], ref_losses)),
        "param_diff": max((ours["state"][k].to(ref_sd[k].dtype) - ref_sd[k]).abs().max().item() for k in ref_sd),
        "norms": (ours["norms"], theirs["norms"], c.get("_norms", [])),
        "prefetches": results["prefetches"],
    }


CASES = {
    "full_shard": {"strategy": "FULL_SHARD"},
    "shard_grad_op": {"strategy": "SHARD_GRAD_OP", "policy": "transformer"},
    "no_shard": {"strategy": "NO_SHARD", "policy": "size"},
    "custom_policy": {"strategy": "FULL_SHARD", "policy": "custom"},
    "no_sync": {"strategy": "FULL_SHARD", "no_sync": 2},
    "offload": {"strategy": "FULL_SHARD", "offload": True},  # these two: ours vs the reference only (see _fsdp1_parity)
    "clip": {"strategy": "FULL_SHARD", "clip": True},
    "forward_prefetch": {"strategy": "FULL_SHARD", "forward_prefetch": True},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp1_matches_pytorch_fsdp1(ranks, world_size, name):
    case = CASES[name]
    results = ranks(world_size).run(_fsdp1_parity, case)
    check(results, f"fsdp1 {name} world {world_size} vs single process (float64)")
    for r in results:
        assert r["same_keys"], r
        assert r["wrapped"][0] == r["wrapped"][1], r  # the policy chose the same modules
        if world_size == 2 and not case.get("clip"):
            assert r["vs_torch_loss"] == 0.0 and r["vs_torch_param"] == 0.0, r
        if case.get("forward_prefetch"):
            assert r["prefetches"] == [0, 2, 2], r
        if case.get("clip"):  # the norm returned is the global one (the reference's, float64)
            ours, _, ref = r["norms"]
            assert len(ours) == len(ref) == 3 and max(abs(a - b) for a, b in zip(ours, ref)) <= TOL64, r


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_fsdp1_hybrid_matches_reference(ranks, strategy):
    results = ranks(4).run(_fsdp1_parity, {"strategy": strategy})
    check(results, f"fsdp1 {strategy} 2x2 vs single process (float64)")
    for r in results:
        assert r["same_keys"] and r["wrapped"][0] == r["wrapped"][1], r


def test_fsdp1_bf16_mixed_precision_is_pytorch_bit_for_bit(ranks):
    for r in ranks(2).run(_fsdp1_parity, {"strategy": "FULL_SHARD", "mp": torch.bfloat16, "dtype": torch.float32}):
        assert r["vs_torch_loss"] == 0.0 and r["vs_torch_param"] == 0.0, r


def test_fsdp1_no_sync_with_bf16_params_and_fp32_reduction_is_pytorch_bit_for_bit(ranks):
    """FSDP1's no_sync sums the unsharded gradients in the param dtype (bf16), cast to the reduce
    dtype only for the reduction (FSDP2 sums them in the reduce dtype: tests/test_mixed_precision.py)."""
    case = {"strategy": "FULL_SHARD", "mp": torch.bfloat16, "reduce": torch.float32, "dtype": torch.float32,
            "no_sync": 2}
    for r in ranks(2).run(_fsdp1_parity, case):
        assert r["vs_torch_loss"] == 0.0 and r["vs_torch_param"] == 0.0, r


# -- state dicts ------------------------------------------------------------------------------------


def _trained(lib, seed: int = 0, steps: int = 2, **extra):
    """An FSDP1 model (ours or PyTorch's: ``lib``) trained ``steps`` steps, with its optimizer."""
    rank, w = world()
    wrap = _libs()["ours" if lib.__name__.startswith("fully_shard") else "theirs"][1]
    model = _model(torch.float64)
    if seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            torch.nn.init.normal_(p)
    model = lib.FullyShardedDataParallel(model, auto_wrap_policy=wrap.ModuleWrapPolicy({Block}), use_orig_params=True, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, {}, torch.float64, steps, (rank, w))
    return model, opt


def _round_trips() -> dict:
    """Each state-dict type saved from one trained model and loaded into a differently initialised
    one: the parameters and the next steps equal the original's."""
    import fully_shard.fsdp1 as ours

    rank, w = world()
    out = {}
    kinds = {
        "full": (ours.StateDictType.FULL_STATE_DICT, ours.FullStateDictConfig(), ours.FullOptimStateDictConfig(offload_to_cpu=False)),
        "full_rank0_cpu": (ours.StateDictType.FULL_STATE_DICT, ours.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                           ours.FullOptimStateDictConfig(rank0_only=True)),
        "sharded": (ours.StateDictType.SHARDED_STATE_DICT, None, None),
        "local": (ours.StateDictType.LOCAL_STATE_DICT, None, None),
    }
    source, source_opt = _trained(ours)
    for name, (kind, cfg, ocfg) in kinds.items():
        with ours.FullyShardedDataParallel.state_dict_type(source, kind, cfg, ocfg):
            msd = source.state_dict()
            osd = ours.FullyShardedDataParallel.optim_state_dict(source, source_opt)
        msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)  # as a checkpoint would hold them: nothing shared
        target, target_opt = _trained(ours, seed=7, steps=1)
        empty = name == "full_rank0_cpu" and rank != 0
        if empty:
            out[name + "_empty_on_others"] = msd == {} and osd == {}
        on_cpu = all(v.device.type == "cpu" for v in msd.values())
        load_msd = msd
        if name == "full_rank0_cpu":  # model: every rank loads the full dict (FSDP1's rule); rank 0 sends it
            box = [msd if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            load_msd = box[0]
        with ours.FullyShardedDataParallel.state_dict_type(target, kind, cfg, ocfg):
            target.load_state_dict(load_msd)
            target_opt.load_state_dict(ours.FullyShardedDataParallel.optim_state_dict_to_load(target, target_opt, osd))
        a, b = _full(ours, source), _full(ours, target)
        same_params = all(torch.equal(a[k], b[k]) for k in a)
        # One more step on the same data: equal optimizer state gives equal results.
        for m, o in ((source, source_opt), (target, target_opt)):
            _train(m, o, {}, torch.float64, 1, (rank, w))
        a, b = _full(ours, source), _full(ours, target)
        out[name] = (same_params, all(torch.equal(a[k], b[k]) for k in a), on_cpu or name != "full_rank0_cpu")
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fsdp1_state_dict_types_round_trip(ranks, world_size):
    for r in ranks(world_size).run(_round_trips):
        for name in ("full", "full_rank0_cpu", "sharded", "local"):
            assert r[name] == (True, True, True), (name, r)
        assert r.get("full_rank0_cpu_empty_on_others", True), r


def _interchange() -> dict:
    """FULL model and optimizer state dicts between our fsdp1, PyTorch's FSDP1 and a plain model.

    Ours -> PyTorch's: PyTorch's model loaded from ours trains on exactly like ours. PyTorch's ->
    ours: what ours holds after loading equals what PyTorch saved, bit for bit. (Not compared by
    training on: on CPU/gloo, torch 2.13's FSDP1 ``optim_state_dict`` saves AdamW's ``exp_avg_sq``
    under ``exp_avg``, so PyTorch's own round trip trains differently from the model it saved.)"""
    import torch.distributed.fsdp as theirs

    import fully_shard.fsdp1 as ours

    rank, w = world()
    cpu = {"device_id": torch.device("cpu")}
    out = {}
    for direction in ("ours_to_theirs", "theirs_to_ours"):
        (src_lib, src_kw), (dst_lib, dst_kw) = ((ours, {}), (theirs, cpu)) if direction == "ours_to_theirs" else ((theirs, cpu), (ours, {}))
        src, src_opt = _trained(src_lib, **src_kw)
        dst, dst_opt = _trained(dst_lib, seed=7, steps=1, **dst_kw)
        with src_lib.FullyShardedDataParallel.state_dict_type(src, src_lib.StateDictType.FULL_STATE_DICT):
            msd = src.state_dict()
            osd = src_lib.FullyShardedDataParallel.optim_state_dict(src, src_opt)
        msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
        with dst_lib.FullyShardedDataParallel.state_dict_type(dst, dst_lib.StateDictType.FULL_STATE_DICT):
            dst.load_state_dict(msd)
            dst_opt.load_state_dict(dst_lib.FullyShardedDataParallel.optim_state_dict_to_load(dst, dst_opt, copy.deepcopy(osd)))
            loaded = dst_lib.FullyShardedDataParallel.optim_state_dict(dst, dst_opt)
        held = _full(dst_lib, dst)
        out[direction + "_held"] = (
            all(torch.equal(held[k], v) for k, v in msd.items()),
            all(torch.equal(loaded["state"][n][k], v) for n, entry in osd["state"].items() for k, v in entry.items()),
        )
        if direction == "ours_to_theirs":
            for m, o in ((src, src_opt), (dst, dst_opt)):  # one more step each, on the same data
                _train(m, o, {}, torch.float64, 1, (rank, w))
            a, b = _full(src_lib, src), _full(dst_lib, dst)
            out[direction] = max((a[k] - b[k]).abs().max().item() for k in a)
    ours_model, _ = _trained(ours)
    plain = _model(torch.float64)
    with ours.FullyShardedDataParallel.state_dict_type(ours_model, ours.StateDictType.FULL_STATE_DICT):
        result = plain.load_state_dict(ours_model.state_dict())  # strict: the same names, full tensors
    full = _full(ours, ours_model)
    out["plain"] = (not result.missing_keys and not result.unexpected_keys,
                    all(torch.equal(full[k], v) for k, v in plain.state_dict().items()))
    return out


def test_fsdp1_full_state_dicts_interchange_with_pytorch_fsdp1_and_plain_models(ranks):
    for r in ranks(2).run(_interchange):
        assert r["ours_to_theirs"] == 0.0, r
        assert r["theirs_to_ours_held"] == (True, True), r
        # PyTorch's re-save of what it loaded shows its exp_avg bug, so only its model is compared;
        # training on (above) shows it holds our optimizer state exactly.
        assert r["ours_to_theirs_held"][0], r
        assert r["plain"] == (True, True), r


def _dcp_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import fully_shard.fsdp1 as ours

    model, opt = _trained(ours)
    with ours.FullyShardedDataParallel.state_dict_type(model, ours.StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": ours.FullyShardedDataParallel.optim_state_dict(model, opt)},
                 checkpoint_id=path)


def _dcp_load(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import fully_shard.fsdp1 as ours

    rank, w = world()
    model, opt = _trained(ours, seed=7, steps=1)
    with ours.FullyShardedDataParallel.state_dict_type(model, ours.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": ours.FullyShardedDataParallel.optim_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(ours.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, state["optim"]))
    losses = []
    for step in range(2, 4):  # the steps an uninterrupted run takes next
        x, y = _batch(step, torch.float64)
        loss = ((model(x.chunk(w)[rank]) - y.chunk(w)[rank]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    ref = _model(torch.float64)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = _train(ref, ref_opt, {}, torch.float64, 4, (0, 1))[2:]
    full, ref_sd = _full(ours, model), ref.state_dict()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd)}


@pytest.mark.parametrize("save_world,load_world", [(2, 4), (4, 1)])
def test_fsdp1_sharded_state_dict_with_dcp_across_world_sizes(ranks, tmp_path, save_world, load_world):
    ranks(save_world).run(_dcp_save, str(tmp_path))
    check(ranks(load_world).run(_dcp_load, str(tmp_path)), f"fsdp1 sharded dcp {save_world} -> {load_world}")


def _legacy_optim() -> dict:
    """FSDP1's older optimizer state-dict functions: each round trip lands the same optimizer state
    in a second model's optimizer (compared through optim_state_dict, bit for bit); rekeying to
    positions gives PyTorch's FSDP1 positions for the same model."""
    import torch.distributed.fsdp as theirs

    import fully_shard.fsdp1 as ours

    F = ours.FullyShardedDataParallel
    rank, w = world()
    model, opt = _trained(ours)
    with F.state_dict_type(model, ours.StateDictType.FULL_STATE_DICT, None, ours.FullOptimStateDictConfig(offload_to_cpu=False)):
        expected = copy.deepcopy(F.optim_state_dict(model, opt))

    def landed(load) -> bool:
        target, target_opt = _trained(ours, seed=7, steps=1)
        target_opt.load_state_dict(load(target, target_opt))
        with F.state_dict_type(target, ours.StateDictType.FULL_STATE_DICT, None, ours.FullOptimStateDictConfig(offload_to_cpu=False)):
            got = F.optim_state_dict(target, target_opt)
        return got["param_groups"] == expected["param_groups"] and all(
            torch.equal(got["state"][n][k], v) for n, entry in expected["state"].items() for k, v in entry.items())

    full = copy.deepcopy(F.full_optim_state_dict(model, opt, rank0_only=False))
    rank0 = copy.deepcopy(F.full_optim_state_dict(model, opt))
    sharded = copy.deepcopy(F.sharded_optim_state_dict(model, opt))
    by_id = F.rekey_optim_state_dict(full, ours.OptimStateKeyType.PARAM_ID, model)
    theirs_model, _ = _trained(theirs, device_id=torch.device("cpu"))
    theirs_ids = theirs.FullyShardedDataParallel.rekey_optim_state_dict(
        full, theirs.OptimStateKeyType.PARAM_ID, theirs_model)
    return {
        "rank0_only_empty": (rank0 == {}) == (rank != 0),
        "shard_full": landed(lambda m, o: F.shard_full_optim_state_dict(full, m, optim=o)),
        "shard_full_by_id": landed(lambda m, o: F.shard_full_optim_state_dict(by_id, m, optim=o)),
        "scatter": landed(lambda m, o: F.scatter_full_optim_state_dict(rank0 if rank == 0 else None, m, optim=o)),
        "flatten": landed(lambda m, o: F.flatten_sharded_optim_state_dict(sharded, m, o)),
        "ids_like_pytorch": (sorted(by_id["state"]) == sorted(theirs_ids["state"])
                             and by_id["param_groups"][0]["params"] == theirs_ids["param_groups"][0]["params"]
                             and all(torch.equal(by_id["state"][i]["exp_avg"], theirs_ids["state"][i]["exp_avg"]) for i in by_id["state"])),
        "rekey_back": F.rekey_optim_state_dict(by_id, ours.OptimStateKeyType.PARAM_NAME, model)["param_groups"] == full["param_groups"],
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp1_legacy_optimizer_state_dict_functions(ranks, world_size):
    for r in ranks(world_size).run(_legacy_optim):
        assert all(r.values()), r


# -- the rest of the surface -----------------------------------------------------------------------


def _surface() -> dict:
    import fully_shard.fsdp1 as ours

    F = ours.FullyShardedDataParallel
    rank, w = world()
    out: dict = {}
    model, opt = _trained(ours)
    out["fsdp_modules"] = (len(F.fsdp_modules(model)), F.fsdp_modules(model, root_only=True) == [model])
    out["roots"] = (model.check_is_root(), [m.check_is_root() for m in F.fsdp_modules(model)[1:]])
    ref_shapes = {n: tuple(p.shape) for n, p in _model(torch.float64).named_parameters()}
    before = _full(ours, model)
    # summon_full_params: full tensors in place; writeback keeps edits, writeback=False drops them.
    with F.summon_full_params(model):
        shapes = {n.replace("_fsdp_wrapped_module.", ""): tuple(p.shape) for n, p in model.named_parameters()}
        with torch.no_grad():
            model.module[3].weight.add_(1.0)
    out["summon_shapes"] = shapes == ref_shapes
    after = _full(ours, model)
    out["writeback"] = torch.equal(after["3.weight"], before["3.weight"] + 1.0)
    with F.summon_full_params(model, writeback=False):
        with torch.no_grad():
            model.module[3].weight.add_(1.0)
    out["no_writeback"] = torch.equal(_full(ours, model)["3.weight"], after["3.weight"])
    with F.summon_full_params(model, rank0_only=True, writeback=False):
        weight = model.module[0].module.lin.weight
        out["rank0_only"] = (tuple(weight.shape), hasattr(weight, "device_mesh"))
    with F.summon_full_params(model, recurse=False, writeback=False):
        out["recurse_false"] = (tuple(model.module[3].weight.shape) == (3, 5), hasattr(model.module[0].module.lin.weight, "device_mesh"))
    # with_grads: the full gradients next to the full parameters.
    x, y = _batch(0, torch.float64)
    ((model(x.chunk(w)[rank]) - y.chunk(w)[rank]) ** 2).mean().backward()
    expected_grad = model.module[3].weight.grad.full_tensor()
    with F.summon_full_params(model, with_grads=True, writeback=False):
        out["with_grads"] = torch.equal(model.module[3].weight.grad, expected_grad)
    opt.zero_grad()
    # apply: fn sees the full parameters, and what it writes stays.
    model.apply(lambda m: torch.nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)
    full = _full(ours, model)
    out["apply"] = all(not full[k].any() for k in full if k.endswith("lin.bias") or k == "3.bias")
    # ignored_modules: left alone (a plain parameter, not sharded).
    plain = _model(torch.float64)
    m3 = F(plain, ignored_modules=[plain[3]])
    out["ignored"] = (not hasattr(m3.module[3].weight, "device_mesh"), hasattr(m3.module[0].lin.weight, "device_mesh"))
    return out


def test_fsdp1_surface(ranks):
    for rank, r in enumerate(ranks(2).run(_surface)):
        assert r["rank0_only"] == ((13, 7), rank != 0), r  # the others see their sharded DTensor again
        assert r["fsdp_modules"] == (4, True), r
        assert r["roots"] == (True, [False, False, False]), r
        for key in ("summon_shapes", "writeback", "no_writeback", "with_grads", "apply"):
            assert r[key], (key, r)
        assert r["recurse_false"] == (True, True), r
        assert r["ignored"] == (True, True), r


def _init_and_sync() -> dict:
    """Meta-device init through param_init_fn, reset_parameters + sync_module_states, enable_wrap
    / wrap, PyTorch's own enums and configs, a process group, buffer_dtype."""
    import torch.distributed.fsdp as theirs

    import fully_shard.fsdp1 as ours
    from fully_shard.fsdp1.wrap import ModuleWrapPolicy, enable_wrap, wrap

    F = ours.FullyShardedDataParallel
    rank, w = world()
    out: dict = {}

    def init(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        for name, p in m.named_parameters(recurse=False):
            torch.nn.init.constant_(p, 0.5 if name == "weight" else -0.25)

    with torch.device("meta"):
        meta = _model(torch.float64)
    model = F(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=init)
    full = _full(ours, model)
    out["param_init_fn"] = all(bool((v == (0.5 if k.endswith("weight") else -0.25)).all()) for k, v in full.items())
    # Different initial weights on every rank; sync_module_states makes rank 0's everyone's.
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        meta = _model(torch.float64)
    model = F(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True)
    full = _full(ours, model)
    gathered = [None] * w
    dist.all_gather_object(gathered, {k: v.sum().item() for k, v in full.items()})
    out["sync_module_states"] = all(g == gathered[0] for g in gathered)
    # enable_wrap / wrap: annotated modules become nested instances.
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=F):
        model = F(nn.Sequential(wrap(Block(7, 13)), wrap(Block(13, 11)), nn.Linear(11, 3)).double())
    out["enable_wrap"] = len(F.fsdp_modules(model))
    out["wrap_outside"] = type(wrap(nn.Linear(2, 2))) is nn.Linear
    # PyTorch's enums and configs, a process group.
    model = F(_model(torch.float64), sharding_strategy=theirs.ShardingStrategy.SHARD_GRAD_OP,
              mixed_precision=theirs.MixedPrecision(param_dtype=torch.float32), process_group=dist.group.WORLD)
    with F.state_dict_type(model, theirs.StateDictType.FULL_STATE_DICT, theirs.FullStateDictConfig(offload_to_cpu=True)):
        sd = model.state_dict()
    out["pytorch_objects"] = (model._fsdp1_strategy is ours.ShardingStrategy.SHARD_GRAD_OP, sd["0.lin.weight"].shape == (13, 7),
                              sd["0.lin.weight"].dtype == torch.float64)
    # buffer_dtype: buffers compute in it; state dicts keep their dtype.
    base = _model(torch.float64)
    base[0].register_buffer("scale", torch.ones(13, dtype=torch.float64))
    model = F(base, mixed_precision=ours.MixedPrecision(buffer_dtype=torch.float32))
    with F.state_dict_type(model, ours.StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    out["buffer_dtype"] = (model.module[0].scale.dtype == torch.float32, sd["0.scale"].dtype == torch.float64)
    return out


def test_fsdp1_init_sync_wrap_and_pytorch_objects(ranks):
    for r in ranks(2).run(_init_and_sync):
        assert r["param_init_fn"] and r["sync_module_states"] and r["wrap_outside"], r
        assert r["enable_wrap"] == 3, r  # the root and the two wrapped blocks
        assert r["pytorch_objects"] == (True, True, True), r
        assert r["buffer_dtype"] == (True, True), r


def _bf16_compress_hook() -> dict:
    """register_comm_hook(state, bf16_compress_hook) on ours: gradients reduced in bf16, the same
    bits as PyTorch's FSDP1 reducing in bf16 through MixedPrecision(reduce_dtype=bf16) (its hook
    itself calls record_stream, which needs an accelerator)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    rank, w = world()
    results = {}
    for tag, (lib, wrap) in _libs().items():
        extra = {"device_id": torch.device("cpu"), "mixed_precision": lib.MixedPrecision(reduce_dtype=torch.bfloat16)} if tag == "theirs" else {}
        model = lib.FullyShardedDataParallel(_model(torch.float32), auto_wrap_policy=wrap.ModuleWrapPolicy({Block}),
                                             use_orig_params=True, **extra)
        if tag == "ours":
            model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), default_hooks.bf16_compress_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, {}, torch.float32, 3, (rank, w))
        results[tag] = (losses, _full(lib, model))
    (la, sa), (lb, sb) = results["ours"], results["theirs"]
    plain = _model(torch.float32)  # without the hook: different bits (the reduction really is in bf16)
    ours_plain = _libs()["ours"][0].FullyShardedDataParallel(plain, auto_wrap_policy=_libs()["ours"][1].ModuleWrapPolicy({Block}))
    lp = _train(ours_plain, torch.optim.AdamW(ours_plain.parameters(), lr=1e-2), {}, torch.float32, 3, (rank, w))
    return {"loss": max(abs(a - b) for a, b in zip(la, lb)), "param": max((sa[k] - sb[k]).abs().max().item() for k in sa),
            "differs_without": la != lp}


def test_fsdp1_bf16_compress_hook_matches_pytorch(ranks):
    for r in ranks(2).run(_bf16_compress_hook):
        assert r == {"loss": 0.0, "param": 0.0, "differs_without": True}, r


def test_fsdp1_refusals_name_the_argument_and_the_fix():
    from fake_world import fake_world

    import fully_shard.fsdp1 as ours

    F = ours.FullyShardedDataParallel
    with fake_world(2):
        cases = [
            (dict(ignored_modules=[], ignored_states=[]), ValueError, "Cannot pass both ignored_modules and ignored_states"),
            (dict(sharding_strategy=ours.ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (2,))),
             ValueError, "HYBRID_SHARD needs a 2-D"),
            (dict(sharding_strategy="FULL_SHARD"), TypeError, "expects a ShardingStrategy"),
        ]
        for kwargs, error, match in cases:
            model = _model(torch.float64)
            with pytest.raises(error, match=match):
                F(model, **kwargs)
            assert not any(hasattr(p, "device_mesh") for p in model.parameters())  # nothing changed
        model = F(_model(torch.float64))
        with pytest.raises(ValueError, match="already a FullyShardedDataParallel"):
            F(model)
        with pytest.raises(TypeError, match="only PyTorch's default FSDP hooks"):
            model.register_comm_hook(None, lambda state, grad: grad)
        with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True"):
            with F.summon_full_params(model, rank0_only=True):
                pass


def _hybrid_from_groups(source: str) -> dict:
    """HYBRID_SHARD's mesh from FSDP1's (intra-node, inter-node) group pair, or from the node size
    (LOCAL_WORLD_SIZE, as torchrun sets it): 2 x 2, against the float64 reference."""
    import os

    import fully_shard.fsdp1 as ours
    from fully_shard.fsdp1.wrap import ModuleWrapPolicy

    rank, w = world()
    kwargs: dict = {}
    if source == "groups":
        intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        kwargs["process_group"] = (intra, inter)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        model = ours.FullyShardedDataParallel(_model(torch.float64), sharding_strategy=ours.ShardingStrategy.HYBRID_SHARD,
                                              auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    mesh = model.module[3].weight.device_mesh
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(model, opt, {}, torch.float64, 3, (rank, w))
    ref = _model(torch.float64)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), {}, torch.float64, 3, (0, 1))
    full, ref_sd = _full(ours, model), ref.state_dict()
    return {"loss_diff": max(abs(global_mean(torch.tensor(a, dtype=torch.float64)) - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd),
            "mesh": (tuple(mesh.shape), mesh.mesh.tolist())}


@pytest.mark.parametrize("source", ["groups", "node_size"])
def test_fsdp1_hybrid_mesh_from_group_pair_or_node_size(ranks, source):
    results = ranks(4).run(_hybrid_from_groups, source)
    check(results, f"fsdp1 HYBRID_SHARD mesh from {source} vs single process (float64)")
    for r in results:  # replicas across nodes (rows), shards within a node (columns)
        assert r["mesh"] == ((2, 2), [[0, 1], [2, 3]]), r


def _activation_checkpointing() -> dict:
    """apply_activation_checkpointing after wrapping (the usual FSDP1 recipe): the blocks inside the
    nested instances get checkpoint wrappers; training and state-dict names are unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    import fully_shard.fsdp1 as ours
    from fully_shard.fsdp1.wrap import ModuleWrapPolicy

    rank, w = world()
    out = {}
    for ac in (False, True):
        model = ours.FullyShardedDataParallel(_model(torch.float64), auto_wrap_policy=ModuleWrapPolicy({Block}))
        if ac:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, {}, torch.float64, 3, (rank, w))
        wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
        out[ac] = (losses, _full(ours, model), wrapped)
    (la, sa, _), (lb, sb, n) = out[False], out[True]
    return {"same": la == lb and list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), "wrapped": n}


def test_fsdp1_with_activation_checkpointing(ranks):
    for r in ranks(2).run(_activation_checkpointing):
        assert r == {"same": True, "wrapped": 3}, r


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 6)
        self.bn = nn.BatchNorm1d(6)
        self.adapter = nn.Linear(6, 6)

    def forward(self, x):
        return self.adapter(self.bn(self.lin(x)))


def _review_cases() -> dict:
    """A root inside a container, ignored modules under auto-wrapped blocks, BatchNorm kept out of
    mixed precision (bit for bit with PyTorch's FSDP1), and refusals."""
    import fully_shard.fsdp1 as ours

    F = ours.FullyShardedDataParallel
    rank, w = world()
    out: dict = {}

    class Holder(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            model = _model(torch.float64)
            if seed:
                torch.manual_seed(seed)
                for p in model.parameters():
                    torch.nn.init.normal_(p)
            from fully_shard.fsdp1.wrap import ModuleWrapPolicy

            self.model = F(model, auto_wrap_policy=ModuleWrapPolicy({Block}))

    a, b = Holder(0), Holder(7)
    with F.state_dict_type(a, ours.StateDictType.FULL_STATE_DICT):
        sda = a.state_dict()
    out["container_keys"] = sorted(sda) == sorted("model." + k for k in _model(torch.float64).state_dict())
    out["container_full"] = all(not hasattr(v, "device_mesh") for v in sda.values())
    with F.state_dict_type(b, ours.StateDictType.FULL_STATE_DICT):
        b.load_state_dict(sda)
        sdb = b.state_dict()
    out["container_load"] = all(torch.equal(sda[k], sdb[k]) for k in sda)
    # ignored modules under auto-wrapped blocks stay plain
    from fully_shard.fsdp1.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    net = nn.Sequential(BNBlock(), nn.Linear(6, 3))
    model = F(net, auto_wrap_policy=ModuleWrapPolicy({BNBlock}), ignored_modules=[net[0].adapter])
    out["ignored_nested"] = (not hasattr(net[0].adapter.weight, "device_mesh"), hasattr(net[0].lin.weight, "device_mesh"))
    # LOCAL load of shards in another layout, a non-default group: refused
    with F.state_dict_type(model, ours.StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        bad = {k: (torch.cat([v, v]) if k == "0.lin.weight" else v) for k, v in local.items()}
        try:
            model.load_state_dict(bad)
            out["local_refused"] = False
        except ValueError as e:
            out["local_refused"] = "A local state dict loads only at the world size and layout that saved it" in str(e)
    try:
        F.optim_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1), group=dist.new_group([0]))
        out["group_refused"] = False
    except ValueError as e:
        out["group_refused"] = "with a group other than the default one is not supported" in str(e)
    return out


def test_fsdp1_review_cases(ranks):
    for r in ranks(2).run(_review_cases):
        assert all(v is True or v == (True, True) for v in r.values()), r


def _batchnorm_mixed_precision() -> dict:
    """MixedPrecision(bf16) with an auto-wrap policy: BatchNorm gets its own full-precision instance,
    its inputs cast to float32 and outputs back (FSDP1's rule), bit for bit with PyTorch's FSDP1."""
    rank, w = world()
    results = {}
    for tag, (lib, wrap) in _libs().items():
        torch.manual_seed(0)
        net = nn.Sequential(BNBlock(), nn.Linear(6, 3))
        extra = {} if tag == "ours" else {"device_id": torch.device("cpu")}
        model = lib.FullyShardedDataParallel(
            net, auto_wrap_policy=wrap.ModuleWrapPolicy({BNBlock}), use_orig_params=True,
            mixed_precision=lib.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), **extra,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, {}, torch.float32, 3, (rank, w))
        results[tag] = (losses, _full(lib, model), sum(isinstance(m, lib.FullyShardedDataParallel) for m in model.modules()))
    (la, sa, na), (lb, sb, nb) = results["ours"], results["theirs"]
    return {"loss": max(abs(a - b) for a, b in zip(la, lb)), "param": max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa),
            "instances": (na, nb)}


def test_fsdp1_batchnorm_out_of_mixed_precision_matches_pytorch(ranks):
    for r in ranks(2).run(_batchnorm_mixed_precision):
        assert r == {"loss": 0.0, "param": 0.0, "instances": (3, 3)}, r


def _hand_wrapped_child_under_a_policy() -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fully_shard.fsdp1 import FullyShardedDataParallel as FSDP

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    model[0] = FSDP(model[0])
    before = [type(p).__name__ for p in model[1].parameters()]
    try:
        FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
        message = "no error"
    except ValueError as e:
        message = str(e)
    return {"message": message, "untouched": before == [type(p).__name__ for p in model[1].parameters()]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_auto_wrap_over_a_hand_wrapped_child_names_it(ranks, world_size):
    """Issue #23: refused before anything changes, naming the child (PyTorch's words, plus the fix);
    it used to blame "an earlier fully_shard call on a parent module"."""
    for r in ranks(world_size).run(_hand_wrapped_child_under_a_policy):
        assert "FSDP auto wrapping requires modules to not already have FSDP applied but found '0'" in r["message"], r
        assert "Fix:" in r["message"] and r["untouched"], r
