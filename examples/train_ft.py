"""One replica group of a fault-tolerant HSDP job: ``fully_shard`` shards the model over the ranks
of this group (one ``torchrun``), and torchft averages the gradients across the groups through a
managed process group that tolerates a group dying and coming back (issue #26 item 2; run it with
examples/ft_drill.py, which starts the lighthouse and the groups, kills one and restarts it).

Wiring: after our reduce-scatter inside the group, ``set_all_reduce_hook`` hands each reduced
gradient shard to ``Manager.allreduce`` (an average over the groups in the current quorum); the
optimizer is wrapped in torchft's ``OptimizerWrapper``, which steps only when every group's step
was good (``should_commit``). A group that (re)joins gets the weights and optimizer state from a
live one through ``state_dict`` / ``load_state_dict``: this rank's shards (group rank r of every
group holds the same shard layout). Environment: ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``STEPS``, ``FT_OUT`` (where rank 0 writes the final full weights).

Experimental: tried by examples/ft_drill.py (and .ci/run); torchft is the optional ``[ft]`` extra.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import Llama, LlamaConfig, loss_fn, synthetic_batch  # noqa: E402
from teardown import shutdown  # noqa: E402

from fully_shard import fully_shard  # noqa: E402

from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

GROUP = int(os.environ.get("REPLICA_GROUP_ID", 0))
GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
STEPS = int(os.environ.get("STEPS", 40))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=2, hidden_dim=170, max_seq_len=32))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # The sharded parameters, taken once between steps. torchft calls state_dict() from its own
    # thread (to send the state to a group that rejoins) while this one may be in a forward: the
    # callbacks read and write these shards only, never the module (whose places hold the
    # unsharded parameters during a forward; model.state_dict() from another thread races with it).
    shards = dict(model.named_parameters())

    def state_dict():  # this rank's shards: group rank r of every group holds the same layout
        return {"model": {k: v.to_local().clone() for k, v in shards.items()}, "optim": inner.state_dict()}

    def load_state_dict(sd):
        with torch.no_grad():
            for k, v in shards.items():
                v.to_local().copy_(sd["model"][k])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{GROUP}",
        timeout=timedelta(seconds=10),
        rank=rank,
        world_size=world,
    )

    def across_groups(reduced: torch.Tensor) -> None:  # after our reduce-scatter in the group
        manager.allreduce(reduced).wait()

    for m in [model, *model.layers]:
        m.set_all_reduce_hook(across_groups)
    opt = OptimizerWrapper(manager, inner)
    while manager.current_step() < STEPS:
        opt.zero_grad()  # starts the quorum
        step = manager.current_step()
        x, y = synthetic_batch(step, 8 * GROUPS, 32, 256)
        part = GROUP * world + rank
        loss = loss_fn(model(x.chunk(GROUPS * world)[part]), y.chunk(GROUPS * world)[part])
        loss.backward()
        opt.step()  # commits only if the step was good everywhere
        if rank == 0:
            print(f"group {GROUP} step {step} participants {manager.num_participants()} loss {loss.item():.4f} "
                  f"t={time.time():.3f}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.2")))  # a drill's steps last long enough to be hit
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(os.environ.get("FT_OUT", "."), f"final_group{GROUP}.pt"))
    manager.shutdown()
    shutdown()


if __name__ == "__main__":
    main()
