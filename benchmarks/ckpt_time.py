"""torchrun --nproc-per-node 1 benchmarks/ckpt_time.py --device cuda   (issue #26's GPU section)

How long the main job's checkpoint takes to write and to read back, for a model sharded with
``fully_shard``: the example Llama (default: the ~1.1B shape, dim 2048, 22 blocks, vocab 32,000),
parameters and AdamW state in ``--dtype`` (default bf16), after one optimizer step so that the
optimizer state exists. Saving and loading go through ``examples/checkpointing.py`` exactly as
``examples/train.py`` calls it (``get_state_dict`` -> ``torch.distributed.checkpoint`` into a
``.partial`` folder -> barrier -> atomic rename -> ``latest``), timed on a synchronized device
from the call to its return on every rank (the slowest rank's time is reported).

Each round saves a new checkpoint, then overwrites the model and optimizer state with garbage and
loads it back; the loaded shards are checked to equal the saved ones bit for bit (a timing of a load
that did not restore is worthless). The page cache is dropped before each load where the process
may (``/proc/sys/vm/drop_caches``; said in the output whether it could): otherwise the load reads
from memory, not from the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import checkpointing  # noqa: E402
from llama_model import Llama, LlamaConfig, loss_fn  # noqa: E402
from teardown import shutdown  # noqa: E402

from fully_shard import fully_shard  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/ckpt_time", help="where the checkpoints are written (and removed)")
    return p.parse_args()


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (root only); True if it took the request."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    out = [local(p.detach()) for p in model.parameters()]
    out += [local(v) for s in optimizer.state.values() for k, v in sorted(s.items()) if torch.is_tensor(v) and k != "step"]
    return out


def slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=int(args.dim * 8 / 3), max_seq_len=256)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg).to(DTYPES[args.dtype])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (world, 256), device=device)[rank:rank + 1]
    loss_fn(model(x), x.roll(-1, 1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in shards(model, optimizer))
    if rank == 0:
        print(f"model: {params / 1e9:.3f}B parameters in {args.dtype}, AdamW state in {args.dtype}, world {world} on "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; rank 0's shards "
              f"{state_bytes / 2**30:.2f} GiB", flush=True)
        fs = subprocess.run(["df", "-T", os.path.dirname(os.path.abspath(args.dir)) or "/"], capture_output=True, text=True)
        print("checkpoint file system:", fs.stdout.strip().splitlines()[-1] if fs.stdout else "?", flush=True)
    saves, loads, dropped, on_disk = [], [], [], 0
    for r in range(args.rounds):
        sync()
        dist.barrier()
        tic = time.perf_counter()
        path = checkpointing.save(args.dir, r + 1, model, optimizer, {}, keep=1)
        sync()
        saves.append(slowest(time.perf_counter() - tic, device))
        if rank == 0:
            on_disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        before = [t.clone() for t in shards(model, optimizer)]
        with torch.no_grad():
            for t in shards(model, optimizer):
                t.fill_(3.0)
        dropped.append(drop_page_cache())
        sync()
        dist.barrier()
        tic = time.perf_counter()
        checkpointing.load(path, model, optimizer)
        sync()
        loads.append(slowest(time.perf_counter() - tic, device))
        after = shards(model, optimizer)
        same = len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        flag = torch.tensor([0.0 if same else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise SystemExit(f"round {r + 1}: the loaded state differs from the saved one")
        if rank == 0:
            print(f"round {r + 1}: save {saves[-1]:.2f} s, load {loads[-1]:.2f} s (page cache dropped: {dropped[-1]}); "
                  "loaded state equals the saved one bit for bit", flush=True)
    if rank == 0:
        gib = on_disk / 2**30

        def row(what: str, xs: list[float]) -> str:
            m = statistics.median(xs)
            return f"| {what} | {m:.2f} s [{min(xs):.2f}-{max(xs):.2f}] | {gib / m:.2f} GiB/s |"

        print(f"\ncheckpoint on disk: {gib:.2f} GiB ({on_disk:,} bytes); median [min-max] of {args.rounds} rounds")
        print("| | time | throughput |\n|---|---|---|")
        print(row("save (get_state_dict + dcp.save + publish)", saves))
        print(row("load (dcp.load + set_state_dict)", loads))
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
