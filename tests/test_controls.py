"""Training-loop controls (issue #3) on real gloo ranks: gradient accumulation, prefetch,
resharding knobs, manual unshard, reset after a failure, the gather-full-parameters context and
the collective trace that these tests use to assert schedules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch
from rank_utils import cpu_mesh, full, global_mean, max_param_diff, world
from _parity import nested_mlp_and_reference, sharded_generate_model, TOL64, _mlp_loss, make_mlp, mlp_batch, shard_mlp, llama64


def _llama(n_layers: int = 3, reshard: bool = True):
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=n_layers))
    ref = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, mesh=cpu_mesh(), reshard_after_forward=reshard)
    fully_shard(model, mesh=cpu_mesh())
    return model, ref


def _llama_step(model, step: int) -> torch.Tensor:
    rank, w = world()
    x, y = synthetic_batch(step, 4, 8, model.cfg.vocab_size)
    loss = loss_fn(model(x.chunk(w)[rank]), y.chunk(w)[rank])
    loss.backward()
    return loss


def _records(t, **filters) -> list[tuple[str, str, str]]:
    return [(r.phase, r.op, r.module) for r in t.select(**filters)]


# -- gradient accumulation -------------------------------------------------------------------


def _accumulate(sync_every: bool, reshard_after_backward: bool) -> dict:
    """4 micro-batches, one optimizer step, vs one step on the concatenated batch."""
    from fully_shard import debug

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rs_per_microbatch, ag_per_microbatch = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 7, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)  # 16 rows: 4 micro-batches per rank at world <= 4
        lx, ly = x.chunk(w)[rank], y.chunk(w)[rank]
        micro = list(zip(lx.chunk(4), ly.chunk(4)))
        for i, (mx, my) in enumerate(micro):
            last = i == len(micro) - 1
            model.set_requires_gradient_sync(sync_every or last)
            model.set_reshard_after_backward(reshard_after_backward or last)
            with debug.trace() as t:
                # Each micro-batch loss is its mean over its rows; scale to the mean over the rank's rows.
                (_mlp_loss(model, mx, my) * mx.shape[0] / lx.shape[0]).backward()
            rs_per_microbatch.append(t.count(op="reduce_scatter"))
            ag_per_microbatch.append(t.count(op="all_gather"))
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, ref), "rs": rs_per_microbatch, "ag": ag_per_microbatch}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sync_every", [False, True])
def test_gradient_accumulation_without_sync_equals_one_big_step(ranks, world_size, sync_every):
    for r in ranks(world_size).run(_accumulate, sync_every, True):
        assert r["param_diff"] <= TOL64, r
        # The root's group and one bucket of the 3 small blocks; one rank communicates nothing.
        groups = 2 if world_size > 1 else 0
        for i, rs in enumerate(r["rs"]):
            last = i % 4 == 3
            assert rs == (groups if sync_every or last else 0), r["rs"]


@pytest.mark.parametrize("world_size", [2])
def test_no_reshard_after_backward_skips_all_gathers_between_micro_batches(ranks, world_size):
    for r in ranks(world_size).run(_accumulate, False, False):
        assert r["param_diff"] <= TOL64, r
        # Micro-batch 0 of each step gathers every group (4 forward + 3 backward; blocks that keep
        # their parameters after backward leave the bucket's schedule, so each gathers alone);
        # 1-3 reuse the unsharded parameters kept after backward: forward gathers nothing,
        # backward only what forward resharded (3 blocks, alone in 1-2; in the last micro-batch
        # they reshard after backward again, so they gather as one bucket).
        for i, ag in enumerate(r["ag"]):
            assert ag == (7 if i % 4 == 0 else 1 if i % 4 == 3 else 3), r["ag"]


# -- schedules asserted with the trace --------------------------------------------------------


def _schedule(kind: str) -> dict:
    from fully_shard import debug

    model, _ = _llama(reshard=2 if kind == "int2" else kind != "no_reshard")
    layers = model.layers
    if kind == "forward_prefetch":
        for i in range(len(layers) - 1):
            layers[i].set_modules_to_forward_prefetch([layers[i + 1]])
    elif kind == "backward_prefetch":
        model.set_modules_to_backward_prefetch([layers[2], layers[1]])  # two at once from the root
        layers[2].set_modules_to_backward_prefetch([])
        layers[1].set_modules_to_backward_prefetch([layers[0]])
    elif kind == "runtime_no_reshard":
        model.set_reshard_after_forward(False)  # recurse: the blocks too
    model.set_bucket_bytes(0)  # each group's own collectives (bucketed schedules: test_bucket.py)
    _llama_step(model, 0)  # warm-up (lazy init)
    model.zero_grad()
    with debug.trace() as t:
        if kind == "manual_unshard":
            handle = model.unshard(async_op=True)
            handle.wait()
        loss = _llama_step(model, 1)
    return {
        "forward": _records(t, op="all_gather", phase="forward"),
        "forward_prefetch": _records(t, op="all_gather", phase="forward_prefetch"),
        "backward": [(r.phase, r.module) for r in t.select(op="all_gather") if r.phase.startswith("backward")],
        "backward_group_sizes": [r.group_size for r in t.select(op="all_gather") if r.phase.startswith("backward")],
        "forward_group_sizes": [r.group_size for r in t.select(op="all_gather", phase="forward")],
        "backward_bytes": [r.nbytes for r in t.select(op="all_gather") if r.phase.startswith("backward")],
        "explicit": _records(t, op="all_gather", phase="explicit"),
        "reduce_scatter": t.count(op="reduce_scatter"),
        "summary": t.summary(),
        "loss": global_mean(loss),
    }


@pytest.mark.parametrize("world_size", [2, 4])  # schedules; one rank communicates nothing (test_runtime)
def test_implicit_backward_prefetch_schedule(ranks, world_size):
    for r in ranks(world_size).run(_schedule, "implicit"):
        print(r["summary"])
        assert [m for _, _, m in r["forward"]] == ["<root>", "layers.0", "layers.1", "layers.2"]
        # Each block's all-gather is issued by the backward of the module after it (reverse order).
        assert r["backward"] == [("backward_prefetch", f"layers.{i}") for i in (2, 1, 0)]
        assert r["reduce_scatter"] == 4


@pytest.mark.parametrize("world_size", [2, 4])  # schedules; one rank communicates nothing (test_runtime)
def test_explicit_forward_prefetch_schedule(ranks, world_size):
    results = ranks(world_size).run(_schedule, "forward_prefetch")
    baseline = ranks(world_size).run(_schedule, "implicit")
    for r, b in zip(results, baseline):
        assert [m for _, _, m in r["forward"]] == ["<root>", "layers.0"]
        assert [m for _, _, m in r["forward_prefetch"]] == ["layers.1", "layers.2"]
        assert abs(r["loss"] - b["loss"]) == 0.0  # same math, different schedule


@pytest.mark.parametrize("world_size", [2, 4])  # schedules; one rank communicates nothing (test_runtime)
def test_explicit_backward_prefetch_schedule(ranks, world_size):
    for r in ranks(world_size).run(_schedule, "backward_prefetch"):
        assert r["backward"] == [("backward_prefetch", "layers.2"), ("backward_prefetch", "layers.1"),
                                 ("backward_prefetch", "layers.0")]


@pytest.mark.parametrize("world_size", [2, 4])  # schedules; one rank communicates nothing (test_runtime)
@pytest.mark.parametrize("kind", ["no_reshard", "runtime_no_reshard"])
def test_no_reshard_after_forward_means_no_backward_all_gather(ranks, world_size, kind):
    for r in ranks(world_size).run(_schedule, kind):
        assert len(r["forward"]) == 4 and r["backward"] == [] and r["reduce_scatter"] == 4, r["summary"]


def test_reshard_after_forward_int_gathers_within_the_smaller_group(ranks):
    """World 4, reshard_after_forward=2: forward gathers over 4 ranks, backward over pairs."""
    for r in ranks(4).run(_schedule, "int2"):
        print(r["summary"])
        assert r["forward_group_sizes"] == [4, 4, 4, 4]
        assert r["backward"] == [("backward_prefetch", f"layers.{i}") for i in (2, 1, 0)]
        assert r["backward_group_sizes"] == [2, 2, 2]


def _reshard_int_parity(k) -> dict:
    from _parity import LLAMA_LR, _llama_loss, _train_pair, llama_batch

    model, ref = _llama(reshard=k)
    result = _train_pair(model, ref, llama_batch, _llama_loss, 5, LLAMA_LR)
    states = [m.__dict__["_fsdp_state"] for m in model.modules() if "_fsdp_state" in m.__dict__]
    result["post_forward_alive"] = sum(s.group._post_forward_shard is not None for s in states if s.group)
    return result


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reshard_after_forward_int_trains_like_the_reference(ranks, world_size):
    k = max(1, world_size // 2)  # world 4: pairs; world 2: 1 (= keep unsharded); world 1: 1
    for r in ranks(world_size).run(_reshard_int_parity, k):
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64 and r["post_forward_alive"] == 0, r


@pytest.mark.parametrize("world_size", [2, 4])  # schedules; one rank communicates nothing (test_runtime)
def test_manual_async_unshard_before_forward_is_used(ranks, world_size):
    for r in ranks(world_size).run(_schedule, "manual_unshard"):
        assert r["explicit"] == [("explicit", "all_gather", "<root>")]
        assert [m for _, _, m in r["forward"]] == ["layers.0", "layers.1", "layers.2"], r["summary"]


class EmbedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.body = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))

    def forward(self, tokens):
        return self.body(self.embed(tokens)).mean(1)


def _unshard_in_backward_off() -> dict:
    """An embedding's backward does not read its weight: no all-gather for it in backward, and
    the same gradients as the reference."""
    from fully_shard import debug, fully_shard

    rank, w = world()
    torch.manual_seed(0)
    model = EmbedMLP().double()
    ref = copy.deepcopy(model)
    fully_shard(model.embed, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    model.embed.set_unshard_in_backward(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    backward_embed_gathers = 0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        tokens, y = torch.randint(0, 13, (8, 5), generator=gen), torch.randn(8, 3, generator=gen, dtype=torch.float64)
        with debug.trace() as t:
            _mlp_loss(model, tokens.chunk(w)[rank], y.chunk(w)[rank]).backward()
        backward_embed_gathers += sum(1 for r in t.select(op="all_gather", module="embed") if r.phase != "forward")
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, tokens, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, ref), "backward_embed_gathers": backward_embed_gathers}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unshard_in_backward_off(ranks, world_size):
    for r in ranks(world_size).run(_unshard_in_backward_off):
        assert r["backward_embed_gathers"] == 0 and r["param_diff"] <= TOL64, r


# -- reset after a failure -----------------------------------------------------------------------


class Flaky(nn.Module):
    """Raises in forward (``armed == "forward"``) or in its backward (``armed == "backward"``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = ""

    def forward(self, x):
        if self.armed == "forward":
            raise RuntimeError("injected failure in forward")
        out = self.inner(x)
        if self.armed == "backward":
            out.register_hook(self._fail)
        return out

    @staticmethod
    def _fail(grad):
        raise RuntimeError("injected failure in backward")


def _reset_after_failure(where: str, explicit_reset: bool = True) -> dict:
    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    model[1] = Flaky(model[1])
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    failed = False
    for step in range(5):
        x, y = mlp_batch(step)
        if step == 2:
            model[1].armed = where
            try:
                _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            except RuntimeError as e:
                failed = f"in {where}" in str(e)
            model[1].armed = ""
            if explicit_reset:
                model.reset_iter_state()
            opt.zero_grad()  # gradients a failed backward already reduced are dropped here
            if not explicit_reset:
                import warnings

                with warnings.catch_warnings(record=True) as caught:  # the next forward resets itself
                    warnings.simplefilter("always")
                    model(x.chunk(w)[rank][:1])
                warned = any("did not finish" in str(c.message) for c in caught)
                if where == "backward" and not warned:
                    raise AssertionError("no warning about the failed backward")
                model.zero_grad()
            unsharded_after_reset = sum(
                p.padded_unsharded.untyped_storage().nbytes()
                for m in model.modules() if "_fsdp_state" in m.__dict__
                for p in m.__dict__["_fsdp_state"].group.params
            )
            continue  # the reference skips this step too
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"failed": failed, "param_diff": max_param_diff(model, ref), "unsharded_after_reset": unsharded_after_reset}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_exception(ranks, world_size, where):
    for r in ranks(world_size).run(_reset_after_failure, where):
        assert r["failed"] and r["unsharded_after_reset"] == 0 and r["param_diff"] <= TOL64, r


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_failed_backward_is_detected_without_reset(ranks, world_size):
    """Forgetting reset_iter_state after a failed backward: the next forward notices (the
    end-of-backward callback never ran), warns, resets, and training stays correct."""
    for r in ranks(world_size).run(_reset_after_failure, "backward", False):
        assert r["failed"] and r["param_diff"] <= TOL64, r


def _failed_micro_batch(where: str, reset: bool) -> dict:
    """Three micro-batches per step, the first two without gradient sync; the second raises (in
    forward or in backward) and is caught. A failed forward made no gradient: the step counts
    micro-batches 0 and 2. A failed backward had added part of its gradient to the accumulated
    ones (autograd adds in place), so the whole accumulation window is dropped, with a warning
    saying so: the step counts micro-batch 2."""
    import warnings

    from fully_shard import fully_shard

    rank, w = world()
    model = make_mlp()
    model[1] = Flaky(model[1])
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    messages: list[str] = []
    for step in range(2):
        for i in range(3):
            x, y = mlp_batch(10 * step + i)
            model.set_requires_gradient_sync(i == 2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if i == 1:
                    model[1].armed = where
                    try:
                        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
                    except RuntimeError:
                        pass
                    model[1].armed = ""
                    if reset:
                        model.reset_iter_state()
                else:
                    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            messages += [str(c.message) for c in caught]
            if i == 2 or (i == 0 and where == "forward"):
                _mlp_loss(ref, x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    dropped = sum("accumulated without gradient sync" in m for m in messages)
    return {"param_diff": max_param_diff(model, ref), "dropped_warnings": dropped}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("reset", [True, False])
def test_a_failed_micro_batch_is_dropped_whole(ranks, world_size, where, reset):
    for r in ranks(world_size).run(_failed_micro_batch, where, reset):
        assert r["param_diff"] <= TOL64, r
        # the warning comes from reset_iter_state or, without it, from the next forward
        assert r["dropped_warnings"] == (2 if where == "backward" else 0), r


# -- gather-full-parameters context ------------------------------------------------------------


def _writeback_of_a_lossy_gather(lossy: str) -> dict:
    """``unsharded(writeback=True)`` where the gathered parameters are not the shards' exact values
    (int8 all-gather, bf16 ``param_dtype``): what the block did not edit keeps its exact float32
    value, a forward inside changes nothing, and an edited row arrives as written."""
    from fully_shard import MixedPrecisionPolicy, fully_shard, unsharded
    from fully_shard.quant import Int8AllGather

    rank, w = world()
    model = make_mlp(torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if lossy == "bf16" else None)
    for block in model[:3]:
        fully_shard(block, mesh=cpu_mesh(), mp_policy=mp)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=mp)
    if lossy == "int8":
        model.set_all_gather_codec(Int8AllGather())
    before = {n: full(p).clone() for n, p in model.named_parameters()}
    x, _ = mlp_batch(0, torch.float32)
    with torch.no_grad(), unsharded(model, writeback=True):
        model(x.chunk(w)[rank])
    untouched = [n for n, p in model.named_parameters() if not torch.equal(full(p), before[n])]
    with torch.no_grad(), unsharded(model, writeback=True):
        model[0][0].weight[1].fill_(0.5)
    after = {n: full(p) for n, p in model.named_parameters()}
    expected = before["0.0.weight"].clone()
    expected[1] = 0.5
    others = [n for n in before if n != "0.0.weight" and not torch.equal(after[n], before[n])]
    return {
        "changed_without_edits": untouched,
        "edit": torch.equal(after["0.0.weight"], expected),
        "others": others,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("lossy", ["int8", "bf16"])
def test_writeback_changes_only_what_the_block_edited(ranks, world_size, lossy):
    for r in ranks(world_size).run(_writeback_of_a_lossy_gather, lossy):
        assert r["changed_without_edits"] == [] and r["edit"] and r["others"] == [], r


def _unsharded_context(writeback: bool) -> dict:
    from fully_shard import unsharded

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = mlp_batch(0)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    opt.step()
    opt.zero_grad()
    _mlp_loss(ref, x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    with torch.no_grad(), unsharded(model, writeback=writeback):
        read_diff = max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
        )
        full_shapes = all(p.shape == q.shape and not hasattr(p, "placements") for p, q in zip(model.parameters(), ref.parameters()))
        for p in model.parameters():
            p.mul_(0.5)  # e.g. weight surgery
    if writeback:
        with torch.no_grad():
            for q in ref.parameters():
                q.mul_(0.5)
    after_diff = max_param_diff(model, ref)
    for step in range(1, 3):  # training continues from the (written or untouched) weights
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()
        _mlp_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"read_diff": read_diff, "full_shapes": full_shapes, "after_diff": after_diff,
            "final_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("writeback", [True, False])
def test_unsharded_context(ranks, world_size, writeback):
    for r in ranks(world_size).run(_unsharded_context, writeback):
        assert r["full_shapes"] and r["read_diff"] <= TOL64, r
        # With writeback the halving landed in the shards (and the reference halved too);
        # without it the shards are untouched (and so is the reference).
        assert r["after_diff"] <= TOL64 and r["final_diff"] <= TOL64, r


# -- schedules with several forwards before backward -------------------------------------------


def _one_f_one_b() -> dict:
    """Three micro-batch forwards, then their backwards in another order (2, 0, 1), then one
    step: equals one step on the concatenated batch."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 7, generator=gen, dtype=torch.float64), torch.randn(12, 3, generator=gen, dtype=torch.float64)
        lx, ly = x.chunk(w)[rank] if w < 4 else x[rank::w], y.chunk(w)[rank] if w < 4 else y[rank::w]
        losses = [_mlp_loss(model, mx, my) / 3 for mx, my in zip(lx.chunk(3), ly.chunk(3))]
        for i, mb in enumerate((2, 0, 1)):
            model.set_is_last_backward(i == 2)
            losses[mb].backward()
        opt.step()
        opt.zero_grad()
        rx, ry = (x, y) if w < 4 else (torch.cat([x[r::w] for r in range(w)]), torch.cat([y[r::w] for r in range(w)]))
        _mlp_loss(ref, rx, ry).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_diff": max_param_diff(model, ref)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_several_forwards_then_backwards_in_another_order(ranks, world_size):
    for r in ranks(world_size).run(_one_f_one_b):
        assert r["param_diff"] <= TOL64, r


# -- other entry points and reductions ---------------------------------------------------------


def _forward_method() -> dict:
    model, ref = sharded_generate_model()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        out = model.generate(x)
    return {"diff": (out - ref.generate(x)).abs().max().item(),
            "resharded": hasattr(model.proj.weight, "placements")}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_register_fsdp_forward_method(ranks, world_size):
    for r in ranks(world_size).run(_forward_method):
        assert r["diff"] <= TOL64 and r["resharded"], r


def _divide_factor() -> dict:
    """Factor 1.0: gradients are the sum over ranks, i.e. world x the reference's average."""

    rank, w = world()
    model, ref = nested_mlp_and_reference()
    model.set_gradient_divide_factor(1.0)
    model.set_force_sum_reduction_for_comms(True)
    x, y = mlp_batch(0)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    _mlp_loss(ref, x, y).backward()
    return {"diff": max((full(p.grad) - w * q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gradient_divide_factor(ranks, world_size):
    for r in ranks(world_size).run(_divide_factor):
        assert r["diff"] <= TOL64, r


def test_trace_summary_is_readable(ranks):
    r = ranks(2).run(_schedule, "implicit")[0]
    lines = r["summary"].splitlines()
    assert lines[0].split()[:6] == ["step", "phase", "op", "ranks", "count", "MiB"]
    assert any("backward_prefetch" in line and "all_gather" in line for line in lines[1:])
