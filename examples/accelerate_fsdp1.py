"""Hugging Face accelerate's FSDP1 path on fully_shard's engine (docs/migrating_from_fsdp1.md).

    torchrun --nproc-per-node 2 examples/accelerate_fsdp1.py                  # ours
    torchrun --nproc-per-node 2 examples/accelerate_fsdp1.py --impl ddp       # the same script on DDP

The two lines a user adds to an accelerate FSDP1 script: bind ``FullyShardedDataParallel`` to ours
before accelerate imports it, and (on CPU only) tell accelerate to use its FSDP path, which it
otherwise replaces by DDP. Prints the loss of every step (``LOSSES ...``) on rank 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from teardown import shutdown


def bind_fsdp1_to_fully_shard() -> None:
    """Make ``torch.distributed.fsdp.FullyShardedDataParallel`` ours for code that imports it
    (accelerate imports it inside its functions, so binding before ``prepare`` is enough)."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_module

    from fully_shard.fsdp1 import FullyShardedDataParallel

    fsdp.FullyShardedDataParallel = FullyShardedDataParallel
    fsdp_module.FullyShardedDataParallel = FullyShardedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="ours", choices=["ours", "ddp"])
    p.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP"])
    p.add_argument("--use-orig-params", type=int, default=1)
    p.add_argument("--optimizer-first", type=int, default=1, help="build the optimizer before prepare()")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    p.add_argument("--state-dict-type", default="SHARDED_STATE_DICT", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save", default="", help="save_state here after step 2")
    p.add_argument("--resume", default="", help="load_state from here and run steps 2..")
    args = p.parse_args()

    if args.impl == "ours":
        bind_fsdp1_to_fully_shard()
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType, set_seed

    plugin = None
    if args.impl == "ours":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1,
            sharding_strategy=args.strategy,
            use_orig_params=bool(args.use_orig_params),
            auto_wrap_policy="size_based_wrap",
            min_num_params=100,
            state_dict_type=args.state_dict_type,
            cpu_ram_efficient_loading=False,
            # On CPU, mixed precision goes through the plugin (accelerate's own switch falls back to DDP).
            mixed_precision_policy=dict.fromkeys(("param_dtype", "reduce_dtype", "buffer_dtype"), torch.bfloat16)
            if args.mixed_precision == "bf16"
            else None,
        )
    acc = Accelerator(fsdp_plugin=plugin, mixed_precision=args.mixed_precision if plugin is None else "no", cpu=True)
    if plugin is not None and acc.distributed_type != DistributedType.FSDP:
        # On CPU accelerate picks DDP (MULTI_CPU) whatever the plugin says; its FSDP path runs on CPU.
        from accelerate.state import PartialState

        PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP  # both keep one
        acc.state.fsdp_plugin = plugin

    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 16, generator=gen), torch.randn(128, 4, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    if args.optimizer_first:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, loader = acc.prepare(model, opt, loader)
    else:
        model = acc.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt, loader = acc.prepare(opt, loader)
    first = 0
    if args.resume:
        acc.load_state(args.resume)
        first = 2
        loader = acc.skip_first_batches(loader, first)
    losses = []
    for step, (x, y) in enumerate(loader, start=first):
        if step == args.steps:
            break
        loss = ((model(x) - y) ** 2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()).mean().item())
        if step == 1 and args.save:
            acc.save_state(args.save)
    full = acc.get_state_dict(model)  # every rank takes part; rank 0 holds the full tensors
    if acc.is_main_process:
        print("MODEL", type(acc.unwrap_model(model)).__name__, type(model).__name__, sorted(full))
        print("LOSSES", " ".join(repr(v) for v in losses))
    shutdown()  # not acc.end_training(): gloo can abort a rank that tears down first (teardown.py)


if __name__ == "__main__":
    main()
