"""``shutdown()``: the last call of every example and benchmark script.

Gloo aborts a process ("terminate called without an active exception") when one rank closes its
connections while a peer still finishes the last collective; PyTorch's own fully_shard example
does it too, about one run in three without a barrier. A barrier alone still races on its own
last message. A store barrier after it cannot: a rank adds its key only once its gloo barrier has
returned, i.e. once it received every message it was sent, so when every key is there no gloo
message is left in flight and each rank can tear down. A second store barrier after
``destroy_process_group`` keeps every rank alive (its sockets open) until all have torn down: a rank
that exits while a peer is still joining its gloo threads might abort that peer the same way. (An
abort at exit, "terminate called without an active exception" on rank 0, was still seen in 3 of
about 100 runs of ``train_llama.py --bf16`` on 2026-11-25, once with this second barrier; not yet
explained.)
"""

from __future__ import annotations

import time

import torch.distributed as dist


def shutdown() -> None:
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    _store_barrier(store, "fully_shard_example_shutdown", world)
    dist.destroy_process_group()
    _store_barrier(store, "fully_shard_example_destroyed", world)  # the store outlives the group


def _store_barrier(store: dist.Store, key: str, world: int) -> None:
    store.add(key, 1)
    while store.add(key, 0) < world:
        time.sleep(0.01)
