"""Issue #23 item 2: the accelerator branch (side streams, events, waits, buffers dropped without
``record_stream``) run on CPU with stand-in streams under `fully_shard.tools.stream_check`, whose
happens-before analysis (PyTorch's CUDA sanitizer's, plus frees) must find nothing in the training
loops, must find each bug injected on purpose, and must not change what trains."""

from __future__ import annotations

import copy

import pytest
import torch

from _parity import TOL64, _mlp_loss, make_mlp, mlp_batch, reductions_in_flight
from rank_utils import cpu_mesh, max_param_diff, world


def _train(case: str, steps: int = 2) -> dict:
    """Train the parity MLP (each block and the root sharded) under the checker; compare with the
    float64 reference."""
    from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from fully_shard.tools import stream_check

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    kwargs: dict = {}
    if case == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (min(w, 2), w // min(w, 2)), mesh_dim_names=("replicate", "shard"))
    if case == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if case == "mixed":  # float32 compute and reduction: the casts on both streams
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model[:3]:
        fully_shard(block, mesh=mesh, reshard_after_forward=case != "no_reshard", **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if case == "prefetch":
        model[0].set_modules_to_forward_prefetch([model[1], model[2]])
        model[2].set_modules_to_backward_prefetch([model[1], model[0]])
    if case in ("unbucketed", "rs_buffers", "separate_rs"):  # one collective per group
        model.set_bucket_bytes(0)
    if case == "rs_buffers":  # 3 of the 4 groups' reduce-scatters in flight, their inputs alive
        model.set_reduce_scatter_max_input_buffers(3)
    if case == "separate_rs":  # the reduce-scatters on a process group of their own
        model.set_separate_reduce_scatter_group()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    micro = 2 if case == "accumulation" else 1
    with stream_check.checked(raise_on_exit=False) as checker, reductions_in_flight() as depth:
        for step in range(steps):
            for i in range(micro):
                x, y = mlp_batch(10 * step + i)
                model.set_requires_gradient_sync(i == micro - 1)
                _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
                _mlp_loss(ref, x, y).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            if case == "post_optim_event":  # the next all-gather waits for this event only
                model.set_post_optim_event(checker.current.record_event())
            if case == "explicit_unshard":  # the next step's first block gathered ahead, by hand
                model[0].unshard(async_op=True).wait()
        ctx = model._get_fsdp_state().ctx
    return {
        "hazards": [str(h) for h in checker.hazards],
        "streams": ctx.comm.uses_streams,
        "launches": dict(checker.launches),
        "buckets": len(ctx.buckets),
        "diff": max_param_diff(model, ref),
        "depth": depth["max"],  # the most reductions in flight at once
        "pending_after": len(ctx.pending_reduces),
    }



CASES = [
    "plain", "prefetch", "accumulation", "hsdp", "offload", "unbucketed", "no_reshard", "post_optim_event",
    "explicit_unshard", "mixed", "rs_buffers", "separate_rs",
]


@pytest.mark.parametrize(
    "world_size, case", [(w, c) for w in (1, 2) for c in CASES] + [(4, "plain"), (4, "hsdp")]
)
def test_training_loops_have_no_stream_hazard(ranks, world_size, case):
    for r in ranks(world_size).run(_train, case):
        assert r["streams"] and r["hazards"] == [], r
        # the side streams ran their part (at world 1 the reduce-scatter is its own input: no op)
        sides = {"all_gather", "reduce_scatter"} if world_size > 1 else {"all_gather"}
        assert sides <= {name for name, n in r["launches"].items() if n > 0}, r
        # offloaded groups never bucket
        assert (r["buckets"] == 0) == (case in ("unbucketed", "offload", "rs_buffers", "separate_rs")), r
        # reductions in flight at once: one (the next module's waits for it), or up to the 3 set
        # (4 groups, none bucketed); none left when the optimizer runs
        assert r["depth"] == (3 if case == "rs_buffers" else 1), r
        assert r["pending_after"] == 0, r
        if case != "mixed":  # float32 compute is not the float64 reference
            assert r["diff"] <= TOL64, r


def _injected(bug: str) -> dict:
    """Train under the checker with one bug put in the accelerator branch on purpose."""
    from fully_shard.runtime import comm

    original_wait, original_track = comm.Pending.wait, comm.CommContext.track

    def wait_skipping_event(self):
        # (a) all-gathers: no wait_event before the copy-out; (c) reduce-scatters: their output
        # (the gradients) read on the compute stream with no wait.
        if self.keeps_output == (bug == "no_wait_event"):
            self.event = None
        original_wait(self)

    def track_dropping_input(self, pending):
        if not pending.keeps_output:  # (b) the reduce-scatter input freed when issued
            pending.keep_alive = ()
        original_track(self, pending)

    if bug in ("no_wait_event", "gradients_read_without_wait"):
        comm.Pending.wait = wait_skipping_event
    else:
        comm.CommContext.track = track_dropping_input
    try:  # (freed early: unbucketed, so a module's backward allocates after a reduce-scatter's issue)
        return _train("unbucketed" if bug == "freed_early" else "plain", steps=1)
    finally:
        comm.Pending.wait, comm.CommContext.track = original_wait, original_track


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_removed_wait_event_is_reported(ranks, world_size):
    for r in ranks(world_size).run(_injected, "no_wait_event"):
        assert any(
            "aten::split_with_sizes_copy on stream 'compute'" in h and "on stream 'all_gather'" in h
            for h in r["hazards"]
        ), r


def test_gradients_read_without_a_wait_are_reported(ranks):
    # world 2: at world 1 nothing runs on the reduce-scatter stream (the gradient is its input)
    for r in ranks(2).run(_injected, "gradients_read_without_wait"):
        assert any("on stream 'compute'" in h and "on stream 'reduce_scatter'" in h for h in r["hazards"]), r


def test_a_buffer_freed_early_is_reported(ranks):
    for r in ranks(2).run(_injected, "freed_early"):
        assert any(
            "may be handed out again on stream 'compute' while c10d::_reduce_scatter_base_ on stream "
            "'reduce_scatter'" in h
            for h in r["hazards"]
        ), r
