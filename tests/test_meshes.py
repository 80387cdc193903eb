"""Meshes and placements: HSDP on a 2-D (replicate, shard) mesh, and parameters sharded on
other dims (``shard_placement_fn``), each against a single-process reference on the global
batch, with the collective trace confirming what ran."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from rank_utils import cpu_mesh, full, max_param_diff, world
from _parity import STEPS, TOL64, check, _mlp_loss, _train_pair, make_mlp, mlp_batch, train_routed

# (replicate, shard) shapes per world size: every split, the degenerate ones included.
HSDP_SHAPES = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}


def hsdp_mesh(shape: tuple[int, int]):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _shard_mlp_hsdp(model: nn.Sequential, mesh, shard_fn, **kwargs) -> None:
    for block in model[:3]:
        shard_fn(block, mesh=mesh, **kwargs)
    shard_fn(model, mesh=mesh, **kwargs)


# -- HSDP ----------------------------------------------------------------------------------------


def _hsdp_parity(shape: tuple[int, int]) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import debug, fully_shard

    mesh = hsdp_mesh(shape)
    model = make_mlp()
    ref = copy.deepcopy(model)
    theirs = copy.deepcopy(model)
    _shard_mlp_hsdp(model, mesh, fully_shard)
    _shard_mlp_hsdp(theirs, mesh, torch_fully_shard)
    assert all(p.placements == (Replicate(), Shard(0)) for p in model.parameters())
    with debug.trace() as t:
        out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)

    # Same steps through PyTorch's fully_shard on the same mesh: the same numbers, unbucketed (the
    # same collectives, so the same summation order) and bucketed (the default: one collective
    # for the 3 blocks; a sum over more than 2 ranks may then be ordered differently).
    rank, w = world()
    ours, bucketed = make_mlp(), make_mlp()
    _shard_mlp_hsdp(ours, mesh, fully_shard)
    _shard_mlp_hsdp(bucketed, mesh, fully_shard)
    ours.set_bucket_bytes(0)
    models = (ours, bucketed, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    for step in range(STEPS):
        x, y = mlp_batch(step)
        for m, opt in zip(models, opts):
            _mlp_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opt.step()
            opt.zero_grad()
    for key, m in (("vs_torch", ours), ("bucketed_vs_torch", bucketed)):
        out[key] = max(
            (a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(m.parameters(), theirs.parameters())
        )
    out["reduce_scatter_sizes"] = sorted({r.group_size for r in t.select(op="reduce_scatter")})
    out["all_reduce_sizes"] = sorted({r.group_size for r in t.select(op="all_reduce")})
    out["per_step"] = [(t.count(op="reduce_scatter", step=s), t.count(op="all_reduce", step=s)) for s in range(STEPS)]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_hsdp_matches_single_process_and_torch(ranks, world_size):
    for shape in HSDP_SHAPES[world_size]:
        results = ranks(world_size).run(_hsdp_parity, shape)
        check(results, f"hsdp {shape}")
        for r in results:
            print(f"hsdp {shape}: vs torch fully_shard {r['vs_torch']:.2e}, per step (RS, AR) {r['per_step'][0]}")
            assert r["vs_torch"] == 0.0
            if max(shape) <= 2:  # sums of at most 2 terms have one value, whatever the buffer layout
                assert r["bucketed_vs_torch"] == 0.0
            # The root's group and the bucket of 3 small blocks: a reduce-scatter each over the
            # shard ranks, then an all-reduce over the replicas; a mesh dim of one rank
            # communicates nothing.
            rs, ar = (2 if shape[1] > 1 else 0), (2 if shape[0] > 1 else 0)
            assert r["reduce_scatter_sizes"] == ([shape[1]] if rs else []) and r["all_reduce_sizes"] == ([shape[0]] if ar else [])
            assert r["per_step"] == [(rs, ar)] * len(r["per_step"])


def _hsdp_reshard_to_pairs() -> dict:
    from fully_shard import debug, fully_shard

    model = make_mlp()
    ref = copy.deepcopy(model)
    _shard_mlp_hsdp(model, hsdp_mesh((2, 4)), fully_shard, reshard_after_forward=2)
    with debug.trace() as t:
        out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)
    out["all_gather_sizes"] = sorted({r.group_size for r in t.select(op="all_gather")})
    return out


def test_hsdp_reshard_to_a_smaller_group_than_a_replicas_shards(ranks):
    """World 8, (2 replicas, 4 shards), ``reshard_after_forward=2``: each replica's shard group
    is split into pairs by its own ranks only (was: by every rank in one global order, so two
    replicas' pairs took the same group name)."""
    results = ranks(8).run(_hsdp_reshard_to_pairs)
    check(results, "hsdp (2, 4), reshard 2")
    for r in results:
        assert r["all_gather_sizes"] == [2, 4], r  # backward within a pair, forward over the shards


def _reshard_after_a_group_of_some_ranks() -> dict:
    """A ``dist.new_group([0, 1])`` before ``fully_shard`` (every rank calls it, only ranks 0 and 1
    join: they belong to one group more than ranks 2 and 3), then ``reshard_after_forward=2`` on a
    shard group of its own (a fresh process group, so no earlier test made its pairs)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from fully_shard import debug, fully_shard

    dist.new_group([0, 1])
    mesh = DeviceMesh.from_group(dist.new_group(list(range(4))), "cpu")
    model = make_mlp()
    ref = copy.deepcopy(model)
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh, reshard_after_forward=2)
    with debug.trace() as t:
        out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)
    out["all_gather_sizes"] = sorted({r.group_size for r in t.select(op="all_gather")})
    return out


def test_reshard_to_pairs_after_a_group_some_ranks_did_not_join(ranks):
    """torch names a group made by its members only after its ranks and how many groups the
    caller already belongs to: ranks that joined different numbers of groups before named the
    pairs' groups differently and waited for each other until the timeout (a hang: the old code
    fails here after the 120 s process-group timeout). The counts are aligned first now."""
    results = ranks(4).run(_reshard_after_a_group_of_some_ranks)
    check(results, "reshard 2 after an asymmetric group")
    for r in results:
        assert r["all_gather_sizes"] == [2, 4], r


def _hsdp_deferred_all_reduce() -> dict:
    """Two micro-batches; the first defers the all-reduce across replicas. Equals one step on the
    whole batch, and only the last backward all-reduces."""
    from fully_shard import debug, fully_shard

    rank, w = world()
    mesh = hsdp_mesh((2, w // 2))
    model = make_mlp()
    ref = copy.deepcopy(model)
    _shard_mlp_hsdp(model, mesh, fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        x, y = mlp_batch(step)
        micro = list(zip(x.chunk(w)[rank].chunk(2), y.chunk(w)[rank].chunk(2)))
        with debug.trace() as t:
            for i, (xm, ym) in enumerate(micro):
                model.set_requires_all_reduce(i == len(micro) - 1)
                (_mlp_loss(model, xm, ym) / len(micro)).backward()
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_param_diff(model, ref))
    return {
        "param_diff": max(diffs),
        "all_reduce": [t.count(op="all_reduce", step=s) for s in (0, 1)],
        "reduce_scatter": [t.count(op="reduce_scatter", step=s) for s in (0, 1)],
    }


def test_hsdp_deferred_all_reduce_accumulates_exactly(ranks):
    for r in ranks(4).run(_hsdp_deferred_all_reduce):
        print(r)
        assert r["param_diff"] <= TOL64
        # Two reductions per backward (the root's group, the bucket of 3 blocks).
        assert r["reduce_scatter"] == [2, 2] and r["all_reduce"] == [0, 2]


# -- shard_placement_fn ------------------------------------------------------------------------


class Experts(nn.Module):
    """A 3-D expert weight ``(experts, d_in, d_out)``, the shape MoE layers shard on dim 1."""

    def __init__(self, n: int = 3, d_in: int = 6, d_out: int = 5) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d_in, d_out) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,nio->bo", x, self.w[:, : x.shape[1]])


def make_placed_model() -> nn.Sequential:
    """Dims chosen so no shard dim divides by 2 or 4 (uneven chunks, some empty at world 4)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 6)),
        nn.Sequential(Experts(3, 6, 5), nn.Tanh()),
        nn.Linear(5, 3),
    ).double()


def _by_shape(param: nn.Parameter):
    # 2-D weights on dim 1, the experts on dim 1 of 3, biases stay on dim 0.
    return Shard(1) if param.dim() >= 2 else None


def _placement_parity(reshard) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fully_shard import fully_shard, unsharded

    model = make_placed_model()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    for block in model[:2]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=_by_shape)
    fully_shard(model, mesh=mesh, shard_placement_fn=_by_shape)
    placements = {n: p.placements for n, p in model.named_parameters()}
    assert placements["1.0.w"] == (Shard(1),) and placements["0.0.weight"] == (Shard(1),)
    assert placements["0.0.bias"] == (Shard(0),)
    initial = max_param_diff(model, ref)
    out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS)
    out["initial"] = initial
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["state_dict_diff"] = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    with torch.no_grad(), unsharded(model):
        out["unsharded_diff"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.parametrize(
    "world_size,reshard",
    [(1, True), (1, False), (2, True), (2, False), (4, True), (4, False), (4, 2)],  # int: needs a world it divides
)
def test_shard_placement_any_dim_uneven_matches_single_process(ranks, world_size, reshard):
    results = ranks(world_size).run(_placement_parity, reshard)
    for r in results:
        print(f"initial {r['initial']}, full state dict {r['state_dict_diff']:.2e}, unsharded {r['unsharded_diff']:.2e}")
        assert r["initial"] == 0 and r["state_dict_diff"] <= TOL64 and r["unsharded_diff"] <= TOL64
    check(results, f"shard dim 1, reshard={reshard}")


def _placement_equals_dim0_in_bf16() -> float:
    """Dim-1 shards move the same values as dim-0 shards: training in bf16 gives the same model."""
    from fully_shard import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for fn in (None, _by_shape):
        model = make_placed_model()
        model[0][2].to(torch.bfloat16)  # block 0 holds fp32 and bf16 originals: the byte all-gather
        for block in model[:2]:
            fully_shard(block, mesh=cpu_mesh(), mp_policy=mp, shard_placement_fn=fn)
        fully_shard(model, mesh=cpu_mesh(), mp_policy=mp, shard_placement_fn=fn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rank, w = world()
        for step in range(3):
            x, y = mlp_batch(step)
            _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank].bfloat16()).backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    return max(
        (a.full_tensor().float() - b.full_tensor().float()).abs().max().item()
        for a, b in zip(models[0].parameters(), models[1].parameters())
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_placement_mixed_precision_equals_dim0(ranks, world_size):
    diffs = ranks(world_size).run(_placement_equals_dim0_in_bf16)
    print("dim 1 vs dim 0, bf16:", diffs)
    assert max(diffs) == 0.0


# -- tensor parallel + fully_shard -------------------------------------------------------------


class TPBlock(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 10) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)  # column-wise: TP-local rows 5, then dp chunks 3 + 2
        self.down = nn.Linear(hidden, dim)  # row-wise: weight Shard(1), bias Replicate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_tp_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 8), TPBlock(), TPBlock(), nn.Linear(8, 3)).double()


def _tp_parity(shape: tuple[int, int], reshard: bool) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fully_shard import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = make_tp_model()
    ref = copy.deepcopy(model)
    for block in model[1:3]:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"])
    w = model[1].up.weight
    assert w.device_mesh.mesh_dim_names == ("dp", "tp") and w.placements[1] == Shard(0)
    assert model[1].down.weight.placements == (Shard(0), Shard(1))
    initial = max_param_diff(model, ref)
    # Data parallel over dp only: the TP ranks of one dp rank see the same batch (and loss, so the
    # mean over all ranks is the mean over dp ranks).
    out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS, split=(mesh.get_local_rank(0), shape[0]))
    out["initial"] = initial
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["state_dict_diff"] = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return out


@pytest.mark.parametrize("world_size,shape", [(1, (1, 1)), (2, (1, 2)), (2, (2, 1)), (4, (2, 2))])
@pytest.mark.parametrize("reshard", [True, False])
def test_tensor_parallel_with_fully_shard_matches_single_process(ranks, world_size, shape, reshard):
    results = ranks(world_size).run(_tp_parity, shape, reshard)
    for r in results:
        assert r["initial"] == 0 and r["state_dict_diff"] <= TOL64, r
    check(results, f"tp+fsdp {shape} reshard={reshard}")


def _hsdp_tp_parity(shape: tuple[int, int, int]) -> dict:
    """HSDP x TP on a 3-D (replicate, shard, tp) mesh: blocks tensor-parallel over tp, then
    fully_shard over the (replicate, shard) sub-mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fully_shard import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard", "tp"))
    dp = mesh["rep", "shard"]
    model = make_tp_model()
    ref = copy.deepcopy(model)
    for block in model[1:3]:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    placements = tuple(model[1].down.weight.placements)
    dp_rank = mesh.get_local_rank(0) * shape[1] + mesh.get_local_rank(1)
    out = _train_pair(model, ref, mlp_batch, _mlp_loss, STEPS, split=(dp_rank, shape[0] * shape[1]))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["state_dict_diff"] = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    out["placements"] = placements
    return out


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_hsdp_with_tensor_parallel_on_a_3d_mesh(ranks, shape):
    results = ranks(4).run(_hsdp_tp_parity, shape)
    check(results, f"hsdp x tp {shape} vs single process (float64)")
    for r in results:
        assert r["state_dict_diff"] <= TOL64, r
        assert r["placements"] == (Replicate(), Shard(0), Shard(1)), r  # down: rows over shard, cols over tp


# -- per-parameter meshes (issue #12 item 6): MoE experts on an expert-parallel mesh ---------------


class _MoE(torch.nn.Module):
    """dense -> expert -> head. ``experts`` holds one expert per expert-parallel rank; the sharded
    model keeps only its own (``ep`` chooses which), the reference routes each data-parallel rank's
    samples through the expert of its ep rank."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(7, 10)
        expert = torch.nn.Sequential(torch.nn.Linear(10, 9), torch.nn.Tanh(), torch.nn.Linear(9, 10))
        self.experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(n_experts)])
        self.head = torch.nn.Linear(10, 3)
        self.ep = 0  # the sharded model's own expert
        self.to(torch.float64)

    def forward(self, x, route=None):
        h = torch.relu(self.dense(x))
        if route is None:  # sharded: this rank's samples all go to its expert
            h = h + self.experts[self.ep](h)
        else:  # reference: sample block i goes to expert route[i]
            h = torch.cat([c + self.experts[e](c) for c, e in zip(h.chunk(len(route)), route)])
        return self.head(h)


def _moe_sharded(shard_fn, api: str, mesh, rank: int, w: int, m: int) -> "_MoE":
    from torch.distributed.tensor import Shard

    from fully_shard import ShardPlacement

    model = _MoE(min(2, w))
    model.ep = rank // m
    expert_params = {id(p) for p in model.experts[model.ep].parameters()}
    sub = mesh["dp_mod_ep"]
    if api == "torch_result":  # PyTorch's own result object, with its mesh info
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

        on_sub = ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(mesh=sub, shard_mesh_dim=0))
    else:
        on_sub = None  # sliced again for each parameter: equal meshes are one mesh (one group)
    others = {p for i, e in enumerate(model.experts) if i != model.ep for p in e.parameters()}
    for p in others:  # only this rank's expert is part of its model
        p.requires_grad_(False)

    def placement(p):
        if id(p) not in expert_params:
            return None
        return on_sub if on_sub is not None else ShardPlacement(None, mesh=mesh["dp_mod_ep"])

    shard_fn(model, mesh=init_device_mesh("cpu", (w,)), ignored_params=others, shard_placement_fn=placement)
    model.set_gradient_divide_factor(float(w))
    return model


def _moe(api: str) -> dict:
    """World W = ep x m: rank r is ep rank r // m; dense and head shard over all W ranks, the
    expert over the m ranks of its ep group (``mesh["dp_mod_ep"]``), with gradients divided by W
    (each expert sees only its group's samples of the global batch: torchtitan's setting).
    ``api``: ours (`ShardPlacement`) or torch_result (PyTorch's ``ShardPlacementResult``).

    Not compared with PyTorch's ``fully_shard`` itself: on a shard group of one rank with a divide
    factor set and a float64 (any non-fp32/bf16) reduce dtype, torch 2.13 divides twice (pre-divide,
    then ``input / factor`` in its single-rank copy), so its experts train on gradients W times too
    small; ours match the routed reference."""
    from fully_shard import fully_shard

    rank, w = world()
    ep = min(2, w)
    m = w // ep
    mesh = init_device_mesh("cpu", (ep, m), mesh_dim_names=("ep", "dp_mod_ep"))
    model = _moe_sharded(fully_shard, api, mesh, rank, w, m)
    ref = _MoE(ep)
    meshes = sorted({p.device_mesh.size() for p in model.parameters() if hasattr(p, "device_mesh")})
    loss_diff = train_routed(model, ref, [r // m for r in range(w)])
    ref_params = dict(ref.named_parameters())
    mine = {n: p for n, p in model.named_parameters() if not n.startswith("experts.") or n.startswith(f"experts.{model.ep}.")}
    diffs = [(p.full_tensor() - full(ref_params[n]).detach()).abs().max().item() for n, p in mine.items()]
    groups = len(model._get_fsdp_state().own)
    return {"param_diff": max(diffs), "loss_diff": loss_diff, "meshes": meshes, "groups": groups}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_per_parameter_mesh_trains_experts_on_their_own_mesh(ranks, world_size):
    torch_has_result = hasattr(
        importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common"), "ShardPlacementResult"
    )  # (torch >= 2.13)
    for api in ("ours", "torch_result") if world_size == 4 and torch_has_result else ("ours",):
        results = ranks(world_size).run(_moe, api)
        check(results, f"per-parameter mesh ({api}) world {world_size} vs routed single process (float64)")
        m = world_size // min(2, world_size)
        for r in results:
            assert r["meshes"] == sorted({m, world_size}), r
            assert r["groups"] == 2, r  # one per mesh object: the call's and the experts'


def test_per_parameter_mesh_bad_input_is_refused_before_anything_changes():
    from fake_world import fake_world

    from fully_shard import ShardPlacement, fully_shard

    with fake_world(4) as mesh:
        sub = init_device_mesh("cpu", (4, 1), mesh_dim_names=("ep", "m"))["m"]  # one rank per expert
        model = make_mlp()
        before = [p for p in model.parameters()]
        with pytest.raises(ValueError, match=r"chose 'x' as the mesh of parameter '0.0.weight'; it must be a DeviceMesh"):
            fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: ShardPlacement(None, mesh="x"))
        with pytest.raises(ValueError, match="reshard_after_forward must be .* divides the shard world size 1"):
            fully_shard(model, mesh=mesh, reshard_after_forward=2,
                        shard_placement_fn=lambda p: ShardPlacement(Shard(0), mesh=sub))
        assert [p for p in model.parameters()] == before and not any(hasattr(p, "device_mesh") for p in before)
