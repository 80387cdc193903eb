"""``shutdown()``: the last call of every example and benchmark script.

Gloo aborts a process ("terminate called without an active exception") when one rank closes its
connections while a peer still finishes the last collective; PyTorch's own fully_shard example
does it too, about one run in three without a barrier. A barrier alone still races on its own
last message. A store barrier after it cannot: a rank adds its key only once its gloo barrier has
returned, i.e. once it received every message it was sent, so when every key is there no gloo
message is left in flight and each rank can tear down.
"""

from __future__ import annotations

import time

import torch.distributed as dist


def shutdown() -> None:
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    store.add("fully_shard_example_shutdown", 1)
    while store.add("fully_shard_example_shutdown", 0) < world:
        time.sleep(0.01)
    dist.destroy_process_group()
