"""torchrun --nproc-per-node 2 examples/train_llama.py

Train a small Llama-style model on synthetic tokens with fully_shard: each transformer block is
one communication group, the root holds the embedding (tied to the output projection) and the
final norm. Runs on CPU with gloo by default; on GPUs the same command uses NCCL and the current
device (torchrun sets LOCAL_RANK). Logs per step: loss, tokens/s and rank 0's memory, each labelled (shards, allocator peak or RSS).

Options: --steps N --batch B (global) --seq-len S --dim D --layers L --device {auto,cpu,cuda}
         --bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 master weights)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402
from train import state_mib  # noqa: E402  (the main job's count of a rank's shards)

from fully_shard import MixedPrecisionPolicy, fully_shard  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), split across ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--bf16", action="store_true", help="compute and all-gather in bf16, reduce in fp32")
    return p.parse_args()


def setup(device_arg: str) -> torch.device:
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def memory_fields(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """What this rank holds, each labelled: on an accelerator the allocator's peak; everywhere the
    bytes of its parameter, gradient and optimizer-state shards; on CPU also the process's peak
    resident memory, which is mostly the torch runtime (libraries, thread pools), not tensors."""
    out = {"shards MiB (params+grads+optim)": state_mib(model, optimizer)}
    if device.type == "cuda":
        out["peak allocated MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        out["process peak RSS MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return out


def main() -> None:
    args = parse_args()
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    mesh = init_device_mesh(device.type, (world,))

    cfg = LlamaConfig(
        vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4, hidden_dim=int(args.dim * 8 / 3),
        max_seq_len=args.seq_len,
    )
    torch.manual_seed(0)  # every rank builds the same model, then keeps its shard
    model = Llama(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"world {world} on {device.type}{' (bf16 compute)' if args.bf16 else ''}: {n_params / 1e6:.2f}M parameters, {args.layers} blocks, "
              f"global batch {args.batch}x{args.seq_len}", flush=True)
    tokens_per_step = args.batch * args.seq_len
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, targets = synthetic_batch(step, args.batch, args.seq_len, cfg.vocab_size)
        inputs, targets = inputs.chunk(world)[rank].to(device), targets.chunk(world)[rank].to(device)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        elapsed = time.perf_counter() - start
        if rank == 0:
            memory = "  ".join(f"{k} {v:.1f}" for k, v in memory_fields(model, optimizer, device).items())
            print(f"step {step:3d}  loss {global_loss.item() / world:.4f}  tokens/s {tokens_per_step / elapsed:9.0f}  "
                  f"rank0: {memory}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
