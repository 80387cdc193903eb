"""All-gather extensions (issue #12 item 1): a parameter's local tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (PyTorch's protocol, both signatures), and
the all-gather moves what it chooses and rebuilds the unsharded parameter through it.

* bit-exact against PyTorch's ``fully_shard`` with the same subclass (``TwoTensor``), with and
  without mixed precision, resharding after forward or not;
* a float64 reference at world 1, 2 and 4 for an extension sending two inputs of different
  dtypes, with uneven shards (the padding rows), extension and plain parameters in one group,
  an HSDP mesh and ``reshard_after_forward=2``;
* clear errors for extensions that break the protocol.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.two_tensor import TwoTensor

from _parity import _mlp_loss, _train_pair, check, make_mlp, mlp_batch
from rank_utils import cpu_mesh, world

CALLS: dict[str, int] = {}


def _count(key: str) -> None:
    if not torch.compiler.is_compiling():  # (a traced count would be guarded on: a recompile a step)
        CALLS[key] = CALLS.get(key, 0) + 1


def _two_pre_v1(self, mesh):
    _count("pre")
    return (self.a, self.b), None


def _two_pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    _count("pre")
    assert isinstance(module, nn.Linear) and tuple(outer_size) == tuple(module.weight.shape), (outer_size, module)
    return (self.a, self.b), None


def _two_post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:
        _count("post_out")
        if a.dtype == param_dtype:  # no cast: the outputs are the unsharded parameter's data
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    _count("post")
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def _two_tensor_extension(version: int) -> Iterator[None]:
    TwoTensor.fsdp_pre_all_gather = _two_pre_v1 if version == 1 else _two_pre_v2
    TwoTensor.fsdp_post_all_gather = _two_post
    CALLS.clear()
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def three_linears() -> nn.Module:
    """Two blocks and a last Linear, float64, no biases (8 -> 6 -> 4 -> 2)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 6, bias=False), nn.ReLU()), nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh()),
        nn.Linear(4, 2, bias=False),
    ).double()


def _two_tensor_mlp() -> nn.Module:
    """Weights as TwoTensors (no biases: a plain parameter's gradient through a TwoTensor output
    would be a TwoTensor); dims divide by 2, as PyTorch needs its extensions to pad otherwise."""
    model = three_linears()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(TwoTensor(m.weight.detach().clone(), m.weight.detach() * 2))
    return model


def _subclass_vs_pytorch(version: int, reshard: bool, param_dtype: Optional[torch.dtype]) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    rank, w = world()
    with _two_tensor_extension(version):
        models = []
        for fn, mp in ((fully_shard, MixedPrecisionPolicy(param_dtype=param_dtype)), (torch_fully_shard, TorchMP(param_dtype=param_dtype))):
            model = _two_tensor_mlp()
            for block in model[:2]:
                fn(block, mesh=cpu_mesh(), reshard_after_forward=reshard, mp_policy=mp)
            fn(model, mesh=cpu_mesh(), mp_policy=mp)
            models.append(model)
        ours, theirs = models
        local_type = type(ours[0][0].weight.to_local()).__name__
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
        for step in range(3):
            x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            for m, opt in zip(models, opts):
                m(x.chunk(w)[rank]).sum().backward()
                opt.step()
                opt.zero_grad()
        ours_calls = dict(CALLS)  # both models' hooks counted: ours then PyTorch's, per step
        diffs = []
        for a, b in zip(ours.parameters(), theirs.parameters()):
            fa, fb = a.full_tensor(), b.full_tensor()
            diffs.append(max((fa.a - fb.a).abs().max().item(), (fa.b - fb.b).abs().max().item()))
    return {"diff": max(diffs), "local_type": local_type, "calls": ours_calls}


@pytest.mark.parametrize("version", [1, 2])
def test_subclass_extension_matches_pytorch_bit_for_bit(ranks, version):
    pool = ranks(2)
    for reshard, param_dtype in ((True, None), (False, None), (True, torch.float32)):
        for r in pool.run(_subclass_vs_pytorch, version, reshard, param_dtype):
            assert r["local_type"] == "TwoTensor", r  # the shard stays the subclass
            assert r["diff"] == 0.0, (reshard, param_dtype, r)
            # 3 weights x 3 steps; forward gathers each group once, backward regathers the two
            # resharded blocks (the root keeps its own): per model 3 + (2 if reshard else 0) per step.
            gathers = 3 * (3 + (2 if reshard else 0))
            assert r["calls"]["pre"] == 2 * gathers, r  # ours and PyTorch's call it as often
            assert r["calls"]["post"] == 2 * 3, r  # once per parameter per model: the first gather
            assert r["calls"]["post_out"] == 2 * (gathers - 3), r  # every later one rebuilds in place


# -- torchao's float8 training weights, the real client of the protocol --------------------------


def float8_mlp() -> nn.Module:
    """Three Linear layers (dims multiples of 16, as float8 matmuls need; 64 and 48 rows shard
    evenly over 1, 2 and 4 ranks, 16 over 4), converted by torchao to float8 training with the
    float8 all-gather (each weight's local tensor a ``WeightWithDynamicFloat8CastTensor``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 48, bias=False), nn.ReLU()),
        nn.Linear(48, 16, bias=False),
    )
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def float8_batch(step: int) -> torch.Tensor:
    return torch.randn(32, 32, generator=torch.Generator().manual_seed(step))


def shard_blocks(model: nn.Module, fn: Any, reshard: bool, device: str = "cpu") -> nn.Module:
    """The two blocks and the root, each by ``fn`` on a 1-D mesh of ``device`` (the world)."""
    mesh = cpu_mesh() if device == "cpu" else init_device_mesh(device, (world()[1],))
    for block in model[:2]:
        fn(block, mesh=mesh, reshard_after_forward=reshard)
    fn(model, mesh=mesh)
    return model


def _float8(reference: str, reshard: bool, device: str = "cpu") -> dict:
    """Ours against ``reference``: "pytorch" (its ``fully_shard`` on the same torchao model) or
    "halves" (one process, unsharded float8 model: each rank's half of the batch run separately,
    the two gradients summed and halved, which is the reduce-scatter's sum of two terms exactly)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    rank, w = world()
    base = float8_mlp().to(device)
    ours = shard_blocks(copy.deepcopy(base), fully_shard, reshard, device)
    ref = shard_blocks(copy.deepcopy(base), torch_fully_shard, reshard, device) if reference == "pytorch" else base
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, ref)]
    for step in range(3):
        x = float8_batch(step).to(device)
        ours(x.chunk(w)[rank]).square().mean().backward()
        if reference == "pytorch":
            ref(x.chunk(w)[rank]).square().mean().backward()
        else:
            grads = []
            for half in x.chunk(w):
                ref(half).square().mean().backward()
                grads.append([p.grad for p in ref.parameters()])
                ref.zero_grad()
            for p, *gs in zip(ref.parameters(), *grads):
                p.grad = sum(gs[1:], gs[0]) / w
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = [p.full_tensor() if reference == "pytorch" else p for p in ref.parameters()]
    return {
        "equal": [torch.equal(p.full_tensor(), q) for p, q in zip(ours.parameters(), full)],
        "local_type": type(ours[0][0].weight.to_local()).__name__,
        "sent": [str(d) for d in ours[0]._get_fsdp_state().group.params[0].ext.dtypes],  # what travelled
    }


def test_torchao_float8_weights_train_as_pytorch_and_as_the_unsharded_model(ranks):
    """torchao's float8 training (``enable_fsdp_float8_all_gather``: each weight travels as float8
    bytes and a scale from the all-reduced amax): bit for bit against PyTorch's ``fully_shard`` at
    world 1, and at world 2 against one process running each rank's half batch through the
    unsharded float8 model. (PyTorch's own ``fully_shard`` cannot run it over gloo at world 2: gloo
    has no float8 all-gather, "Invalid scalar type"; ours moves the bytes as uint8.)"""
    pytest.importorskip("torchao.float8")
    for reshard in (True, False):
        for r in ranks(1).run(_float8, "pytorch", reshard):
            assert r["local_type"] == "WeightWithDynamicFloat8CastTensor" and all(r["equal"]), r
            assert r["sent"] == ["torch.float8_e4m3fn"], r
    for r in ranks(2).run(_float8, "halves", True):
        assert all(r["equal"]) and len(r["equal"]) == 3 and r["sent"] == ["torch.float8_e4m3fn"], r


# -- an extension on plain tensors, sending two inputs of different dtypes ------------------------

SEEN_MESHES: list[tuple[int, int]] = []


def _rows_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Send the shard (this rank's rows only: fully_shard pads them) and each row's global index + 1
    as int32, so the post hook can check the rows arrived in order with zeros for padding."""
    if not torch.compiler.is_compiling():  # (traced: no Python side effects in the graph)
        SEEN_MESHES.append((mesh.ndim, mesh.size()))
    rows = -(-outer_size[0] // mesh.size())
    start = mesh.get_local_rank() * rows
    ids = torch.arange(start + 1, start + 1 + self.shape[0], dtype=torch.int32)
    return (self, ids), outer_size[0]


def _rows_post(self, outputs, metadata, param_dtype, *, out=None):
    data, ids = outputs
    n = metadata
    assert ids.dtype == torch.int32 and torch.equal(ids[:n], torch.arange(1, n + 1, dtype=torch.int32)), ids
    assert not ids[n:].any(), ids  # padding rows are zeros
    if out is not None:
        return None  # the unsharded parameter is a view of ``data``, which was just refilled
    return data, (data,)


def _patch_rows_extension(model: nn.Module) -> int:
    """Give every weight's local shard the two methods (instance attributes, as PyTorch allows)."""
    patched = 0
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            local = p._local_tensor
            local.fsdp_pre_all_gather = _rows_pre.__get__(local)
            local.fsdp_post_all_gather = _rows_post.__get__(local)
            patched += 1
    return patched


def _rows_extension(layout: str) -> dict:
    """``layout``: fsdp, hsdp (2 x W/2), reshard_2, offload (CPUOffloadPolicy), meta (built on the
    meta device, to_empty, filled, then patched: the methods follow the shard when fully_shard
    moves it into padded storage at the first all-gather)."""
    from fully_shard import CPUOffloadPolicy, fully_shard

    rank, w = world()
    ref = make_mlp()  # float64, dims dividing by neither 2 nor 4, weights and biases
    if layout == "meta":
        with torch.device("meta"):
            model = make_mlp()
    else:
        model = copy.deepcopy(ref)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = cpu_mesh()
    reshard: Any = 2 if layout == "reshard_2" else True
    offload = CPUOffloadPolicy() if layout == "offload" else None
    for block in model[:3]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    if layout == "meta":
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                chunks = torch.chunk(r, w)  # Shard(0): ranks past the last chunk hold none
                p.to_local().copy_(chunks[rank] if rank < len(chunks) else r[:0])
    patched = _patch_rows_extension(model)
    SEEN_MESHES.clear()
    out = _train_pair(model, ref, mlp_batch, _mlp_loss, 3)
    return {**out, "patched": patched, "meshes": sorted(set(SEEN_MESHES))}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_extension_with_two_dtypes_trains_like_reference(ranks, world_size):
    layouts = ["fsdp"] + {1: [], 2: ["offload", "meta"], 4: ["hsdp", "reshard_2", "meta"]}[world_size]
    for layout in layouts:
        results = ranks(world_size).run(_rows_extension, layout)
        check(results, f"rows extension {layout} world {world_size} vs single process (float64)")
        shard = 2 if layout == "hsdp" else world_size
        for r in results:
            assert r["patched"] == 6, r
            assert r["meshes"] == [(1, shard)], r  # the 1-D shard mesh, on HSDP too


# -- bad extensions: clear errors ------------------------------------------------------------------


def _bad_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.reshape(-1),), None  # flattened: not rows, so no padding can be chosen


def _post_identity(self, outputs, metadata, param_dtype, *, out=None):
    return None if out is not None else (outputs[0], outputs)


def test_extension_errors_name_the_parameter_and_the_fix():
    from fake_world import fake_world

    from fully_shard import fully_shard

    x = torch.randn(2, 7, dtype=torch.float64)
    cases = [
        ("pre_only", TypeError, r"defines fsdp_pre_all_gather but not fsdp_post_all_gather"),
        ("post_only", TypeError, r"defines fsdp_post_all_gather but not fsdp_pre_all_gather"),
        ("arity", TypeError, r"has 3 parameters; fully_shard calls it as fsdp_pre_all_gather\(mesh\)"),
        ("rows", ValueError, r"each input's dim 0 must be the padded row count 7"),
        ("dim1", ValueError, r"sharded on dim 1; extensions gather dim-0 shards"),
        ("flat", ValueError, r"sharded flat \(FlatShard\); extensions gather dim-0 shards"),
    ]
    for case, error, match in cases:
        # Rank 1 of 2 holds 6 of the 13 rows of model[0][0].weight: a rank with padding.
        with fake_world(2, rank=1) as mesh:
            model = make_mlp()
            from fully_shard import FlatShard

            placement = {"dim1": lambda p: torch.distributed.tensor.Shard(p.ndim - 1),
                         "flat": lambda p: FlatShard()}.get(case)
            fully_shard(model, mesh=mesh, shard_placement_fn=placement)
            local = model[0][0].weight._local_tensor
            if case == "pre_only":
                local.fsdp_pre_all_gather = _rows_pre.__get__(local)
            elif case == "post_only":
                local.fsdp_post_all_gather = _post_identity.__get__(local)
            elif case == "arity":
                local.fsdp_pre_all_gather = (lambda mesh, size, stride: ((local,), None))
                local.fsdp_post_all_gather = _post_identity.__get__(local)
            else:
                local.fsdp_pre_all_gather = _bad_pre.__get__(local)
                local.fsdp_post_all_gather = _post_identity.__get__(local)
            with pytest.raises(error, match=match) as info:
                model(x)
            assert "0.0.weight" in str(info.value), info.value
