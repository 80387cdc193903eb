"""The main job's fault-tolerant replica groups (``examples/train.py --ft``; docs/fault_tolerance.md).

HSDP whose replicate dimension is managed by torchft: each replica group is one ``torchrun``
whose ranks ``fully_shard`` the model among themselves; a torchft lighthouse keeps the quorum of
live groups; after our reduce-scatter inside the group, every reduced gradient shard is averaged
across the groups of the current quorum by ``Manager.allreduce`` (through ``set_all_reduce_hook``);
torchft's ``OptimizerWrapper`` applies a step only when every group's step was good. A group that
(re)joins copies the weights and optimizer state from a live one.

Environment (as torchft's own examples): ``TORCHFT_LIGHTHOUSE`` (the lighthouse's address),
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``. Needs the optional ``[ft]`` extra (torchft).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

from fully_shard import FSDPModule


def _forget_dead_manager(rank: int) -> None:
    """torchft's Manager finds its group's manager (served by group rank 0) through a key in the
    torchrun store (``MASTER_ADDR:MASTER_PORT``), without a per-attempt prefix. After ``torchrun
    --max-restarts`` relaunched the group, that key still names the dead attempt's manager, and a
    rank that reads it before rank 0 rewrites it waits on a dead address until the quorum times
    out (seen: the whole job stuck for 60 s, then failed). Rank 0 deletes the stale keys between
    two barriers of this attempt's process group, so every rank reads this attempt's address."""
    import torch.distributed as dist
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    dist.barrier()
    if rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              wait_for_workers=False)
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


class ReplicaGroups:
    """torchft's Manager wired to a model sharded with ``fully_shard`` inside this group."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int,
                 world: int, timeout_s: float = 10.0, start_groups: int | None = None,
                 start_timeout_s: float = 600.0) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
            from torchft.optim import OptimizerWrapper
        except ImportError as e:
            raise SystemExit(f"--ft needs torchft ({e}). Fix: pip install -e '.[ft]'") from None
        missing = [k for k in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS") if k not in os.environ]
        if missing:
            raise SystemExit(f"--ft: {', '.join(missing)} not set. Fix: start a lighthouse (torchft_lighthouse, or "
                             "examples/ft_drill.py) and give every group's torchrun TORCHFT_LIGHTHOUSE=http://host:port, "
                             "REPLICA_GROUP_ID=<0..N-1>, NUM_REPLICA_GROUPS=<N> (docs/fault_tolerance.md)")
        self.group, self.groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
        self.start_groups = self.groups if start_groups is None else start_groups
        self.start_timeout_s = start_timeout_s
        self.inner = optimizer
        # The sharded parameters, taken once between steps. torchft calls state_dict() from its own
        # thread (to serve a group that rejoins) while this one may be in a forward, whose module
        # places hold the unsharded parameters: the callbacks touch these shards only, never the
        # module. The shards change only in optimizer.step(), which torchft runs after the
        # rejoining group has fetched them (should_commit waits for every group's vote).
        self.shards = dict(model.named_parameters())
        _forget_dead_manager(rank)
        pg = ProcessGroupNCCL(timeout=timedelta(seconds=timeout_s)) if device.type == "cuda" else \
            ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=self._load, state_dict=self._state,
            replica_id=f"group{self.group}", timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world,
            use_async_quorum=False,  # the quorum (and any healing) is done when zero_grad returns: the step is known
        )
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(self.across_groups)
        self.optimizer = OptimizerWrapper(self.manager, optimizer)

    def across_groups(self, reduced: torch.Tensor) -> None:  # after our reduce-scatter in the group
        self.manager.allreduce(reduced).wait()

    def _state(self) -> dict:  # this rank's shards: group rank r of every group holds the same layout
        return {"model": {k: v.to_local().clone() for k, v in self.shards.items()}, "optim": self.inner.state_dict()}

    def _load(self, sd: dict) -> None:
        with torch.no_grad():
            for k, v in self.shards.items():
                v.to_local().copy_(sd["model"][k])
        self.inner.load_state_dict(sd["optim"])

    def begin_step(self) -> int:
        """Join the quorum (healing from a live group if this one is behind); the step to compute.

        Before the job's first step, the quorum is asked again until ``start_groups`` groups are in
        it: otherwise the group whose torchrun came up first trains alone, and one that comes up a
        moment later trains the same first steps on its own rather than joining (two histories, of
        which the later group's wins). A group that (re)joins a running job finds it past step 0
        and does not wait. Every rank of a group gets the same quorum, so all loop alike."""
        self.optimizer.zero_grad()
        deadline = time.monotonic() + self.start_timeout_s
        while self.manager.current_step() == 0 and self.manager.num_participants() < self.start_groups:
            if time.monotonic() > deadline:
                raise SystemExit(f"--ft: only {self.manager.num_participants()} of the {self.start_groups} replica "
                                 f"groups joined within {self.start_timeout_s:g} s of this one. Fix: start the "
                                 "others (same TORCHFT_LIGHTHOUSE), or --ft-start-groups 1 to begin with fewer")
            time.sleep(0.1)
            self.optimizer.zero_grad()  # a new quorum request
        return self.manager.current_step()

    def end_step(self, step: int) -> bool:
        """Apply the step if every group's was good; whether it was (if not, it is computed again)."""
        self.optimizer.step()
        return self.manager.current_step() == step + 1

    def resume_at(self, step: int) -> None:
        """After loading this group's own checkpoint of ``step``: the manager counts from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.state_dict()["batches_committed"]})

    def shutdown(self) -> None:
        self.manager.shutdown()
