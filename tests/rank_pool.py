"""A persistent pool of gloo rank processes that run test functions.

Spawning ranks per test costs seconds; this pool starts ``world_size`` processes once (forked
from a forkserver that has torch and fully_shard imported), each with a gloo process group, and
then runs a test body on every rank in well under a second. A test body is a module-level
function ``fn(*args)``; its return values come back as a list indexed by rank.

On any failure the pool returns every rank's traceback, tagged ``[rank N]``, and rebuilds itself
if a rank is stuck or died, so one broken test cannot hang or poison the rest. A rank that died
*between* tests (after its test passed: e.g. a native abort in a background thread) is found before
the next call, which then runs on a rebuilt pool; one killed by a signal *during* a call has that
call run once more (`RankPool.run`). Both are recorded in ``DEATHS`` (exit code, the call, the tail
of the rank's stderr) and reported at the end of the session (conftest.py). Between tests a pool
whose ranks hold more than ``MAX_GROUPS`` process groups is rebuilt (`RankPool.refresh`).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

PRELOAD = ["torch", "torch.distributed", "fully_shard"]  # imported once, in the forkserver
CALL_TIMEOUT_S = float(os.environ.get("FULLY_SHARD_TEST_TIMEOUT", "300"))
# Process groups a rank may hold before its pool is rebuilt after the test (`refresh`): tests make
# meshes and groups that nothing destroys, and every live gloo group slows a rank down (40 extra
# groups made the traced tests ~25% slower) and adds threads and sockets.
MAX_GROUPS = int(os.environ.get("FULLY_SHARD_TEST_MAX_GROUPS", "8"))
PG_TIMEOUT_S = 120
GRACE_AFTER_ERROR_S = 10.0


class RankFailure(AssertionError):
    pass


DEATHS: list[str] = []  # one per rank death between calls, and per call run again after a signal


def _worker_main(rank: int, world_size: int, store_path: str, conn: Connection, test_dir: str, log: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)  # native messages (an abort's "terminate called ...") and Python's, kept for `_tail`
    os.close(fd)
    faulthandler.enable()  # a fatal signal prints every thread's Python stack there too

    if test_dir not in sys.path:
        sys.path.insert(0, test_dir)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S)
    )
    while True:
        message = conn.recv()
        if message is None:
            break
        module_name, fn_name, args = message
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            result: tuple[str, Any] = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            result = ("err", f"[rank {rank}] " + traceback.format_exc())
        conn.send((*result, len(dist.distributed_c10d._world.pg_map)))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._last = "(start)"
        self.stale = False  # a rank holds more than MAX_GROUPS process groups
        self._start()

    def _start(self) -> None:
        self._dir = store_dir = tempfile.mkdtemp(prefix=f"fully_shard_pool{self.world_size}_")
        store_path = os.path.join(store_dir, "store")
        test_dir = os.path.dirname(os.path.abspath(__file__))
        self._logs = [os.path.join(store_dir, f"rank{rank}.stderr") for rank in range(self.world_size)]
        for rank in range(self.world_size):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store_path, child, test_dir, self._logs[rank]),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self) -> None:
        self._record_deaths()
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)

    def refresh(self) -> None:
        """Between tests: rebuild a stale pool (one test's calls may share a rank's state)."""
        if self.stale:
            self._record_deaths()
            self._restart()

    def _restart(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.join()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)
        self.stale = False
        self._start()

    def _record_deaths(self) -> bool:
        dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
        for i, code in dead:
            where = f"world {self.world_size}: rank {i} died (exit code {code}) after {self._last}"
            DEATHS.append(where + self._tail(i))
        return bool(dead)

    def _tail(self, rank: int, chars: int = 3000) -> str:
        """The end of what a rank wrote to its stderr (where a native abort says why)."""
        try:
            with open(self._logs[rank], "rb") as f:
                f.seek(max(0, os.path.getsize(self._logs[rank]) - chars))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        if not text.strip():
            return ""
        return "\n  its stderr ended with:\n    " + "\n    ".join(text.rstrip().splitlines()[-30:])

    def _replace_dead_ranks(self) -> None:
        if self._record_deaths():
            self._restart()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT_S, retry: bool = True
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the per-rank results or raise with every traceback.
        A rank killed by a signal inside torch's native code (a segfault in gloo seen once in a few
        suite runs, in a test that passes alone) does not fail the call the first time: it runs once
        more on a rebuilt pool (``retry=False``: it fails), and the death is listed at the end of
        the session (``DEATHS``)."""
        message = (fn.__module__, fn.__name__, args)
        self._replace_dead_ranks()
        self._last = f"{fn.__module__}.{fn.__name__}{args!r}"[:200]
        for conn in self._conns:
            conn.send(message)
        results: dict[int, tuple[str, Any]] = {}
        died, signalled = False, []
        deadline = timeout
        import time

        start = time.monotonic()
        while len(results) < self.world_size:
            remaining = deadline - (time.monotonic() - start)
            if any(status == "err" for status, _ in results.values()):
                remaining = min(remaining, GRACE_AFTER_ERROR_S)
            if remaining <= 0:
                break
            pending = {i: c for i, c in enumerate(self._conns) if i not in results}
            ready = wait(list(pending.values()), timeout=remaining)
            if not ready:
                break
            for i, conn in pending.items():
                if conn in ready:
                    try:
                        status, payload, groups = conn.recv()
                        results[i] = (status, payload)
                        self.stale = self.stale or groups > MAX_GROUPS
                    except EOFError:
                        died = True
                        self._procs[i].join(timeout=5)
                        code = self._procs[i].exitcode
                        results[i] = ("err", f"[rank {i}] process died (exit code {code}){self._tail(i)}")
                        if code is not None and code < 0:
                            signalled.append(results[i][1])
        errors = [payload for _, (status, payload) in sorted(results.items()) if status == "err"]
        missing = [i for i in range(self.world_size) if i not in results]
        if missing or died:
            why = f"no answer (stuck in a collective, or past the {timeout:.0f}s limit)"
            errors += [f"[rank {i}] {why}" for i in missing]
            self._restart()
        if signalled and retry:
            DEATHS.append(f"world {self.world_size}: during {self._last}, run again: " + "\n".join(signalled))
            return self.run(fn, *args, timeout=timeout, retry=False)
        if errors:
            raise RankFailure(f"{fn.__name__} failed on world size {self.world_size}:\n" + "\n".join(errors))
        return [results[i][1] for i in range(self.world_size)]
