"""``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` (issue #12 item 4),
as torchtitan's default path calls it: equal to passing the data-parallel sub-mesh, and parameters
already DTensors on the full mesh (tensor parallel on the other dims) train like the float64
single-process model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from _parity import _mlp_loss, _train_pair, check, make_mlp, max_abs_diff, mlp_batch, train_routed
from rank_utils import world


def _shard_blocks(model, **kwargs) -> None:
    from fully_shard import fully_shard

    for block in model[:3]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _same_as_submesh(kind: str) -> dict:
    from fully_shard import DataParallelMeshDims

    try:
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims  # PyTorch's, which ours accepts
    except ImportError:  # torch < 2.13 has none: ours stands in
        TorchDims = DataParallelMeshDims

    a, b = make_mlp(), make_mlp()
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        _shard_blocks(a, mesh=mesh, dp_mesh_dims=TorchDims(shard="shard", replicate="rep"))  # PyTorch's object
        _shard_blocks(b, mesh=mesh)
    elif kind == "hsdp_tuples":  # (r1, r2) replicas x (s1, s2) shards, each side flattened: 2 x 2
        mesh = init_device_mesh("cpu", (2, 1, 1, 2), mesh_dim_names=("r1", "r2", "s1", "s2"))
        _shard_blocks(a, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("s1", "s2"), replicate=("r1", "r2")))
        _shard_blocks(b, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    else:  # two dims flattened into one shard dim of 4 ranks
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
        _shard_blocks(a, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("x", "y")))
        _shard_blocks(b, mesh=init_device_mesh("cpu", (4,)))
    ref = copy.deepcopy(make_mlp())
    out = _train_pair(a, ref, mlp_batch, _mlp_loss, 3)
    _train_pair(b, copy.deepcopy(make_mlp()), mlp_batch, _mlp_loss, 3)
    out["vs_submesh"] = max_abs_diff(a, b)
    out["placements"] = sorted({tuple(p.placements) for p in a.parameters()}, key=str)
    return out


@pytest.mark.parametrize("kind", ["hsdp", "hsdp_tuples", "flattened"])
def test_dp_mesh_dims_equals_the_submesh(ranks, kind):
    results = ranks(4).run(_same_as_submesh, kind)
    check(results, f"dp_mesh_dims {kind} vs single process (float64)")
    for r in results:
        assert r["vs_submesh"] == 0.0, r
        expected = [(Shard(0),)] if kind == "flattened" else [(Replicate(), Shard(0))]
        assert r["placements"] == expected, r


class FullMeshLinear(nn.Module):
    """A weight already distributed on the full mesh: Replicate() on the dp dims, Shard(0) on tp."""

    def __init__(self, lin: nn.Linear, mesh) -> None:
        super().__init__()
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        self.weight = nn.Parameter(distribute_tensor(lin.weight.detach().clone(), mesh, placements))
        self.bias = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        return F.linear(x, w, self.bias)


def _tensor_parallel_on_full_mesh(hsdp: bool) -> dict:
    from fully_shard import DataParallelMeshDims, fully_shard

    rank, w = world()
    if hsdp:  # HSDP x TP: (replicate 2, shard 1, tp 2)
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "dp", "tp"))
        dims = DataParallelMeshDims(shard="dp", replicate="rep")
        dp_rank, dp_size = mesh.get_local_rank("rep"), 2
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims = DataParallelMeshDims(shard="dp")
        dp_rank, dp_size = mesh.get_local_rank("dp"), 2
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = nn.Sequential(FullMeshLinear(ref[0], mesh), nn.Tanh(), FullMeshLinear(ref[2], mesh))
    fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})
    return {**_train_pair(model, ref, mlp_batch, _mlp_loss, 3, split=(dp_rank, dp_size)), "meshes": meshes}


@pytest.mark.parametrize("hsdp", [False, True])
def test_parameters_already_on_the_full_mesh_train_like_the_reference(ranks, hsdp):
    results = ranks(4).run(_tensor_parallel_on_full_mesh, hsdp)
    check(results, f"dp_mesh_dims (hsdp={hsdp}) with tensor-parallel weights vs single process (float64)")
    for r in results:  # weights: the dp dims and tp; biases: the dp dims only
        expected = ["('rep', 'dp')", "('rep', 'dp', 'tp')"] if hsdp else ["('dp', 'tp')", "('dp',)"]  # sorted as strings
        assert r["meshes"] == expected, r


def test_dp_mesh_dims_bad_input_is_refused_before_anything_changes():
    from fake_world import fake_world

    from fully_shard import DataParallelMeshDims, fully_shard

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = make_mlp()
        with pytest.raises(ValueError, match=r"dp_mesh_dims names \['nope'\], but the mesh's dims are \['dp', 'tp'\]"):
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="nope"))
        with pytest.raises(ValueError, match="use replicate"):
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
        bad = nn.Linear(4, 4)
        bad.weight = nn.Parameter(distribute_tensor(bad.weight.detach(), mesh, [Shard(0), Replicate()]))
        original = bad.weight
        with pytest.raises(ValueError, match=r"on the data-parallel dims \['dp'\] it must be Replicate\(\)"):
            fully_shard(bad, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        assert bad.weight is original
        with pytest.raises(ValueError, match="At least one|needs at least one"):
            DataParallelMeshDims()


class _Experts(nn.Module):
    """Stacked expert matrices ``(E, 10, 10)``. Sharded: a DTensor on the full mesh, ``Shard(0)`` on
    ``ep`` (each ep rank holds its expert) and ``Replicate()`` on the dp dim; forward uses the
    local expert. Reference: plain, and each sample block goes to the expert ``route`` names."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, h: torch.Tensor, route=None) -> torch.Tensor:
        if route is None:
            (local,) = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
            return h + torch.tanh(h @ local)
        return torch.cat([c + torch.tanh(c @ self.weight[e]) for c, e in zip(h.chunk(len(route)), route)])


class _EPModel(nn.Module):
    def __init__(self, experts: torch.Tensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(7, 10).double()
        self.experts = _Experts(experts)
        self.head = nn.Linear(10, 3).double()

    def forward(self, x, route=None):
        return self.head(self.experts(torch.relu(self.dense(x)), route))


def _expert_parallel_dims() -> dict:
    """torchtitan's MoE layout on a full (dp_mod_ep, ep) mesh of 2 x 2: dense parameters shard over
    both dims flattened, the experts (already ``Shard(0)`` on ep) over dp_mod_ep only, with their
    gradients divided by the whole data-parallel size (each expert sees its ep rank's samples)."""
    from fully_shard import DataParallelMeshDims, fully_shard

    rank, w = world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    torch.manual_seed(1)
    stacked = (torch.randn(2, 10, 10) * 0.3).double()
    ref = _EPModel(stacked.clone())
    model = _EPModel(distribute_tensor(stacked.clone(), mesh, [Replicate(), Shard(0)]))
    fully_shard(model.experts, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_mod_ep"))
    model.experts.set_gradient_divide_factor(float(w))
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp_mod_ep", "ep")))
    placements = tuple(model.experts.weight.placements), tuple(model.experts.weight.device_mesh.mesh_dim_names)
    loss_diff = train_routed(model, ref, [r % 2 for r in range(w)])  # rank r holds expert r % 2 (its ep rank)
    diffs = [(p.full_tensor() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())]
    return {"loss_diff": loss_diff, "param_diff": max(diffs), "experts": placements}


def test_expert_parallel_dims_train_like_a_routed_reference(ranks):
    results = ranks(4).run(_expert_parallel_dims)
    check(results, "dp_mesh_dims with an expert-parallel dim vs routed single process (float64)")
    from torch.distributed.tensor.placement_types import _StridedShard

    for r in results:  # experts: dim 0 over ep as they were, then the ep-local rows over dp_mod_ep
        assert r["experts"] == ((_StridedShard(0, split_factor=2), Shard(0)), ("dp_mod_ep", "ep")), r
