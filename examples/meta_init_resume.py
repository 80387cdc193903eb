"""torchrun --nproc-per-node 2 examples/meta_init_resume.py --ckpt /tmp/fully_shard_ckpt --steps 5

Build the model on the meta device (no memory), fully_shard it, materialise only each rank's
shards with to_empty, and initialise them from a full state dict that only rank 0 holds. Train,
then save a sharded checkpoint with torch.distributed.checkpoint. Resume at any world size:

    torchrun --nproc-per-node 1 examples/meta_init_resume.py --ckpt /tmp/fully_shard_ckpt --resume --steps 3

CPU/gloo; on GPUs the same command uses NCCL (pass --device cuda).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, rotary_tables, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402

from fully_shard import fully_shard  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="load --ckpt instead of initialising")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    cfg = LlamaConfig(vocab_size=1024, dim=128, n_layers=4, hidden_dim=341, max_seq_len=64)

    with torch.device("meta"):
        model = Llama(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)  # each rank allocates its shards only
    for layer in model.layers:  # non-persistent buffers: rebuild them
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        layer.cos, layer.sin = cos.to(device), sin.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    start = 0
    if args.resume:
        if not os.path.exists(os.path.join(args.ckpt, ".metadata")):  # said here, not in DCP's tracebacks
            if rank == 0:
                print(f"--resume: no checkpoint at {args.ckpt}. Fix: run without --resume first with the same "
                      "--ckpt.", file=sys.stderr, flush=True)
            dist.destroy_process_group()
            sys.exit(2)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start} on {world} rank(s)")
    else:
        torch.manual_seed(0)
        full = Llama(cfg).state_dict() if rank == 0 else {}  # e.g. pretrained weights on rank 0 only
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    for step in range(start, start + args.steps):
        x, y = synthetic_batch(step, 8, cfg.max_seq_len, cfg.vocab_size)
        loss = loss_fn(model(x.chunk(world)[rank].to(device)), y.chunk(world)[rank].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step:3d}  loss {total.item() / world:.4f}")

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(start + args.steps)}, checkpoint_id=args.ckpt)
    if rank == 0:
        print(f"saved {args.ckpt} at step {start + args.steps}")

    shutdown()


if __name__ == "__main__":
    main()
