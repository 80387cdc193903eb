"""Accelerator path (streams, events, NCCL): runs where a GPU is lent, skipped elsewhere.

One process, world size 1 over NCCL: the side streams and the event ordering are real (one rank
issues no collectives); parity is against the same model trained without sharding on the same
device, in float64 on both sides (TOL64, derived in tests/_parity.py).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from _parity import TOL64, llama64, reductions_in_flight
from llama_model import LlamaConfig, loss_fn, synthetic_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU machine)"),
]


@pytest.fixture
def nccl_world():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False])
def test_cuda_parity_and_nothing_unsharded_between_steps(nccl_world, reshard):
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=3))  # built on CPU: fully_shard moves each shard
    ref = copy.deepcopy(model).cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world, reshard_after_forward=reshard)
    fully_shard(model, mesh=nccl_world)
    assert all(p.device.type == "cuda" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(5):
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        print(f"step {step}: |loss diff| {abs(loss.item() - ref_loss.item()):.2e}")
        assert abs(loss.item() - ref_loss.item()) <= TOL64
        states = [m.__dict__["_fsdp_state"] for m in model.modules() if "_fsdp_state" in m.__dict__]
        alive = sum(p.padded_unsharded.untyped_storage().nbytes() for s in states for p in s.group.params)
        assert alive == 0
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    print(f"max |param diff| {diff:.2e}")
    assert diff <= TOL64


def test_cuda_streams_are_used(nccl_world):
    from fully_shard import fully_shard

    model = llama64(LlamaConfig(n_layers=2))
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world)
    fully_shard(model, mesh=nccl_world)
    x, y = synthetic_batch(0, 2, 8, model.cfg.vocab_size)
    loss_fn(model(x.cuda()), y.cuda()).backward()
    comm = model.__dict__["_fsdp_state"].ctx.comm
    assert comm.uses_streams and comm.all_gather_stream is not None and comm.reduce_scatter_stream is not None
    assert comm.all_gather_stream != torch.cuda.current_stream()


def test_cuda_post_optim_event_keeps_parity(nccl_world):
    """The first all-gather of each forward waits for an event recorded after optimizer.step()
    instead of the whole compute stream: results stay the reference's."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=2))
    ref = copy.deepcopy(model).cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world)
    fully_shard(model, mesh=nccl_world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(4):
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.set_post_optim_event(torch.cuda.current_stream().record_event())
        ref_loss = loss_fn(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= TOL64


@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_cpu_offload_keeps_shards_and_grads_on_host(nccl_world, pin_memory):
    """CPUOffloadPolicy on CUDA: shards, .grad and optimizer state stay on the host between steps,
    device memory holds only what is in flight, and training matches the run without offload."""
    from fully_shard import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    offloaded = llama64(LlamaConfig(vocab_size=2048, dim=256, n_layers=3, hidden_dim=688))  # ~24 MB of fp64
    plain = copy.deepcopy(offloaded)
    for model, policy in ((offloaded, CPUOffloadPolicy(pin_memory=pin_memory)), (plain, None)):
        kwargs = {"offload_policy": policy} if policy is not None else {}
        for layer in model.layers:
            fully_shard(layer, mesh=nccl_world, **kwargs)
        fully_shard(model, mesh=nccl_world, **kwargs)
    assert all(p.to_local().device.type == "cpu" and p.to_local().is_pinned() == pin_memory for p in offloaded.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in offloaded.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (offloaded, plain)]
    for step in range(5):
        x, y = synthetic_batch(step, 4, 16, offloaded.cfg.vocab_size)
        losses = []
        for model, opt in zip((offloaded, plain), opts):
            loss = loss_fn(model(x.cuda()), y.cuda())
            loss.backward()
            if model is offloaded:
                assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print(f"step {step}: |loss diff| {abs(losses[0] - losses[1]):.2e}")
        assert abs(losses[0] - losses[1]) <= TOL64
        states = [m.__dict__["_fsdp_state"] for m in offloaded.modules() if "_fsdp_state" in m.__dict__]
        assert sum(p.padded_unsharded.untyped_storage().nbytes() for s in states for p in s.group.params) == 0
    assert all(t.device.type == "cpu" for st in opts[0].state.values() for t in st.values() if torch.is_tensor(t) and t.dim())
    diff = max((p.full_tensor().cpu() - q.full_tensor().cpu()).abs().max().item() for p, q in zip(offloaded.parameters(), plain.parameters()))
    print(f"max |param diff| offloaded vs plain {diff:.2e}")
    assert diff <= TOL64
    # Device memory between steps: the plain model's shards and optimizer state (~3x the model),
    # none of the offloaded model's. Counted as what freeing the offloaded model gives back (the
    # process also holds cuBLAS's workspaces, the plain model until collected, ...).
    import gc

    torch.cuda.synchronize()
    del plain, opts[1], model, opt, loss
    gc.collect()
    held = torch.cuda.memory_allocated()
    del offloaded, opts
    gc.collect()
    freed = held - torch.cuda.memory_allocated()
    print(f"device bytes the offloaded model held after its step {freed} vs model bytes {model_bytes}")
    assert freed < model_bytes / 4


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_flat_shard_trains_and_saves_in_the_default_layout(nccl_world, offload):
    """FlatShard on the device (and with its shards offloaded to the host: its state dict gathers
    them, which the review of 2026-11-26 suspected fails on an NCCL-only mesh; ran on an H100 the
    same day); its optimizer state dict in the default layout's form, loaded back (ran on an H100 on
    2026-11-27 loading into the same AdamW; the load into a fresh AdamW not yet run on a GPU)."""
    from fully_shard import CPUOffloadPolicy, FlatShard, fully_shard

    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=2))
    ref = copy.deepcopy(model).cuda()
    policy = CPUOffloadPolicy() if offload else None
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world, shard_placement_fn=lambda p: FlatShard(), offload_policy=policy)
    fully_shard(model, mesh=nccl_world, shard_placement_fn=lambda p: FlatShard(), offload_policy=policy)
    assert all(p.dim() == 1 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    theirs = dict(ref.named_parameters())

    def step_both(step: int, sharded_opt: torch.optim.Optimizer) -> float:
        """One step of both models; the largest parameter difference after it."""
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        for m, o in ((model, sharded_opt), (ref, ref_opt)):
            loss_fn(m(x.cuda()), y.cuda()).backward()
            o.step()
            o.zero_grad()
        sd = model.state_dict()
        assert all(tuple(sd[k].shape) == tuple(theirs[k].shape) for k in theirs)
        return max((sd[k].full_tensor().to(theirs[k].device) - theirs[k]).abs().max().item() for k in theirs)

    diff = max(step_both(step, opt) for step in range(3))
    print(f"flat offload={offload}: max |param diff| {diff:.2e}")
    assert diff <= TOL64
    # The optimizer's state dict in the default layout's form (issue #28: converted on the mesh's
    # device, back to the state's own device when offloaded), equal to the unsharded AdamW's, and
    # loaded into a fresh AdamW (taken to the flat form at its first step): the next step equals
    # the unsharded model's.
    osd, ref_osd = opt.state_dict(), ref_opt.state_dict()
    assert sorted(osd["state"]) == sorted(ref_osd["state"])
    state_diff = 0.0
    for i, ref_state in ref_osd["state"].items():
        for key, ref_value in ref_state.items():
            value = osd["state"][i][key]
            assert tuple(value.shape) == tuple(ref_value.shape), (i, key)
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state_diff = max(state_diff, float((full.to(ref_value.device) - ref_value).abs().max()))
    print(f"flat offload={offload}: max |optimizer state diff| {state_diff:.2e}")
    assert state_diff <= TOL64
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)  # loaded before its first step
    fresh.load_state_dict(copy.deepcopy(osd))
    diff = step_both(3, fresh)
    print(f"flat offload={offload}: after loading the optimizer state, max |param diff| {diff:.2e}")
    assert diff <= TOL64


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_cpu_offload_whole_model_compiled(nccl_world, backend):
    """CPUOffloadPolicy under the whole-model compile (issue #27): the graph copies the host shards
    to the GPU and the gradients back; equal to eager offload (to the bit with aot_eager)."""
    from test_traced import _offloaded

    r = _offloaded("cuda", backend)
    print(f"{backend}: {r}")
    assert r["graphs"] == 2 and r["shard_devices"] == ["cpu"] and r["grad_devices"] == ["cpu"], r
    if backend == "aot_eager":
        assert r["losses_equal"] and r["params_equal"], r
    else:
        assert r["param_diff"] <= TOL64, r


def test_cuda_torchao_float8_matches_pytorch(nccl_world):
    """torchao's float8 training weights (float8 all-gather, real float8 matmuls on the GPU):
    ours equals PyTorch's fully_shard bit for bit, resharding or not."""
    pytest.importorskip("torchao.float8")
    from test_extensions import _float8

    for reshard in (True, False):
        r = _float8("pytorch", reshard, "cuda")
        print(f"reshard={reshard}: {r}")
        assert r["local_type"] == "WeightWithDynamicFloat8CastTensor" and all(r["equal"]), r
        assert r["sent"] == ["torch.float8_e4m3fn"], r


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_torchao_float8_whole_model_compiled(nccl_world, backend):
    """The float8 weights under the whole-model compile (issue #27): the pre hook (float8 cast,
    amax) and post hook in the graph, micro-batches with and without sync, eager and compiled
    (`_ACCUMULATING`: 3 graphs); equal to eager to the bit with aot_eager. Inductor fuses the
    casts its own way: its numbers are printed, not compared."""
    pytest.importorskip("torchao.float8")
    from test_traced import _subclass_compiled

    r = _subclass_compiled("float8", True, "cuda", backend)
    print(f"{backend}: {r}")
    assert r["graphs"] == 3 and r["local_type"] == "WeightWithDynamicFloat8CastTensor", r
    if backend == "aot_eager":
        assert all(r["equal"]) and r["losses"][0] == r["losses"][1], r


def test_cuda_offloaded_shards_stay_on_host(nccl_world):
    """model.cuda() after fully_shard brings offloaded shards back to the host; a shard moved to
    the device by hand (bypassing nn.Module) is refused at the next forward, naming it."""
    import torch.nn as nn

    from fully_shard import CPUOffloadPolicy, fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model, mesh=nccl_world, offload_policy=CPUOffloadPolicy())
    model.cuda()
    assert all(p.to_local().device.type == "cpu" and p.to_local().is_pinned() for p in model.parameters())
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
    model2 = nn.Linear(8, 8)
    fully_shard(model2, mesh=nccl_world, offload_policy=CPUOffloadPolicy())
    model2.weight._local_tensor = model2.weight._local_tensor.cuda()
    with pytest.raises(RuntimeError, match="parameter weight is on cuda.*CPUOffloadPolicy keeps its shard on cpu.*Fix"):
        model2(torch.randn(2, 8, device="cuda"))


def test_cuda_assign_to_dtype_and_deepcopy(nccl_world):
    """Client-code edits on a CUDA mesh: module.to(float64) re-pads device shards, deepcopy gives an
    independent sharded copy, load_state_dict(assign=True) is taken over at the next forward."""
    import torch.nn as nn

    from fully_shard import fully_shard

    def build(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))

    def shard(m: nn.Sequential) -> None:
        fully_shard(m[0], mesh=nccl_world)
        fully_shard(m, mesh=nccl_world)

    model, donor = build(0), build(1)
    ref, donor_ref = copy.deepcopy(model).double().cuda(), copy.deepcopy(donor).double().cuda()
    shard(model)
    shard(donor)
    x = torch.randn(4, 7, dtype=torch.float64, device="cuda")
    model.double()
    donor.double()
    assert {(p.to_local().device.type, p.to_local().dtype) for p in model.parameters()} == {("cuda", torch.float64)}
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max().item() <= TOL64
        ema = copy.deepcopy(model)
        assert torch.equal(ema(x), model(x))
        model.load_state_dict(donor.state_dict(), assign=True)
        assert (model(x) - donor_ref(x)).abs().max().item() <= TOL64
        assert (ema(x) - ref(x)).abs().max().item() <= TOL64  # the copy kept the old weights


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_plan_matches_a_real_step(tmp_path, offload):
    """`fully_shard.plan` against a real CUDA step at world 1 (benchmarks/plan_vs_real.py): the
    simulated peak within the issue's 10% of the same counter on the real run and of the
    allocator's ``max_memory_allocated``; offloaded, the host bytes within 10% too."""
    import json
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "plan_vs_real.py")
    run = subprocess.run([sys.executable, script, "--steps", "3", "--json", str(out)] + (["--offload"] if offload else []),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    r = json.loads(out.read_text())
    peak = r["simulated"]["peak"]
    assert abs(peak - r["measured_peak"]) <= 0.10 * r["measured_peak"]
    assert abs(peak - r["max_memory_allocated"]) <= 0.10 * r["max_memory_allocated"]
    if offload:
        assert r["measured_host"] > 0 and abs(r["simulated"]["host"] - r["measured_host"]) <= 0.10 * r["measured_host"]


@pytest.mark.parametrize("setup", ["rs_buffers", "process_group_alloc", "symm_mem", "symm_mem_sum"])
def test_cuda_communication_setup_keeps_parity(nccl_world, setup):
    """PyTorch 2.13's communication setup on real streams and NCCL: up to 3 reduce-scatters in
    flight; staging buffers from NCCL's allocator; from NCCL symmetric memory (the reduce-scatter's
    too with SUM reductions only). Each trains as the reference; none leaves a reduction pending."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=3))
    ref = copy.deepcopy(model).cuda()
    for layer in model.layers:
        fully_shard(layer, mesh=nccl_world)
    fully_shard(model, mesh=nccl_world)
    model.set_bucket_bytes(0)
    if setup == "rs_buffers":
        model.set_reduce_scatter_max_input_buffers(3)
    elif setup == "process_group_alloc":
        for m in (model, *model.layers):
            m.set_allocate_memory_from_process_group_for_comm(True)
    else:
        for m in (model, *model.layers):
            if setup == "symm_mem_sum":
                m.set_force_sum_reduction_for_comms(True, recurse=False)
            m.set_symm_mem_for_comm()
    buffers = [m._get_fsdp_state().own[0].comm_buffers for m in (model, *model.layers)]
    if setup.startswith("symm_mem"):  # the reduce-scatter's too only with SUM reductions
        assert {b.kind for b in buffers} == {"symm_mem"}
        assert all((b.reduce_scatter is not None) == (setup == "symm_mem_sum") for b in buffers)
    elif setup == "process_group_alloc":
        assert {b.kind for b in buffers} == {"process_group"}
    with reductions_in_flight() as depth:
        _train_checking_pending(model, ref)
    # 4 groups reduce per backward (no buckets): 3 in flight at once with the setting, else 1
    assert depth["max"] == (3 if setup == "rs_buffers" else 1)


def _train_checking_pending(model, ref) -> None:
    """3 steps beside the reference: equal within TOL64, no reduction pending after a backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        x, y = synthetic_batch(step, 4, 16, model.cfg.vocab_size)
        loss = loss_fn(model(x.cuda()), y.cuda())
        loss.backward()
        assert len(model._get_fsdp_state().ctx.pending_reduces) == 0
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= TOL64
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert diff <= TOL64
