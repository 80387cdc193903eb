"""The rank pool itself: a rank that dies during a call fails that call only, and a rank that dies
*after* its call returned (a native abort in a background thread: CI saw one kill a world-2 rank
and fail every later world-2 test with ``BrokenPipeError``) is replaced before the next call."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch.distributed as dist

import rank_pool
from rank_pool import RankFailure, RankPool


def _sum_of_ranks() -> int:
    t = __import__("torch").tensor([dist.get_rank()])
    dist.all_reduce(t)
    return int(t.item())


def _die_now(rank: int) -> None:
    if dist.get_rank() == rank:
        print("dying on purpose", file=sys.stderr, flush=True)
        os._exit(3)


def _abort_after_returning(rank: int) -> str:
    if dist.get_rank() == rank:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGABRT)).start()
    return "ok"


@pytest.fixture
def pool():
    p = RankPool(2)
    yield p
    p.close()


def test_a_rank_that_dies_during_a_call_fails_it_and_the_next_call_runs(pool):
    with pytest.raises(RankFailure, match=r"\[rank 1\] process died \(exit code 3\)\n  its stderr ended with:\n"
                       r"    dying on purpose"):
        pool.run(_die_now, 1)
    assert pool.run(_sum_of_ranks) == [1, 1]


def test_a_rank_that_dies_after_its_call_is_replaced_and_reported(pool):
    before = len(rank_pool.DEATHS)
    assert pool.run(_abort_after_returning, 0) == ["ok", "ok"]
    deadline = time.monotonic() + 30
    while pool._procs[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.run(_sum_of_ranks) == [1, 1]
    (death,) = rank_pool.DEATHS[before:]
    head, _, stderr = death.partition("\n")
    assert head == f"world 2: rank 0 died (exit code {-signal.SIGABRT}) after test_rank_pool._abort_after_returning(0,)"
    assert "its stderr ended with:" in stderr and "Fatal Python error: Aborted" in stderr, death  # faulthandler's
    del rank_pool.DEATHS[before:]  # (deliberate: not a death to report at the end of the session)


def _segfault_once(rank: int, marker: str) -> str:
    """Rank ``rank`` dies of SIGSEGV the first time (``marker`` does not exist yet), then answers."""
    if dist.get_rank() == rank and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return "ok"


def test_a_rank_killed_by_a_signal_during_a_call_runs_it_again_once(pool, tmp_path):
    before = len(rank_pool.DEATHS)
    assert pool.run(_segfault_once, 1, str(tmp_path / "once")) == ["ok", "ok"]
    (death,) = rank_pool.DEATHS[before:]
    assert death.startswith(
        f"world 2: during test_rank_pool._segfault_once(1, {str(tmp_path / 'once')!r}), run again: "
        f"[rank 1] process died (exit code {-signal.SIGSEGV})"
    ), death
    assert "Fatal Python error: Segmentation fault" in death, death
    del rank_pool.DEATHS[before:]
    with pytest.raises(RankFailure, match=r"\[rank 1\] process died \(exit code -11\)"):  # twice: it fails
        pool.run(_segfault_once, 1, str(tmp_path / "never"), retry=False)


def _make_groups(n: int) -> tuple[int, int]:
    for _ in range(n):
        dist.new_group(list(range(dist.get_world_size())))
    return os.getpid(), len(dist.distributed_c10d._world.pg_map)


def test_a_pool_holding_too_many_process_groups_is_rebuilt_between_tests(pool):
    first = pool.run(_make_groups, rank_pool.MAX_GROUPS)  # the default group and MAX_GROUPS more
    assert [groups for _, groups in first] == [rank_pool.MAX_GROUPS + 1] * 2 and pool.stale
    same = pool.run(_make_groups, 0)  # within a test: the same ranks, their state kept
    assert same == first
    pool.refresh()  # between tests (conftest.py)
    fresh = pool.run(_make_groups, 0)
    assert [groups for _, groups in fresh] == [1, 1] and not pool.stale
    assert all(a != b for (a, _), (b, _) in zip(first, fresh))  # new processes


def test_fresh_process_answers_as_subprocess_run_would():
    """`fresh_process.run` (the planner tests' forked ``python -c`` / ``-m``), against the real
    interpreter on the same commands: exit status, stdout and stderr."""
    import subprocess

    import fresh_process

    cases = [
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        [sys.executable, "-c", "import sys; sys.exit('fully_shard.plan: refused')"],
        [sys.executable, "-c", "print(__name__); import torch.distributed as d; print(d.is_initialized())"],
        [sys.executable, "-m", "json.tool", "--no-such-flag"],
    ]
    for cmd in cases:
        real = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        forked = fresh_process.run(cmd, capture_output=True, text=True, timeout=300)
        assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr), cmd
    crash = fresh_process.run([sys.executable, "-c", "raise KeyError('weights.bin')"])
    assert crash.returncode == 1 and "Traceback" in crash.stderr and "KeyError: 'weights.bin'" in crash.stderr
    with pytest.raises(ValueError, match="takes \\[sys.executable"):
        fresh_process.run(["torchrun", "x.py"])
