"""Ranks as threads of one process (torch's threaded process group): per-rank state must never be
process-wide. The schedule check counts per root, so two threaded ranks agree on every collective,
and still catch a real divergence."""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _parity import TOL64

W = 2
# The global RNG is one per process: ranks that are threads build their models one at a time.
_INIT = threading.Lock()


def _run_threaded(fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(rank)`` on W threads, each rank in its own threaded process group; return each
    rank's result (its traceback text if it raised). The process's world is restored after."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    out: list[Any] = [None] * W

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=W, store=store)
        try:
            out[rank] = fn(rank)
        except BaseException:
            out[rank] = traceback.format_exc()
        finally:
            dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a threaded rank hung"
    finally:
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return out


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.skip = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = x + torch.tanh(block(x))
        return x


def _train(rank: int, skip_on_rank1: int = -1) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from fully_shard import debug, fully_shard

    mesh = init_device_mesh("cpu", (W,))
    with _INIT:
        torch.manual_seed(0)
        model = _Stack().double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_bucket_bytes(0)  # one collective per block
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1:
        model.skip = skip_on_rank1
    try:
        with debug.trace() as t:
            for step in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    except debug.ScheduleDivergence as e:
        model.reset_iter_state()
        return str(e)
    return t.count(), [p.full_tensor() for p in model.parameters()]


def _reference() -> list[torch.Tensor]:
    """The same three steps on one process, float64, on the global batch."""
    torch.manual_seed(0)
    model = _Stack().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.cat([torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r), dtype=torch.float64)
                       for r in range(W)])
        (model(x).sum() / W).backward()  # the mean over ranks of each rank's sum
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.fixture
def schedule_check() -> Any:
    from fully_shard import debug

    debug.set_schedule_check(True, timeout=2.0)
    yield
    debug.set_schedule_check(False)


def test_threaded_ranks_train_with_the_schedule_check_on(schedule_check: Any) -> None:
    results = _run_threaded(_train)
    ref = _reference()
    for rank, result in enumerate(results):
        assert not isinstance(result, str), result
        count, params = result
        # Per step: 3 block all-gathers in forward, 3 in backward (the root has no parameters of
        # its own), 3 reduce-scatters.
        assert count == 3 * 9, (rank, count)
        for p, r in zip(params, ref):
            diff = (p - r).abs().max().item()
            assert diff <= TOL64, (rank, diff)


def test_threaded_ranks_schedule_check_catches_a_skipped_block(schedule_check: Any) -> None:
    r0, r1 = _run_threaded(lambda rank: _train(rank, skip_on_rank1=1))
    for r in (r0, r1):
        assert isinstance(r, str) and "ranks disagree on collective #2 on process group" in r, r
        assert "rank 0: all_gather of 'blocks.1' (float64" in r and "rank 1: all_gather of 'blocks.2' (float64" in r, r
