"""Mixed precision (issue #4) on real gloo ranks: bf16 compute with fp32 master weights and
fp32 reduction, against the fp32 reference and PyTorch's fully_shard with the same policy;
mixed original dtypes in one group; nested policies; input and output casts."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from llama_model import Llama, LlamaConfig, RMSNorm, loss_fn, synthetic_batch
from rank_utils import cpu_mesh, full, global_mean, world
from _parity import LLAMA_LR, _mlp_loss, mlp_batch

BF16 = torch.bfloat16
STEPS = 20
# Against a float64 single-process reference, derived (not measured): bf16 rounds weights and
# activations to 8 significant bits, relative error <= 2**-9 per rounding. The loss of the 2-block
# Llama passes through ~25 rounded stages (norms, 7 projections and attention per block, residual
# adds, the output projection), so with errors adding at most linearly its relative error is
# <= 25 * 2**-9 ~ 0.05, i.e. <= 0.05 * ln(vocab 101) ~ 0.23 for a loss of at most ln(101) (it only
# falls from there). Loose on purpose: the strict oracle here is PyTorch's fully_shard with the
# same policy, compared bit for bit.
BF16_LOSS_BOUND = 25 * 2**-9 * math.log(101)


def _policy(reduce_dtype=torch.float32, **kwargs):
    from fully_shard import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, **kwargs)


def _shard(model: Llama, shard_fn, policy_cls, nested_norm_fp32: bool = False) -> None:
    mesh = cpu_mesh()
    mp = policy_cls(param_dtype=BF16, reduce_dtype=torch.float32)
    for layer in model.layers:
        if nested_norm_fp32:
            for norm in (layer.attention_norm, layer.ffn_norm):
                shard_fn(norm, mesh=mesh, mp_policy=policy_cls(param_dtype=torch.float32, output_dtype=BF16))
        shard_fn(layer, mesh=mesh, mp_policy=mp)
    shard_fn(model, mesh=mesh, mp_policy=mp)


def _bf16_training(nested_norm_fp32: bool) -> dict:
    """20 steps: ours vs the fp32 single-process reference and vs PyTorch's fully_shard (same
    policy, same seed). Returns the per-step loss differences."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, debug, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(n_layers=2))
    theirs = copy.deepcopy(ours)
    ref = copy.deepcopy(ours).double()
    _shard(ours, fully_shard, MixedPrecisionPolicy, nested_norm_fp32)
    _shard(theirs, torch_fully_shard, TorchMP, nested_norm_fp32)
    opts = [torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for m in (ours, theirs, ref)]
    vs_ref, vs_torch = [], []
    norm_input_dtypes = set()
    if nested_norm_fp32:
        ours.layers[0].attention_norm.register_forward_pre_hook(lambda m, a: norm_input_dtypes.add(a[0].dtype))
    trace = None
    for step in range(STEPS):
        x, y = synthetic_batch(step, 8, 16, ours.cfg.vocab_size)
        lx, ly = x.chunk(w)[rank], y.chunk(w)[rank]
        losses = []
        for i, (model, opt) in enumerate(zip((ours, theirs, ref), opts)):
            inputs, targets = (lx, ly) if i < 2 else (x, y)
            if i == 0 and step == STEPS - 1:
                with debug.trace() as trace:
                    loss = loss_fn(model(inputs), targets)
                    loss.backward()
            else:
                loss = loss_fn(model(inputs), targets)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep .grad to check its dtype at the end
            losses.append(global_mean(loss) if i < 2 else loss.item())
        vs_ref.append(abs(losses[0] - losses[2]))
        vs_torch.append(abs(losses[0] - losses[1]))
    assert trace is not None
    ag = trace.select(op="all_gather", phase="forward")
    rs = trace.select(op="reduce_scatter")
    opt_state_dtypes = {t.dtype for s in opts[0].state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0}
    return {
        "vs_ref": vs_ref,
        "vs_torch": vs_torch,
        "param_vs_torch": max((full(a) - full(b)).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters())),
        "ag_dtypes": sorted({str(r.dtype) for r in ag}),
        "rs_dtypes": sorted({str(r.dtype) for r in rs}),
        "ag_bytes": [r.nbytes for r in ag],
        "fp32_param_bytes": [
            sum(p.numel() for p in m.parameters()) * 4
            for m in (ours, *ours.layers)
        ],
        "param_dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in ours.parameters()}),
        "opt_state_dtypes": sorted(str(d) for d in opt_state_dtypes),
        "norm_input_dtypes": sorted(str(d) for d in norm_input_dtypes),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bf16_tracks_fp32_and_matches_torch_fully_shard(ranks, world_size):
    for rank, r in enumerate(ranks(world_size).run(_bf16_training, False)):
        if rank == 0:
            print(f"world {world_size} per-step |loss - float64 reference|: " + " ".join(f"{d:.1e}" for d in r["vs_ref"]))
            print(f"world {world_size} per-step |loss - torch fully_shard|: " + " ".join(f"{d:.1e}" for d in r["vs_torch"]))
            print(f"world {world_size} max |param - torch fully_shard|: {r['param_vs_torch']:.1e}")
        assert max(r["vs_ref"]) <= BF16_LOSS_BOUND, r["vs_ref"]
        assert max(r["vs_torch"]) == 0.0 and r["param_vs_torch"] == 0.0, (r["vs_torch"], r["param_vs_torch"])
        if world_size > 1:  # one rank communicates nothing
            assert r["ag_dtypes"] == ["torch.bfloat16"] and r["rs_dtypes"] == ["torch.float32"], r
        assert r["param_dtypes"] == r["grad_dtypes"] == r["opt_state_dtypes"] == ["torch.float32"], r


def _fp32_gather_bytes() -> list[int]:
    from fully_shard import debug, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    x, y = synthetic_batch(0, 8, 16, model.cfg.vocab_size)
    with debug.trace() as t:
        loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank]).backward()
    return [r.nbytes for r in t.select(op="all_gather", phase="forward")]


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_all_gathers_move_half_the_bytes(ranks, world_size):
    bf16 = ranks(world_size).run(_bf16_training, False)[0]["ag_bytes"]
    fp32 = ranks(world_size).run(_fp32_gather_bytes)[0]
    assert [2 * b for b in bf16] == fp32, (bf16, fp32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_nested_fp32_norms_inside_bf16_blocks(ranks, world_size):
    for r in ranks(world_size).run(_bf16_training, True):
        print(f"nested world {world_size}: max |loss - float64 reference| {max(r['vs_ref']):.1e}")
        assert r["norm_input_dtypes"] == ["torch.float32"], r  # the norm's policy cast its input up
        assert max(r["vs_ref"]) <= BF16_LOSS_BOUND, r["vs_ref"]
        assert max(r["vs_torch"]) == 0.0 and r["param_vs_torch"] == 0.0, (r["vs_torch"], r["param_vs_torch"])


# -- mixed original dtypes in one group ------------------------------------------------------


class MixedDtypeMLP(nn.Module):
    """fp32 and bf16 parameters in the same module (one fully_shard call); casts explicit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.mid = nn.Linear(13, 11).to(BF16)
        self.norm = RMSNorm(11, 1e-5)
        self.out = nn.Linear(11, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x)).to(BF16)
        h = self.mid(h).float()
        return self.out(self.norm(h))


def _mixed_dtype_group() -> dict:
    """Ours: fp32 and bf16 parameters in one group. Oracle: PyTorch's fully_shard, which needs
    the bf16 layer in a group of its own. Same seed, same per-rank math, same reductions (each
    dtype reduced in its own dtype): results must agree to the bit. (Numerics against a
    single-process model are the float64 tests' job; bf16 sums in another order have no
    machine-independent tolerance.)"""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import debug, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = MixedDtypeMLP()
    theirs = copy.deepcopy(model)
    ref = copy.deepcopy(model)  # only for its dtypes
    fully_shard(model, mesh=cpu_mesh())
    torch_fully_shard(theirs.mid, mesh=cpu_mesh())
    torch_fully_shard(theirs, mesh=cpu_mesh())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, theirs)]
    vs_torch = []
    for step in range(5):
        x, y = mlp_batch(step, torch.float32)
        losses = []
        for i, (m, opt) in enumerate(zip((model, theirs), opts)):
            inputs, targets = x.chunk(w)[rank], y.chunk(w)[rank]
            with debug.trace() as t:
                loss = _mlp_loss(m, inputs, targets)
                loss.backward()
            if i == 0:
                trace = t
            opt.step()
            opt.zero_grad()
            losses.append(global_mean(loss))
        vs_torch.append(abs(losses[0] - losses[1]))
    return {
        "loss_vs_torch": max(vs_torch),
        "param_vs_torch": max((full(a) - full(b)).abs().max().item() for a, b in zip(model.parameters(), theirs.parameters())),
        "all_gathers": trace.count(op="all_gather"),
        "rs_dtypes": sorted(str(r.dtype) for r in trace.select(op="reduce_scatter")),
        "dtypes_kept": {n: str(p.dtype) for n, p in model.named_parameters()} == {n: str(p.dtype) for n, p in ref.named_parameters()},
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mixed_dtypes_in_one_group(ranks, world_size):
    """PyTorch's FSDP2 refuses this; here one all-gather carries both dtypes (as bytes) and each
    dtype is reduce-scattered in its own dtype."""
    for r in ranks(world_size).run(_mixed_dtype_group):
        print(r)
        assert r["dtypes_kept"] and r["all_gathers"] == (1 if world_size > 1 else 0), r
        assert r["rs_dtypes"] == (["torch.bfloat16", "torch.float32"] if world_size > 1 else []), r
        if world_size <= 2:  # two-term sums: the same bits whatever the buffer layout
            assert r["loss_vs_torch"] == 0.0 and r["param_vs_torch"] == 0.0, r
        # At 4 ranks the reduce-scatter carries one used-count per parameter after the gradients
        # (the layout every rank agrees on, whatever it routed), which PyTorch's does not: a sum of
        # 4 terms may then be ordered differently, and bf16 sums in another order have no
        # machine-independent tolerance. The layout logic is the same at every world size.


# -- input and output casts ------------------------------------------------------------------


def _casts(cast_forward_inputs: bool, output_dtype) -> dict:
    from fully_shard import MixedPrecisionPolicy, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    mp = MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=cast_forward_inputs, output_dtype=output_dtype)
    fully_shard(model[0], mesh=cpu_mesh(), mp_policy=mp)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=output_dtype))
    x = torch.randn(4, 7)
    error = ""
    out_dtype = None
    try:
        out = model[0](x.to(BF16) if not cast_forward_inputs else x)
        out_dtype = str(out.dtype)
    except RuntimeError as e:
        error = str(e)
    return {"seen": [str(d) for d in seen], "out_dtype": out_dtype, "error": error}


@pytest.mark.parametrize("world_size", [1, 2])
def test_cast_forward_inputs_and_output_dtype(ranks, world_size):
    on = ranks(world_size).run(_casts, True, None)[0]  # fp32 input, cast to bf16 on entry
    assert on["seen"] == ["torch.bfloat16"] and on["out_dtype"] == "torch.bfloat16", on
    up = ranks(world_size).run(_casts, True, torch.float32)[0]
    assert up["out_dtype"] == "torch.float32", up


def _no_cast_keeps_caller_dtype() -> dict:
    from fully_shard import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    lin = nn.Linear(7, 5)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    fully_shard(lin, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False))
    try:
        lin(torch.randn(2, 7))
        raised = False
    except RuntimeError:
        raised = True  # fp32 input against bf16 weights: the caller asked for no cast
    return {"seen": [str(d) for d in seen], "raised": raised}


@pytest.mark.parametrize("world_size", [1, 2])
def test_without_input_cast_the_input_dtype_is_the_callers(ranks, world_size):
    for r in ranks(world_size).run(_no_cast_keeps_caller_dtype):
        assert r["seen"] == ["torch.float32"] and r["raised"], r


def _ours_and_torchs(param_dtype, reduce_dtype, list_form: bool = False, hsdp: bool = False) -> tuple[Llama, Llama]:
    """The 2-block Llama (same seed) sharded by ours and by PyTorch's ``fully_shard`` with the same
    policy: each block (``list_form``: the blocks as one group), then the root (``hsdp``: on a
    (2, world / 2) mesh, replicated over its first dim)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    ours = Llama(LlamaConfig(n_layers=2))
    theirs = copy.deepcopy(ours)
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world()[1] // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = cpu_mesh()
    for model, shard_fn, cls in ((ours, fully_shard, MixedPrecisionPolicy), (theirs, torch_fully_shard, TorchMP)):
        mp = cls(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for blocks in [list(model.layers)] if list_form else model.layers:
            shard_fn(blocks, mesh=mesh, mp_policy=mp)
        shard_fn(model, mesh=mesh, mp_policy=mp)
    return ours, theirs


def _bf16_reduction() -> dict:
    """reduce_dtype=bf16: the reduce-scatter runs in bf16 (divided partly before the sum) and
    the gradient lands in fp32 on the shard; training matches PyTorch's fully_shard with the same
    policy bit for bit (both split the division the same way)."""
    from fully_shard import debug

    rank, w = world()
    ours, theirs = _ours_and_torchs(BF16, BF16)
    opts = [torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for m in (ours, theirs)]
    diffs = []
    for step in range(10):
        x, y = synthetic_batch(step, 8, 16, ours.cfg.vocab_size)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            with debug.trace() as t:
                loss = loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank])
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(global_mean(loss))
            if model is ours:
                rs_dtypes = sorted({str(r.dtype) for r in t.select(op="reduce_scatter")})
        diffs.append(abs(losses[0] - losses[1]))
    param_vs_torch = max((full(a) - full(b)).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return {"diffs": diffs, "param_vs_torch": param_vs_torch, "rs_dtypes": rs_dtypes, "grad_dtypes": sorted({str(p.grad.dtype) for p in ours.parameters()})}


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_reduction(ranks, world_size):
    for r in ranks(world_size).run(_bf16_reduction):
        print(f"world {world_size} |loss - torch fully_shard| per step: " + " ".join(f"{d:.1e}" for d in r["diffs"]))
        assert r["rs_dtypes"] == ["torch.bfloat16"] and r["grad_dtypes"] == ["torch.float32"], r
        assert max(r["diffs"]) == 0.0 and r["param_vs_torch"] == 0.0, r


def _accumulated_without_sync(param_dtype, reduce_dtype, list_form: bool, mode: str = "fsdp") -> dict:
    """Three micro-batches per step, the first two without gradient sync, ours against PyTorch's
    fully_shard with the same policy: PyTorch sums the gradients accumulated without sync in the
    reduce dtype where it differs from the param dtype (each micro-batch's bf16 gradient cast once,
    then added in float32; fp32 gradients cast down to a bf16 reduce dtype), not in the param dtype.
    ``list_form``: the blocks in one ``fully_shard([...])`` group. ``mode``: "hsdp" (no sync on a
    2-D mesh), "hsdp_defer" (reduce-scattered each micro-batch, the all-reduce deferred:
    ``set_requires_all_reduce(False)``; PyTorch holds those partial sums in the reduce dtype)."""
    rank, w = world()
    ours, theirs = _ours_and_torchs(param_dtype, reduce_dtype, list_form, hsdp=mode != "fsdp")
    opts = [torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for m in (ours, theirs)]
    losses: list[list[float]] = [[], []]
    held_dtypes = set()
    for step in range(3):
        for micro in range(3):
            x, y = synthetic_batch(3 * step + micro, 8, 16, ours.cfg.vocab_size)
            for i, model in enumerate((ours, theirs)):
                if mode == "hsdp_defer":
                    model.set_requires_all_reduce(micro == 2)
                else:
                    model.set_requires_gradient_sync(micro == 2)
                loss = loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank])
                loss.backward()
                losses[i].append(global_mean(loss))
            if micro == 1:  # what PyTorch holds between micro-batches: in the reduce dtype
                groups = [m._get_fsdp_state()._fsdp_param_group for m in theirs.modules()
                          if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group]
                if mode == "hsdp_defer":
                    held_dtypes |= {str(g._partial_reduce_output.dtype) for g in groups}
                else:
                    held_dtypes |= {str(fp.unsharded_accumulated_grad.dtype) for g in groups
                                    for fp in g.fsdp_params if fp.unsharded_accumulated_grad is not None}
        for opt in opts:
            opt.step()
            opt.zero_grad()
    param_vs_torch = max((full(a) - full(b)).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return {"losses_equal": losses[0] == losses[1], "param_vs_torch": param_vs_torch,
            "torch_held": sorted(held_dtypes)}


@pytest.mark.parametrize("world_size,param_dtype,reduce_dtype,list_form,mode", [
    (1, BF16, torch.float32, False, "fsdp"), (2, BF16, torch.float32, False, "fsdp"),
    (2, BF16, torch.float32, True, "fsdp"), (2, torch.float32, BF16, False, "fsdp"),
    (4, BF16, torch.float32, False, "fsdp"), (4, BF16, torch.float32, False, "hsdp"),
    (4, BF16, torch.float32, False, "hsdp_defer"), (2, torch.float32, BF16, False, "hsdp")])
def test_gradients_accumulated_without_sync_sum_in_the_reduce_dtype_as_torch_fully_shard(
        ranks, world_size, param_dtype, reduce_dtype, list_form, mode):
    """Before: ours summed them in the param dtype (bf16 here), 1e-4 off PyTorch's after one step."""
    for r in ranks(world_size).run(_accumulated_without_sync, param_dtype, reduce_dtype, list_form, mode):
        print(f"world {world_size} {param_dtype} / {reduce_dtype} list={list_form} {mode}: {r}")
        assert r["torch_held"] == [str(reduce_dtype)], r  # (the oracle's rule, as read)
        assert r["losses_equal"] and r["param_vs_torch"] == 0.0, r


def _tp_accumulated_without_sync(shape, param_dtype, reduce_dtype) -> dict:
    """Tensor + sequence parallel blocks (the norms' gradients Partial over the TP mesh), three
    micro-batches per step, the first two without sync, ours against PyTorch's fully_shard: PyTorch
    sums each Partial gradient in the reduce dtype as the DTensor autograd made and redistributes
    the sum once; ours did each micro-batch's in the param dtype before the cast (up to 2e-2 off)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from _parity import make_sp_model, sp_batch
    from fully_shard import MixedPrecisionPolicy, fully_shard
    from fully_shard.runtime.registry import manager_of

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    models = [make_sp_model(mesh, fully_shard, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)),
              make_sp_model(mesh, torch_fully_shard, TorchMP(param_dtype=param_dtype, reduce_dtype=reduce_dtype))]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses: list[list[float]] = [[], []]
    held = []
    for step in range(2):
        for micro in range(3):
            x = sp_batch(mesh, 3 * step + micro)
            for i, model in enumerate(models):
                model.set_requires_gradient_sync(micro == 2)
                loss = model(x).float().pow(2).mean()
                loss.backward()
                losses[i].append(loss.item())
            if micro == 1:  # the norm weight's held sums: ours, PyTorch's
                norm = models[1][0]._get_fsdp_state()._fsdp_param_group
                theirs = next(fp for fp in norm.fsdp_params if fp.sharded_param is models[1][0].norm.weight)
                ours = manager_of(models[0][0].norm.weight).unsynced_grad
                held.append([(type(t).__name__, str(t.placements), str(t.dtype))
                             for t in (ours, theirs.unsharded_accumulated_grad)])
        for opt in opts:
            opt.step()
            opt.zero_grad()
    a, b = ({n: p.full_tensor() for n, p in m.named_parameters()} for m in models)
    # zero_grad drops a held Partial sum without redistributing it (no collective)
    models[0].set_requires_gradient_sync(False)
    models[0](sp_batch(mesh, 99)).float().pow(2).mean().backward()
    was_held = manager_of(models[0][0].norm.weight).unsynced_grad is not None
    with _OpNames() as seen:
        models[0].zero_grad()
    return {"losses_equal": losses[0] == losses[1], "param_vs_torch": max((a[n] - b[n]).abs().max().item() for n in a),
            "held": held, "zero_grad_dropped": was_held and manager_of(models[0][0].norm.weight).unsynced_grad is None,
            "zero_grad_collectives": sorted(n for n in seen if "c10d" in n)}


@pytest.mark.parametrize("world_size,shape,param_dtype,reduce_dtype", [
    (1, (1, 1), BF16, torch.float32), (2, (1, 2), BF16, torch.float32), (2, (1, 2), torch.float32, BF16),
    (4, (2, 2), BF16, torch.float32)])
def test_tensor_parallel_gradients_accumulated_without_sync_are_torch_fully_shards_to_the_bit(
        ranks, world_size, shape, param_dtype, reduce_dtype):
    for r in ranks(world_size).run(_tp_accumulated_without_sync, shape, param_dtype, reduce_dtype):
        print(f"world {world_size} tp {shape} {param_dtype} / {reduce_dtype}: {r}")
        # both hold the DTensor autograd made (Partial on the TP mesh) in the reduce dtype (the
        # oracle's rule, as read), after each of the two steps' micro-batches without sync
        assert r["held"] == [[("DTensor", "(Partial(sum),)", str(reduce_dtype))] * 2] * 2, r
        assert r["losses_equal"] and r["param_vs_torch"] == 0.0, r
        assert r["zero_grad_dropped"] and r["zero_grad_collectives"] == [], r


class _OpNames(TorchDispatchMode):
    """The names of the ops dispatched inside it."""

    def __enter__(self):
        self.names: set[str] = set()
        super().__enter__()
        return self.names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _force_sum(reduce_dtype) -> dict:
    """set_force_sum_reduction_for_comms(True): SUM collectives, our division around them (traced);
    training equals PyTorch's fully_shard with the same setting, and our default, bit for bit (on
    gloo the default sums too; powers of two divide exactly)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from _parity import max_abs_diff
    from fully_shard import MixedPrecisionPolicy, debug, fully_shard

    rank, w = world()
    models = {}
    for name, shard_fn, cls in (("forced", fully_shard, MixedPrecisionPolicy), ("default", fully_shard, MixedPrecisionPolicy),
                                ("torch_forced", torch_fully_shard, TorchMP)):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=2))
        mp = cls(param_dtype=BF16, reduce_dtype=reduce_dtype)
        for layer in model.layers:
            shard_fn(layer, mesh=cpu_mesh(), mp_policy=mp)
        shard_fn(model, mesh=cpu_mesh(), mp_policy=mp)
        if name != "default":
            model.set_force_sum_reduction_for_comms(True)
        models[name] = model
    opts = {name: torch.optim.AdamW(m.parameters(), lr=LLAMA_LR) for name, m in models.items()}
    for step in range(3):
        x, y = synthetic_batch(step, 8, 16, 101)
        for name, model in models.items():
            with debug.trace() as t:
                loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank]).backward()
            opts[name].step()
            opts[name].zero_grad()
            if name == "forced":
                reductions = sorted({(r.reduce_op, r.pre_divide, r.post_divide) for r in t.select(op="reduce_scatter")})
    return {"reductions": reductions, "vs_torch": max_abs_diff(models["forced"], models["torch_forced"]),
            "vs_default": max_abs_diff(models["forced"], models["default"])}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reduce_dtype", [BF16, torch.float32])
def test_force_sum_reduction_for_comms(ranks, world_size, reduce_dtype):
    # bf16 divides by the smallest power of two p with W / p <= p before the sum, the rest after; fp32 after.
    before = 2.0 if reduce_dtype == BF16 else 1.0
    for r in ranks(world_size).run(_force_sum, reduce_dtype):
        assert r["reductions"] == [("sum", before, world_size / before)], r
        assert r["vs_torch"] == 0.0 and r["vs_default"] == 0.0, r


def _fp16_sum_above_max() -> float:
    """Each rank's gradient is below fp16's max (65504), their sum is not: 38000 at 2 ranks, 20000
    at 4 (the sum of halves, 40000, still fits)."""
    from fully_shard import MixedPrecisionPolicy, fully_shard

    _, w = world()
    g = 38000.0 if w <= 2 else 20000.0
    model = nn.Linear(1, 1, bias=False)
    nn.init.ones_(model.weight)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
    model(torch.full((1, 1), g)).sum().backward()
    return full(model.weight.grad).item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_gradients_whose_sum_exceeds_fp16_max_average_finite(ranks, world_size):
    """Issue #23: divided by 2 before the sum (PyTorch's split), so the mean is finite and exact
    (the input's fp16 value: 38000 rounds to 38016)."""
    expected = torch.tensor(38000.0 if world_size == 2 else 20000.0).half().item()
    assert ranks(world_size).run(_fp16_sum_above_max) == [expected] * world_size
