"""Custom communication (issue #12 item 3): set_custom_all_gather / set_custom_reduce_scatter,
set_all_reduce_hook, set_reduce_scatter_unused_params, each against PyTorch's fully_shard with
the same call where the reduction order is the same, and the float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _parity import (
    _mlp_loss, _train_pair, check, make_mlp, max_abs_diff, mlp_batch, reductions_in_flight, shard_mlp,
)
from rank_utils import cpu_mesh, world


class CountingAllGather:
    """PyTorch's AllGather interface: allocate the output, run the collective."""

    def __init__(self) -> None:
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    def __init__(self) -> None:
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _train(model, steps: int = 3, weight_decay: float = 0.01) -> None:
    rank, w = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    for step in range(steps):
        x, y = mlp_batch(step)
        _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
        opt.step()
        opt.zero_grad()


def _custom_comms() -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    ours, theirs = make_mlp(), make_mlp()
    plain = copy.deepcopy(ours)
    for m, fn in ((ours, fully_shard), (theirs, torch_fully_shard), (plain, fully_shard)):
        shard_mlp(m, "nested", True, fn)
    ours.set_bucket_bytes(0)
    plain.set_bucket_bytes(0)
    comms = {}
    for m, tag in ((ours, "ours"), (theirs, "theirs")):
        ag, rs = CountingAllGather(), CountingReduceScatter()
        m[1].set_custom_all_gather(ag)
        m[1].set_custom_reduce_scatter(rs)
        comms[tag] = (ag, rs)
    for m in (ours, theirs, plain):
        _train(m)
    ag, rs = comms["ours"]
    return {
        "vs_plain": max_abs_diff(ours, plain),
        "vs_torch": max_abs_diff(ours, theirs),
        "ours": (ag.calls, ag.allocations, rs.calls, rs.allocations),
        "theirs": (comms["theirs"][0].calls, comms["theirs"][1].calls),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_custom_comms_run_each_collective(ranks, world_size):
    for r in ranks(world_size).run(_custom_comms):
        # Block 1 per step: an all-gather in forward and one in backward, one reduce-scatter; each
        # allocates its output (and the reduce-scatter its input): 3 steps.
        assert r["ours"] == (6, 6, 3, 6), r
        assert r["theirs"] == (6, 3), r  # PyTorch's fully_shard calls them as often
        assert r["vs_plain"] == 0.0, r  # the same collectives, so the same bits
        if world_size <= 2:
            assert r["vs_torch"] == 0.0, r


def _all_reduce_hook() -> dict:
    """A hook that doubles each reduced gradient shard (as PyTorch's, before the division)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    ours, theirs = make_mlp(), make_mlp()
    for m, fn in ((ours, fully_shard), (theirs, torch_fully_shard)):
        shard_mlp(m, "nested", True, fn)
    calls = {"ours": 0, "theirs": 0}
    for m, tag in ((ours, "ours"), (theirs, "theirs")):

        def hook(output, tag=tag):
            calls[tag] += 1
            output.mul_(2.0)

        for sub in (m, m[0], m[1], m[2]):
            sub.set_all_reduce_hook(hook)
    for m in (ours, theirs):
        _train(m)
    return {"calls": calls, "vs_torch": max_abs_diff(ours, theirs)}


@pytest.mark.parametrize("world_size", [2])
def test_all_reduce_hook_runs_on_each_reduction(ranks, world_size):
    for r in ranks(world_size).run(_all_reduce_hook):
        assert r["calls"] == {"ours": 12, "theirs": 12}, r  # 4 groups x 3 steps
        assert r["vs_torch"] == 0.0, r


def _unused_params_off() -> dict:
    """set_reduce_scatter_unused_params(False): PyTorch's layout, so its bits at any world size."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import debug, fully_shard

    ours, theirs = make_mlp(), make_mlp()
    ref = copy.deepcopy(ours)
    for m, fn in ((ours, fully_shard), (theirs, torch_fully_shard)):
        shard_mlp(m, "nested", True, fn)
    ours.set_bucket_bytes(0)
    ours.set_reduce_scatter_unused_params(False)
    with debug.trace() as t:
        out = _train_pair(ours, ref, mlp_batch, _mlp_loss, 3)
    _train(theirs, weight_decay=0.1)  # as _train_pair trains ours
    per_group = {r.module: r.nbytes for r in t.select(op="reduce_scatter", step=0)}
    return {**out, "vs_torch": max_abs_diff(ours, theirs), "rs_bytes": per_group}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_scatter_unused_params_off_is_pytorch_layout(ranks, world_size):
    results = ranks(world_size).run(_unused_params_off)
    check(results, "unused params off vs single process (float64)")
    for r in results:
        assert r["vs_torch"] == 0.0, r
        if world_size > 1:  # no used-count column: gradients only (block 0: 7x13+13 and 13x11+11 padded)
            w = world_size
            rows = lambda n: -(-n // w)  # noqa: E731
            expected = (rows(13) * 7 + rows(13) + rows(11) * 13 + rows(11)) * w * 8
            assert r["rs_bytes"]["0"] == expected, r


def test_bad_comm_controls_are_refused():
    from fake_world import fake_world

    from fully_shard import fully_shard

    with fake_world(2) as mesh:
        model = make_mlp()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(TypeError, match="set_custom_all_gather expects a comm object with allocate"):
            model[0].set_custom_all_gather(lambda *a: None)
        with pytest.raises(TypeError, match="set_all_reduce_hook expects a callable"):
            model.set_all_reduce_hook(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs an accelerator mesh"):
            model.set_all_reduce_hook(lambda t: None, stream=object())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="reduce_scatter_unused_params must be True or False"):
            model.set_reduce_scatter_unused_params("yes")  # type: ignore[arg-type]


def _pipeline_stages(shared: bool) -> dict:
    """Two roots on one rank (pipeline stages): stage 1 = blocks 0-1, stage 2 = block 2 + head."""
    from fully_shard import debug, fully_shard, share_comm_ctx

    model = make_mlp()
    ref = copy.deepcopy(model)
    stage1, stage2 = model[:2], model[2:]  # plain Sequentials over the same children
    for block in model[:3]:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(stage1, mesh=cpu_mesh())
    fully_shard(stage2, mesh=cpu_mesh())
    if shared:
        share_comm_ctx([stage1, stage2])

    def loss_of(m, x, y):  # the sharded model runs as its two stages; the reference as one module
        return ((stage2(stage1(x)) - y) ** 2).mean() if m is model else _mlp_loss(m, x, y)

    with debug.trace() as t:
        trained = _train_pair(model, ref, mlp_batch, loss_of, 3)
    rank, w = world()
    c1, c2 = stage1._get_fsdp_state().ctx.comm, stage2._get_fsdp_state().ctx.comm
    error = ""
    try:
        share_comm_ctx([stage1])
    except ValueError as e:
        error = str(e)
    return {**trained, "same_comm": c1 is c2, "traced": t.count() > 0 or w == 1, "late_error": error}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("shared", [True, False])
def test_share_comm_ctx_between_pipeline_stages(ranks, world_size, shared):
    results = ranks(world_size).run(_pipeline_stages, shared)
    check(results, f"two stages, shared={shared} vs single process (float64)")
    for r in results:
        assert r["same_comm"] == shared and r["traced"], r
        assert (
            "already ran" in r["late_error"]
            and "call share_comm_ctx before the first forward" in r["late_error"]
        ), r


def _shared_limit(stage2_limit: int) -> dict:
    """Roots sharing a communication context share its in-flight limit: equal settings train,
    different ones are refused when the second root starts, naming the fix."""
    from fully_shard import fully_shard, share_comm_ctx

    model = make_mlp()
    stage1, stage2 = model[:2], model[2:]
    for block in model[:3]:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(stage1, mesh=cpu_mesh())
    fully_shard(stage2, mesh=cpu_mesh())
    share_comm_ctx([stage1, stage2])
    stage1.set_collectives_in_flight(1)
    stage2.set_collectives_in_flight(stage2_limit)
    x, y = mlp_batch(0)
    try:
        ((stage2(stage1(x)) - y) ** 2).mean().backward()
    except RuntimeError as e:
        return {"error": str(e), "limit": None}
    return {"error": "", "limit": stage1._get_fsdp_state().ctx.comm.limit}


@pytest.mark.parametrize("world_size", [1, 2])
def test_roots_sharing_a_comm_ctx_share_the_in_flight_limit(ranks, world_size):
    for r in ranks(world_size).run(_shared_limit, 1):
        assert r == {"error": "", "limit": 1}, r
    for r in ranks(world_size).run(_shared_limit, 0):
        assert (
            "asks for set_collectives_in_flight(0), but the roots it shares a communication context"
            in r["error"]
        ), r
        assert "with 1" in r["error"] and "same count on every root passed to share_comm_ctx" in r["error"], r


# -- PyTorch 2.13's communication setup methods: set_separate_reduce_scatter_group,
# set_reduce_scatter_max_input_buffers, set_allocate_memory_from_process_group_for_comm,
# set_symm_mem_for_comm (CUDA: tests/test_gpu.py), set_reduce_scatter_divide_factor


def _setup_method(case: str) -> dict:
    """Ours and PyTorch's fully_shard with the same call, against each other and the float64 model;
    the trace says on which process group each collective ran."""
    import warnings

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import debug, fully_shard

    rank, w = world()
    ours, theirs = make_mlp(), make_mlp()
    ref = copy.deepcopy(ours)
    for m, fn in ((ours, fully_shard), (theirs, torch_fully_shard)):
        if case == "separate_hsdp":  # (2 replicas x 2 shards): one reduce-scatter group per replica
            from torch.distributed.device_mesh import init_device_mesh

            hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            fn = (lambda f: lambda module, mesh, **kw: f(module, mesh=hsdp, **kw))(fn)
        shard_mlp(m, "nested", True, fn)
    ours.set_bucket_bytes(0)  # one reduce-scatter per group, as PyTorch's
    ours.set_reduce_scatter_unused_params(False)  # PyTorch's layout: its summation order at 4 ranks
    method, args = {"separate": ("set_separate_reduce_scatter_group", ()),
                    "separate_hsdp": ("set_separate_reduce_scatter_group", ()),
                    "buffers": ("set_reduce_scatter_max_input_buffers", (3,))}[case]
    compared = hasattr(theirs, method)  # (PyTorch 2.13's; 2.11 has neither)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither warns
        for m in (ours, theirs) if compared else (ours,):
            getattr(m, method)(*args)
    if case == "buffers":  # on CPU, reductions stay in flight past a module's backward only so
        ours.set_collectives_in_flight(4)
    twin = copy.deepcopy(ours)  # a deep copy keeps the settings and shares the process groups
    with reductions_in_flight() as depth, debug.trace() as t:
        out = _train_pair(ours, ref, mlp_batch, _mlp_loss, 3)
    _train(twin, weight_decay=0.1)
    if compared:
        _train(theirs, weight_decay=0.1)  # as _train_pair trains ours
    groups = {op: {r.group_name for r in t.select(op=op)} for op in ("all_gather", "reduce_scatter")}
    return {**out, "vs_torch": max_abs_diff(ours, theirs) if compared else None, "groups": groups,
            "vs_twin": max_abs_diff(ours, twin), "depth": depth["max"],
            "twin_group": twin[0]._get_fsdp_state().own[0].reduce_scatter_group
            is ours[0]._get_fsdp_state().own[0].reduce_scatter_group,
            "pending_after": len(ours._get_fsdp_state().ctx.pending_reduces)}


@pytest.mark.parametrize(
    "world_size, case", [(w, c) for w in (1, 2, 4) for c in ("separate", "buffers")] + [(4, "separate_hsdp")]
)
def test_pytorch_213_reduce_scatter_setup_trains_as_pytorchs(ranks, world_size, case):
    results = ranks(world_size).run(_setup_method, case)
    check(results, f"{case} vs single process (float64)")
    for r in results:
        assert r["vs_torch"] in (0.0, None), r  # bit-exact with PyTorch's where it has the method
        assert r["vs_twin"] == 0.0 and r["twin_group"], r
        if case.startswith("separate") and world_size > 1:  # reduce-scatters on a group of their own
            assert len(r["groups"]["reduce_scatter"]) == 1 and len(r["groups"]["all_gather"]) == 1, r
            assert r["groups"]["reduce_scatter"] != r["groups"]["all_gather"], r
        # reductions in flight at once: 3 of the 4 groups' (with 4 collectives allowed in flight on
        # CPU; streams: test_stream_check.py), else one
        assert r["depth"] == (3 if case == "buffers" else 1), r
        assert r["pending_after"] == 0, r  # the optimizer saw every reduction landed


class _AllocatingBackend:
    """A process group backend with an allocator of its own (as NCCL's), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def supports_tensor_alloc(self, device) -> bool:
        return True

    def allocate_tensor(self, numel, *, dtype, device):
        self.calls += 1
        return torch.empty(numel, dtype=dtype, device=device)


class _GroupWithAllocator:
    """What comm_buffers asks of a process group for allocation: its backend on a device."""

    def __init__(self, backend: _AllocatingBackend) -> None:
        self.backend = backend

    def _get_backend(self, device):
        return self.backend


def _allocate_from_process_group() -> dict:
    import warnings

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard
    from fully_shard.runtime import comm_buffers

    ours, theirs = make_mlp(), make_mlp()
    plain = copy.deepcopy(ours)
    for m, fn in ((ours, fully_shard), (theirs, torch_fully_shard), (plain, fully_shard)):
        shard_mlp(m, "nested", True, fn)
    for m in (ours, plain):
        m.set_bucket_bytes(0)
        m.set_reduce_scatter_unused_params(False)  # PyTorch's layout: its summation order at 4 ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours[1].set_allocate_memory_from_process_group_for_comm(True)
    theirs[1].set_allocate_memory_from_process_group_for_comm(True)  # (gloo: the caching allocator)
    # gloo has no allocator: a stand-in backend that has one serves block 1's buffers instead
    backend = _AllocatingBackend()
    group = ours[1]._get_fsdp_state().own[0]
    kind = group.comm_buffers.kind
    stand_in = _GroupWithAllocator(backend)
    group.comm_buffers = comm_buffers.from_process_group(stand_in, stand_in)
    alone = not ours[1]._get_fsdp_state().default_schedule  # (with a buffer source: never in a bucket)
    errors = []
    plain[2].set_custom_reduce_scatter(CountingReduceScatter())
    try:  # refused after a custom comm, as PyTorch's
        plain[2].set_allocate_memory_from_process_group_for_comm(True)
    except ValueError as e:
        errors.append(str(e))
    refused_left_alone = plain[2]._get_fsdp_state().own[0].comm_buffers is None
    # a custom comm set after it takes over, as PyTorch's
    other = plain[0]._get_fsdp_state().own[0]
    plain[0].set_allocate_memory_from_process_group_for_comm(True)
    custom = CountingAllGather()
    plain[0].set_custom_all_gather(custom)
    overridden = other._all_gather_comm() is custom and other._reduce_scatter_comm() is other.comm_buffers.reduce_scatter
    plain[0].set_allocate_memory_from_process_group_for_comm(False)
    plain[0]._get_fsdp_state().update_settings(custom_all_gather=None)
    for m in (ours, theirs, plain):
        _train(m)
    ours[1].set_allocate_memory_from_process_group_for_comm(False)
    return {
        "warnings": [str(w.message) for w in caught],
        "kind": kind,
        "allocations": backend.calls,
        "vs_plain": max_abs_diff(ours, plain),
        "vs_torch": max_abs_diff(ours, theirs),
        "errors": errors,
        "refused_left_alone": refused_left_alone,
        "off": group.comm_buffers is None and ours[1]._get_fsdp_state().default_schedule,
        "alone": alone,
        "overridden": overridden,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_allocate_memory_from_process_group_for_comm(ranks, world_size):
    for r in ranks(world_size).run(_allocate_from_process_group):
        assert r["kind"] == "process_group" and r["off"], r
        if world_size > 1:  # gloo's backend has no allocator: said once, the caching allocator serves
            assert len(r["warnings"]) == 1 and "(gloo) has no allocator of its own for cpu" in r["warnings"][0], r
        else:  # (one rank runs no collective: nothing to say)
            assert r["warnings"] == [], r
        # 3 steps of block 1: the all-gather output in forward and in backward, the reduce-scatter's
        # input and (with 2+ ranks) output, each from the backend's allocator
        assert r["allocations"] == 3 * (2 + (2 if world_size > 1 else 1)), r
        assert r["vs_plain"] == 0.0 and r["vs_torch"] == 0.0, r
        assert r["alone"] and r["overridden"], r
        assert len(r["errors"]) == 1 and r["refused_left_alone"], r
        assert "cannot be used together" in r["errors"][0] and "Fix:" in r["errors"][0], r


def _divide_factor_alias() -> dict:
    import warnings

    from fully_shard import fully_shard

    new, old = make_mlp(), make_mlp()
    for m in (new, old):
        shard_mlp(m, "nested", True, fully_shard)
    new.set_gradient_divide_factor(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old.set_reduce_scatter_divide_factor(3.0)
    for m in (new, old):
        _train(m)
    return {"warnings": [(w.category.__name__, str(w.message)) for w in caught],
            "equal": all(torch.equal(a.full_tensor(), b.full_tensor())
                         for a, b in zip(new.parameters(), old.parameters()))}


@pytest.mark.parametrize("world_size", [2])
def test_set_reduce_scatter_divide_factor_is_the_deprecated_name(ranks, world_size):
    for r in ranks(world_size).run(_divide_factor_alias):
        assert r["equal"], r
        assert len(r["warnings"]) == 1 and r["warnings"][0][0] == "DeprecationWarning", r
        assert "use set_gradient_divide_factor" in r["warnings"][0][1], r


def test_bad_communication_setup_is_refused():
    from fake_world import fake_world

    from fully_shard import fully_shard

    with fake_world(2) as mesh:
        model = make_mlp()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        for bad, error in ((True, TypeError), (2.0, TypeError), (0, ValueError)):
            with pytest.raises(error, match="set_reduce_scatter_max_input_buffers expects"):
                model.set_reduce_scatter_max_input_buffers(bad)  # type: ignore[arg-type]
        assert model._get_fsdp_state().settings.reduce_scatter_max_input_buffers == 1
        with pytest.raises(ValueError, match=r"set_separate_reduce_scatter_group\(enable\) must be True or False"):
            model.set_separate_reduce_scatter_group("yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="the only symmetric memory backend is 'NCCL'"):
            model[0].set_symm_mem_for_comm("NVSHMEM")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"symmetric memory needs CUDA devices and an NCCL process group.*"
                           r"on cpu.*nothing was changed\. Fix:"):
            model[0].set_symm_mem_for_comm()
        assert model[0]._get_fsdp_state().own[0].comm_buffers is None
        with pytest.raises(ValueError, match="manages no parameters of its own"):
            fully_shard(torch.nn.Sequential(model[0]), mesh=mesh).set_symm_mem_for_comm()
        model[0].set_force_sum_reduction_for_comms(True)
        model[0].set_reduce_scatter_max_input_buffers(2)
        with pytest.raises(ValueError, match=r"max_input_buffers\(> 1\) with a reduce-scatter in NCCL symmetric"):
            model[0].set_symm_mem_for_comm()  # (refused before the device check)


def test_every_method_of_pytorchs_fsdp_module_takes_the_same_arguments():
    """Code written for PyTorch's FSDPModule calls ours as it is: each public method exists and
    accepts PyTorch's parameters in the same way (name, positional or keyword, default); ours may
    add keyword-only parameters with defaults."""
    import inspect

    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fully_shard import FSDPModule

    checked = []
    for name in sorted(n for n in dir(TorchFSDPModule) if not n.startswith("_")):
        theirs = getattr(TorchFSDPModule, name)
        if not callable(theirs):
            continue
        assert hasattr(FSDPModule, name), f"FSDPModule lacks PyTorch's {name}"
        tp, op = inspect.signature(theirs).parameters, inspect.signature(getattr(FSDPModule, name)).parameters
        for pname, p in tp.items():
            assert pname in op, (name, pname)
            assert op[pname].kind == p.kind, (name, pname, op[pname].kind, p.kind)
            assert op[pname].default == p.default, (name, pname)
        for pname in op.keys() - tp.keys():
            assert op[pname].kind is inspect.Parameter.KEYWORD_ONLY and op[pname].default is not inspect._empty
        checked.append(name)
    assert {"unshard", "set_requires_gradient_sync", "set_allocate_memory_from_process_group_for_comm"} <= set(checked)
