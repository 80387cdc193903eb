"""torchrun --nproc-per-node 2 examples/fsdp1_migration.py [--torch]

An FSDP1 training script (the wrapper class, an auto-wrap policy, MixedPrecision, gradient
accumulation with no_sync, clip_grad_norm_, a full state dict and optimizer state dict saved at the
end) that runs on this package's engine. Migrating it changed one line: the import below. With
``--torch`` the same script runs on PyTorch's own FSDP1 instead, for comparison (the losses match).

Options: --steps N --accum K (micro-batches per step, the first K-1 under no_sync) --bf16
         --strategy {FULL_SHARD,SHARD_GRAD_OP,NO_SHARD} --save FILE --torch
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, TransformerBlock, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402

if "--torch" in sys.argv:  # PyTorch's FSDP1, to compare with
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision  # noqa: E402
    from torch.distributed.fsdp import ShardingStrategy, StateDictType  # noqa: E402
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402
else:  # the migration: this import instead of torch.distributed.fsdp's
    from fully_shard.fsdp1 import FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision  # noqa: E402
    from fully_shard.fsdp1 import ShardingStrategy, StateDictType  # noqa: E402
    from fully_shard.fsdp1.wrap import transformer_auto_wrap_policy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    p.add_argument("--save", default=None, help="write the full model + optimizer state dict here (rank 0)")
    p.add_argument("--torch", action="store_true", help="run on PyTorch's FSDP1 instead")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    cfg = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_seq_len=32)
    torch.manual_seed(0)
    model = FSDP(
        Llama(cfg),
        sharding_strategy=ShardingStrategy[args.strategy],
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None,
        device_id=device,
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        inputs, targets = synthetic_batch(step, 8, 32, cfg.vocab_size)
        x, y = inputs.chunk(world)[rank], targets.chunk(world)[rank]
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            with model.no_sync() if i < args.accum - 1 else contextlib.nullcontext():
                loss = loss_fn(model(xm), ym) / args.accum
                loss.backward()
            total += loss.item()
        norm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world:.6f}  grad norm {float(norm):.4f}", flush=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        print(f"full state dict: {len(model_state)} tensors, e.g. {next(iter(model_state))}", flush=True)
        if args.save:
            torch.save({"model": model_state, "optim": optim_state}, args.save)
    shutdown()


if __name__ == "__main__":
    main()
