"""python benchmarks/gpu_checks.py {loops,snapshot,phases} [--device cuda] [--inject]

The accelerator checks of issues #21 and #23, one process at world 1 (NCCL on CUDA; gloo with
``--device cpu`` for a dry run):

* ``loops``: the ten training loops of tests/test_stream_check.py (plain, prefetch, gradient
  accumulation, HSDP, CPU offload, unbucketed, no reshard, post-optimizer event, explicit unshard,
  mixed precision) on the device, each compared with a float64 reference trained without sharding.
  Run it under PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``): CSAN then raises on any
  unsynchronised access or free, and the case's line shows what it reported. Compare with
  ``fully_shard.tools.stream_check``'s verdict on CPU for the same loops (tests/test_stream_check.py).
* ``snapshot PATH``: one training step of a 3-block Llama (after a warm-up step) with
  ``torch.cuda.memory._record_memory_history`` on; the snapshot goes to PATH (open it at
  https://pytorch.org/memory_viz, or draw it with benchmarks/plot_snapshot.py), and a summary of its
  allocations per stream is printed.
* ``phases``: a 1.17B Llama in bf16, ours and PyTorch's ``fully_shard``: each phase's allocator
  peak above its start (where a difference in docs/benchmarks.md's GPU table comes from).

``loops --inject`` runs the plain loop with tests/test_stream_check.py's bug (a) put in: under the
sanitizer it must be reported. ``benchmarks/gpu_session.sh`` runs all of it, and tests/test_gpu.py.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("tests", "examples"):
    sys.path.insert(0, os.path.join(HERE, "..", sub))

from _parity import TOL64, _mlp_loss, make_mlp, mlp_batch  # noqa: E402
from rank_utils import max_param_diff  # noqa: E402

CASES = [
    "plain", "prefetch", "accumulation", "hsdp", "offload", "unbucketed", "no_reshard", "post_optim_event",
    "explicit_unshard", "mixed",
]


def _init(device: str):
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return init_device_mesh(device, (1,)), init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))


def train_case(case: str, device: str, mesh, hsdp_mesh, steps: int = 3) -> float:
    from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = make_mlp().to(device)
    ref = copy.deepcopy(model)
    kwargs: dict = {}
    if case == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    if case == "mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    use = hsdp_mesh if case == "hsdp" else mesh
    for block in model[:3]:
        fully_shard(block, mesh=use, reshard_after_forward=case != "no_reshard", **kwargs)
    fully_shard(model, mesh=use, **kwargs)
    if case == "prefetch":
        model[0].set_modules_to_forward_prefetch([model[1], model[2]])
        model[2].set_modules_to_backward_prefetch([model[1], model[0]])
    if case == "unbucketed":
        model.set_bucket_bytes(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    micro = 2 if case == "accumulation" else 1
    for step in range(steps):
        for i in range(micro):
            x, y = (t.to(device) for t in mlp_batch(10 * step + i))
            model.set_requires_gradient_sync(i == micro - 1)
            _mlp_loss(model, x, y).backward()
            _mlp_loss(ref, x, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if case == "post_optim_event" and device == "cuda":
            model.set_post_optim_event(torch.cuda.current_stream().record_event())
        if case == "explicit_unshard":
            model[0].unshard(async_op=True).wait()
    if device == "cuda":
        torch.cuda.synchronize()
    return max_param_diff(model, ref)


def inject_no_wait_event() -> None:
    """tests/test_stream_check.py's bug (a): the all-gather's copy-out no longer waits for the
    all-gather stream's event. The sanitizer must report it (the check that it is on and looking)."""
    from fully_shard.runtime import comm

    original_wait = comm.Pending.wait

    def wait_skipping_event(self):
        if self.keeps_output:
            self.event = None
        original_wait(self)

    comm.Pending.wait = wait_skipping_event


def loops(device: str, inject: bool) -> int:
    mesh, hsdp_mesh = _init(device)
    if inject:
        inject_no_wait_event()
    sanitizer = os.environ.get("TORCH_CUDA_SANITIZER", "") not in ("", "0")
    print(f"torch {torch.__version__}, device {device}, CUDA sanitizer {'on' if sanitizer else 'off'}")
    failed = 0
    for case in CASES[:1] if inject else CASES:
        try:
            diff = train_case(case, device, mesh, hsdp_mesh)
            ok = diff <= TOL64 or case == "mixed"  # float32 compute is not the float64 reference
            print(f"{case:18s} {'ok' if ok else 'WRONG'}  max |param diff| vs float64 reference {diff:.2e}", flush=True)
            failed += not ok
        except Exception as error:  # a sanitizer report or a failure: print it whole, go on
            failed += 1
            print(f"{case:18s} RAISED {type(error).__name__}", flush=True)
            traceback.print_exc(file=sys.stdout)
    print(f"{len(CASES[:1] if inject else CASES) - failed} loops clean, {failed} not")
    dist.destroy_process_group()
    return 1 if failed else 0


def snapshot(path: str, device: str) -> int:
    from llama_model import LlamaConfig, loss_fn, synthetic_batch

    from _parity import llama64
    from fully_shard import fully_shard

    mesh, _ = _init(device)
    torch.manual_seed(0)
    model = llama64(LlamaConfig(n_layers=3, dim=256, hidden_dim=688, vocab_size=2048)).float()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = synthetic_batch(i, 4, 32, model.cfg.vocab_size)
        loss_fn(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    if device != "cuda":
        print("snapshot needs --device cuda (the caching allocator's history)")
        return 1
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    step(1)
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    import pickle

    with open(path, "rb") as f:
        data = pickle.load(f)
    comm = model.__dict__["_fsdp_state"].ctx.comm
    names = {torch.cuda.current_stream().cuda_stream: "compute"}
    for attr in ("all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
        s = getattr(comm, attr, None)
        if s is not None:  # a torch.Stream: its cudaStream_t through torch.cuda.Stream
            cs = torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
            names[cs.cuda_stream] = attr
    per: dict[str, list[int]] = {}
    for trace in data["device_traces"]:
        for e in trace:
            name = names.get(e.get("stream"), str(e.get("stream")))
            row = per.setdefault(name, [0, 0, 0])
            row[0] += e["action"] == "alloc"
            row[1] += e["action"] in ("free_requested", "free")
            row[2] += e["size"] if e["action"] == "alloc" else 0
    for name, (allocs, frees, nbytes) in per.items():
        print(f"stream {name:24s} allocs {allocs:5d} frees {frees:5d} bytes allocated {nbytes}")
    print(f"max_memory_allocated {torch.cuda.max_memory_allocated()} snapshot {path} ({os.path.getsize(path)} bytes)")
    dist.destroy_process_group()
    return 0


def phases(device: str) -> int:
    """Where a step's allocator peak differs, ours vs PyTorch's fully_shard: a 1.17B Llama in bf16
    (reduce in fp32), each block and the root sharded, world 1; per phase (forward, backward,
    optimizer step) the peak above what was allocated when the phase began, and what stays after."""
    from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    mesh, _ = _init(device)
    cfg = LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=16, hidden_dim=int(2048 * 8 / 3),
                      max_seq_len=2048)
    for name, shard, mp in (("ours", fully_shard, MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
                            ("torch", torch_fully_shard, TorchMP(torch.bfloat16, torch.float32))):
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = (t.to(device) for t in synthetic_batch(0, 4, 2048, cfg.vocab_size))
        row = []
        for step in range(2):
            marks = []
            torch.cuda.synchronize()
            for phase in ("forward", "backward", "step"):
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if phase == "forward":
                    loss = loss_fn(model(x), y)
                elif phase == "backward":
                    loss.backward()
                    del loss
                else:
                    opt.step()
                    opt.zero_grad()
                torch.cuda.synchronize()
                marks.append((phase, start, torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated()))
            row = marks
        mib = 2**20
        print(name, "  ".join(f"{p}: start {a / mib:.1f} peak+{b / mib:.1f} end {c / mib:.1f} MiB" for p, a, b, c in row))
        del model, opt, x, y
        import gc

        gc.collect()  # the sharded model's hooks hold it in reference cycles
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["loops", "snapshot", "phases"])
    p.add_argument("path", nargs="?", default="snapshot.pickle")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--inject", action="store_true", help="loops: the plain loop with bug (a) put in")
    args = p.parse_args()
    if args.what == "phases":
        sys.exit(phases(args.device))
    sys.exit(loops(args.device, args.inject) if args.what == "loops" else snapshot(args.path, args.device))


if __name__ == "__main__":
    main()
