"""Tier 3 runtime behaviour on real gloo ranks: collective schedule, memory, and the training
patterns the core must get right (tied, frozen, ignored, repeated forward, standalone blocks,
gradient accumulation, state dict)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch
from rank_utils import CollectiveLog, cpu_mesh, full, global_mean, max_param_diff, world
from _parity import TOL64, _mlp_loss, _train_pair, make_mlp, mlp_batch, nested_mlp_and_reference, shard_mlp, llama64


def _all_states(model: nn.Module):
    return [m.__dict__["_fsdp_state"] for m in model.modules() if "_fsdp_state" in m.__dict__]


def _unsharded_bytes_alive(model: nn.Module) -> int:
    total = 0
    for state in _all_states(model):
        for p in state.group.params if state.group else ():
            total += p.padded_unsharded.untyped_storage().nbytes()
    return total


# -- collective schedule -------------------------------------------------------------------------


def _schedule(reshard: bool, bucket: bool) -> list[dict]:
    from fully_shard import fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=3))
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh(), reshard_after_forward=reshard)
    fully_shard(model, mesh=cpu_mesh())
    if not bucket:
        model.set_bucket_bytes(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for step in range(3):
        x, y = synthetic_batch(step, 4, 8, model.cfg.vocab_size)
        with CollectiveLog() as fwd:
            loss = loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank])
        with CollectiveLog() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        steps.append(
            {
                "fwd_all_gather": fwd.count("all_gather"),
                "fwd_reduce_scatter": fwd.count("reduce_scatter"),
                "bwd_all_gather": bwd.count("all_gather"),
                "bwd_reduce_scatter": bwd.count("reduce_scatter"),
                "collectives": len(fwd.calls) + len(bwd.calls),  # of any kind, seen by the dispatcher
                "unsharded_bytes_after_step": _unsharded_bytes_alive(model),
                "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            }
        )
    return steps


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("bucket", [True, False])
def test_collectives_per_step(ranks, world_size, reshard, bucket):
    """3 blocks + root: one all-gather per group in forward; blocks gather again in backward only
    when resharded (the root keeps its parameters); one reduce-scatter per group. Bucketed (the
    default), the 3 small blocks are one group for communication; blocks that keep their
    parameters after forward leave the bucket's schedule and communicate alone."""
    for steps in ranks(world_size).run(_schedule, reshard, bucket):
        for s in steps:
            assert s["unsharded_bytes_after_step"] == 0 and s["all_dtensor"], s
            if world_size == 1:  # one rank: nothing to gather or reduce, so no collective at all
                assert s["collectives"] == 0, s
                continue
            blocks = 1 if bucket and reshard else 3
            assert s["fwd_all_gather"] == 1 + blocks and s["fwd_reduce_scatter"] == 0, s
            assert s["bwd_all_gather"] == (blocks if reshard else 0), s
            assert s["bwd_reduce_scatter"] == 1 + blocks, s
            assert s["collectives"] == 1 + blocks + (blocks if reshard else 0) + 1 + blocks, s


def _frozen_traffic() -> dict:
    """A frozen weight shares a group with trainable ones: all-gathered, never reduce-scattered."""
    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    model[0][0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    fully_shard(model[0], mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    group = model[0].__dict__["_fsdp_state"].group
    # The trainable gradients, then one used-count per trainable parameter in every rank's row.
    trainable_numel = (sum(p.shard_numel for p in group.trainable) + len(group.trainable)) * w
    with CollectiveLog() as log:
        x, y = mlp_batch(0)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    rs_sizes = [n for op, n in log.calls if op == "reduce_scatter"]
    frozen_grad_none = model[0][0].weight.grad is None
    model.zero_grad()
    result = _train_pair(model, ref, mlp_batch, _mlp_loss, 5)
    return {**result, "rs_sizes": rs_sizes, "trainable_numel": trainable_numel, "frozen_grad_none": frozen_grad_none}


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_params_get_no_gradient_traffic(ranks, world_size):
    for r in ranks(world_size).run(_frozen_traffic):
        assert r["frozen_grad_none"]
        assert r["trainable_numel"] in r["rs_sizes"], r  # block 0's reduce-scatter carries only trainable grads
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


# -- memory --------------------------------------------------------------------------------------


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (DTensors count their shards)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type == "meta":
            continue
        try:  # fake and functional tensors left by torch.compile have no real storage
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(storages.values())


def _train_one_step(model: nn.Module, sharded: bool) -> None:
    rank, w = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(0, 4, 8, model.cfg.vocab_size)
    if sharded:
        x, y = x.chunk(w)[rank], y.chunk(w)[rank]
    loss_fn(model(x), y).backward()
    opt.step()
    # Keep the optimizer (and its state) alive until the measurement.
    model._test_opt = opt  # type: ignore[attr-defined]


def _memory_ratio() -> dict:
    from fully_shard import fully_shard

    import torch._dynamo

    torch._dynamo.reset()  # drop graphs (and the tensors they hold) left by earlier compile tests
    cfg = LlamaConfig(vocab_size=512, dim=128, hidden_dim=344, n_layers=4)
    base = _live_tensor_bytes()
    torch.manual_seed(0)
    plain = llama64(cfg)
    _train_one_step(plain, sharded=False)
    plain_bytes = _live_tensor_bytes() - base
    del plain
    base = _live_tensor_bytes()
    torch.manual_seed(0)
    model = llama64(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    _train_one_step(model, sharded=True)
    sharded_bytes = _live_tensor_bytes() - base
    return {"plain": plain_bytes, "sharded": sharded_bytes, "unsharded_alive": _unsharded_bytes_alive(model)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_live_bytes_after_step_are_one_over_world(ranks, world_size):
    for r in ranks(world_size).run(_memory_ratio):
        ratio = r["sharded"] / r["plain"]
        print(f"world {world_size}: live bytes sharded/unsharded = {ratio:.3f} (ideal {1 / world_size:.3f})")
        assert r["unsharded_alive"] == 0
        # Parameters, gradients and AdamW state are sharded; padding and the unsharded buffers
        # (buffers are replicated, a few KB here) are the only excess.
        assert ratio <= 1 / world_size * 1.05, r


# -- training patterns ---------------------------------------------------------------------------


class TwiceMLP(nn.Module):
    """Runs ``block`` twice per forward: its gradient sums both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 11)
        self.block = nn.Sequential(nn.Linear(11, 11), nn.Tanh())
        self.out = nn.Linear(11, 3)

    def forward(self, x):
        return self.out(self.block(self.block(self.inp(x))))


def _twice_parity(reshard: bool) -> dict:
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = TwiceMLP().double()
    ref = copy.deepcopy(model)
    fully_shard(model.block, mesh=cpu_mesh(), reshard_after_forward=reshard)
    fully_shard(model, mesh=cpu_mesh())
    return _train_pair(model, ref, mlp_batch, _mlp_loss, 5)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_module_run_twice_per_forward(ranks, world_size, reshard):
    for r in ranks(world_size).run(_twice_parity, reshard):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _standalone_block() -> dict:
    """After the root's first step, a non-root block's forward/backward on its own gives the
    reference gradients and leaves nothing unsharded."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    x, y = mlp_batch(0)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    model.zero_grad()
    h = torch.randn(8, 11, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    model[1](h.chunk(w)[rank]).pow(2).mean().backward()
    ref[1](h).pow(2).mean().backward()
    diffs = [(full(p.grad) - q.grad).abs().max().item() for p, q in zip(model[1].parameters(), ref[1].parameters())]
    return {"grad_diff": max(diffs), "unsharded": _unsharded_bytes_alive(model)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_non_root_block_alone(ranks, world_size):
    for r in ranks(world_size).run(_standalone_block):
        assert r["grad_diff"] <= TOL64 and r["unsharded"] == 0, r


def _accumulate_two_backwards() -> dict:
    """Two backward calls (half the batch each, loss scaled by 1/2) before one step equal one
    step on the whole batch: reduce-scattered gradients add into the sharded ``.grad``."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = mlp_batch(step)
        lx, ly = x.chunk(w)[rank], y.chunk(w)[rank]
        for mx, my in zip(lx.chunk(2), ly.chunk(2)):
            (_mlp_loss(model, mx, my) / 2).backward()
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gradient_accumulation_across_backward_calls(ranks, world_size):
    for r in ranks(world_size).run(_accumulate_two_backwards):
        assert r["param_diff"] <= TOL64, r


def _structure() -> dict:
    """Tied weights stay one parameter; buffers and ignored parameters are left unsharded;
    the state dict has DTensors under the original names and round-trips."""
    from fully_shard import FSDPModule, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = llama64()
    names_before = list(model.state_dict().keys())
    ignored = model.norm.weight
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh(), ignored_params={ignored})
    sd = {k: v.detach().clone() if not isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = synthetic_batch(0, 4, 8, model.cfg.vocab_size)
    loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank]).backward()
    opt.step()
    changed = max((full(model.state_dict()[k]) - full(sd[k])).abs().max().item() for k in sd if isinstance(sd[k], DTensor))
    model.load_state_dict(sd)
    restored = max((full(model.state_dict()[k]) - full(sd[k])).abs().max().item() for k in sd)
    return {
        "names_same": names_before == list(model.state_dict().keys()),
        "tied_same_object": model.output.weight is model.tok_embeddings.weight,
        "tied_dtensor": isinstance(model.output.weight, DTensor),
        "ignored_plain": not isinstance(model.norm.weight, DTensor) and model.norm.weight is ignored,
        "buffers_plain": all(not isinstance(b, DTensor) for b in model.buffers()),
        "isinstance": isinstance(model, FSDPModule) and isinstance(model, Llama) and isinstance(model.layers[0], FSDPModule),
        "params_dtensor": all(isinstance(p, DTensor) for n, p in model.named_parameters() if p is not ignored),
        "changed": changed,
        "restored": restored,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_structure_and_state_dict_round_trip(ranks, world_size):
    for r in ranks(world_size).run(_structure):
        assert r["names_same"] and r["tied_same_object"] and r["tied_dtensor"], r
        assert r["ignored_plain"] and r["buffers_plain"] and r["isinstance"] and r["params_dtensor"], r
        assert r["changed"] > 0 and r["restored"] == 0, r


def _forward_without_backward_then_step() -> dict:
    """A grad-enabled forward that never runs backward (e.g. a logged validation loss) leaves the
    root unsharded; an optimizer step then changes the shards. The next forward must use the new
    values, not the stale unsharded copy."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    diffs = []
    for step in range(3):
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        _mlp_loss(ref, x, y).backward()
        val = _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])  # no backward for this one
        ref_val = _mlp_loss(ref, x, y)
        diffs.append(abs(global_mean(val) - ref_val.item()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    x, y = mlp_batch(9)
    diffs.append(abs(global_mean(_mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])) - _mlp_loss(ref, x, y).item()))
    return {"loss_diff": max(diffs), "param_diff": max_param_diff(model, ref)}


class _DataSGD(torch.optim.Optimizer):
    """SGD that writes through ``p.data`` (as older optimizers do): below every version counter."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _data_updates_while_unsharded(kept: str) -> dict:
    """Parameters kept unsharded across the optimizer step (the root after a forward whose backward
    never ran, or every block with ``reshard_after_backward=False``), and an optimizer that updates
    through ``p.data``, which no version counter sees: the optimizer's step still marks the
    unsharded copies stale, so the next forward gathers the new values."""
    rank, w = world()
    model, ref = nested_mlp_and_reference()
    if kept == "after_backward":
        model.set_reshard_after_backward(False)
    opt, ref_opt = _DataSGD(model.parameters(), lr=0.1), _DataSGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        _mlp_loss(ref, x, y).backward()
        if kept == "validation_forward":
            _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])  # no backward for this one
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    x, y = mlp_batch(9)
    loss_diff = abs(
        global_mean(_mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank])) - _mlp_loss(ref, x, y).item()
    )
    return {"loss_diff": loss_diff, "param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kept", ["validation_forward", "after_backward"])
def test_optimizer_writing_through_data_while_unsharded(ranks, world_size, kept):
    for r in ranks(world_size).run(_data_updates_while_unsharded, kept):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _eval_under_no_grad() -> dict:
    """Evaluation under no_grad matches the reference and keeps nothing unsharded, root included."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    x, _ = mlp_batch(0)
    with torch.no_grad():
        out = model(x.chunk(w)[rank])
        expected = ref(x).chunk(w)[rank]
    return {"diff": (out - expected).abs().max().item(), "unsharded": _unsharded_bytes_alive(model)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forward_without_backward_never_uses_stale_parameters(ranks, world_size):
    for r in ranks(world_size).run(_forward_without_backward_then_step):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_eval_under_no_grad(ranks, world_size):
    for r in ranks(world_size).run(_eval_under_no_grad):
        assert r["diff"] <= TOL64 and r["unsharded"] == 0, r


def _iteration_phases() -> dict:
    """The root's iteration phase at each point of two micro-batches, an evaluation forward and a
    second backward through a retained graph; and what an event the table does not allow does."""
    from fully_shard.runtime.lifecycle import Event

    model, _ = nested_mlp_and_reference()
    ctx_phase = lambda: model._get_fsdp_state().ctx.phase.name  # noqa: E731
    seen = []
    model[2].register_full_backward_hook(lambda *_: seen.append(("in backward", ctx_phase())))
    x, y = mlp_batch(0)
    loss = _mlp_loss(model, x, y)
    seen.append(("after forward", ctx_phase()))
    loss.backward(retain_graph=True)
    seen.append(("after backward", ctx_phase()))
    loss.backward()  # the retained graph again: a backward with no forward before it
    seen.append(("after second backward", ctx_phase()))
    with torch.no_grad():
        model(x)
    seen.append(("after no-grad forward", ctx_phase()))
    _mlp_loss(model, x, y).backward()
    seen.append(("after next step", ctx_phase()))
    try:
        model._get_fsdp_state().ctx.handle(Event.BACKWARD_END)
        error = ""
    except RuntimeError as e:
        error = str(e)
    return {"seen": seen, "error": error}


def test_iteration_phases_follow_the_table(ranks):
    (r,) = ranks(1).run(_iteration_phases)
    assert r["seen"] == [
        ("after forward", "FORWARD"),
        ("in backward", "BACKWARD"),
        ("after backward", "IDLE"),
        ("in backward", "BACKWARD"),
        ("after second backward", "IDLE"),
        ("after no-grad forward", "FORWARD"),
        ("in backward", "BACKWARD"),
        ("after next step", "IDLE"),
    ], r["seen"]
    assert "root Sequential: BACKWARD_END is not expected while in IDLE" in r["error"], r["error"]


# -- changes made behind the engine's back: events, not polling ----------------------------------


def _changes_are_events() -> dict:
    """A parameter assigned or loaded is noticed where it happens (the registration hook, the load
    hook), not by asking every parameter at every unshard: steady steps take nothing over. A local
    tensor swapped with no event to report it (``.to()`` on a module fully_shard was not applied
    to) is looked for once, when the root's forward starts."""
    from fully_shard.runtime.param_group import FSDPParamGroup

    model, ref = nested_mlp_and_reference()
    synced: list[str] = []
    original = FSDPParamGroup.sync_params

    def counting(self, *args, **kwargs):
        synced.append(self.fqn or "<root>")
        return original(self, *args, **kwargs)

    FSDPParamGroup.sync_params = counting
    try:
        _train_pair(model, ref, mlp_batch, _mlp_loss, 1)
        first = sorted(synced)
        groups = {s.fqn or "<root>": s.group for s in _all_states(model)}  # named at lazy init
        synced.clear()
        _train_pair(model, ref, mlp_batch, _mlp_loss, 2)
        steady = list(synced)
        # An assignment (a plain full tensor: each rank keeps its chunk) marks its group at once.
        new = ref[0][0].weight.detach() * 0.5
        model[0][0].weight = nn.Parameter(new.clone())
        with torch.no_grad():
            ref[0][0].weight.copy_(new)
        assigned = sorted(k for k, g in groups.items() if g.needs_sync)
        with torch.no_grad():  # taken over here, so the optimizer below sees the new shard
            model(mlp_batch(0)[0])
        after_assign = _train_pair(model, ref, mlp_batch, _mlp_loss, 2)
        synced.clear()
        # A load marks every group it loaded into.
        model.load_state_dict(model.state_dict())
        loaded = sorted(k for k, g in groups.items() if g.needs_sync)
        _train_pair(model, ref, mlp_batch, _mlp_loss, 1)
        synced.clear()
        # No event: values rounded to float32 under block 2's plain Linear, in both models.
        model[2][2].to(torch.float32).to(torch.float64)
        ref[2][2].to(torch.float32).to(torch.float64)
        silent = sorted(k for k, g in groups.items() if g.needs_sync)
        after_swap = _train_pair(model, ref, mlp_batch, _mlp_loss, 2)
        swapped = sorted(set(synced))
    finally:
        FSDPParamGroup.sync_params = original
    return {
        "first": first, "steady": steady, "assigned": assigned, "after_assign": after_assign,
        "loaded": loaded, "silent": silent, "swapped": swapped, "after_swap": after_swap,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_changes_are_noticed_by_events_not_polling(ranks, world_size):
    everyone = ["0", "1", "2", "<root>"]
    for r in ranks(world_size).run(_changes_are_events):
        assert r["first"] == everyone and r["steady"] == [], r  # the first unshard only
        assert r["assigned"] == ["0"] and r["loaded"] == everyone and r["silent"] == [], r
        assert r["swapped"] == ["2"], r  # found at the root's forward start
        for key in ("after_assign", "after_swap"):
            assert r[key]["loss_diff"] <= TOL64 and r[key]["param_diff"] <= TOL64, (key, r)


def _deleted_param_refused(how: str) -> str:
    """nn.Module reports neither ``del module.weight`` nor ``module.weight = None`` to the
    registration hook: the root's forward start finds it, and the next unshard refuses it."""
    model, _ = nested_mlp_and_reference()
    x = mlp_batch(0)[0]
    model(x).sum().backward()
    if how == "none":
        model[0][0].weight = None
    else:
        del model[0][0].weight
    try:
        model(x)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_deleted_parameter_is_refused_not_restored(ranks, world_size):
    for how in ("none", "del"):
        for error in ranks(world_size).run(_deleted_param_refused, how):
            assert "parameter '0.0.weight' was replaced after fully_shard by nothing (it was deleted)" in error, error
            assert "Fix: assign a tensor of that global shape" in error, error
