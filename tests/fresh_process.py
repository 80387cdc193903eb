"""``python -c CODE`` and ``python -m MODULE ARGS`` without paying torch's import (~3 s each).

Tests of the planner run its command line and `simulate` (which needs a process without a
process group) in fresh processes. `run` forks each from the forkserver the rank pool uses, with
torch and fully_shard already imported there, and hands back what ``subprocess.run`` would: the
exit status (a ``SystemExit``'s, 1 with the traceback on stderr for an uncaught exception) and
what Python printed to stdout and stderr. A test that checks the real command line itself still
uses ``subprocess`` (tests/test_plan.py keeps one).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import traceback

from rank_pool import PRELOAD

_TEST_DIR = os.path.dirname(os.path.abspath(__file__))


def run(
    cmd: list[str], timeout: float = 300, capture_output: bool = True, text: bool = True
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for ``cmd`` of the
    form ``[sys.executable, "-c", code]`` or ``[sys.executable, "-m", module, *args]``. The child
    has the forkserver's working directory and environment: no ``cwd`` / ``env`` to take."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] not in ("-c", "-m"):
        raise ValueError(f"fresh_process.run takes [sys.executable, '-c' | '-m', ...], not {cmd[:3]}")
    if not (capture_output and text):
        raise ValueError("fresh_process.run always captures text output (capture_output=True, text=True)")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, cmd[1], cmd[2], cmd[3:]), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise subprocess.TimeoutExpired(cmd, timeout)
        code, out, err = parent.recv()
    except EOFError:  # the child died without answering (a native crash)
        proc.join(timeout=30)
        code, out, err = proc.exitcode if proc.exitcode else 1, "", f"child ended with {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)
        parent.close()
    return subprocess.CompletedProcess(cmd, code, out, err)


def _child(conn, flag: str, what: str, argv: list[str]) -> None:
    if _TEST_DIR not in sys.path:
        sys.path.insert(0, _TEST_DIR)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if flag == "-c":
                sys.argv = ["-c", *argv]
                exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = [what, *argv]
                runpy.run_module(what, run_name="__main__", alter_sys=True)
        except SystemExit as e:  # as the interpreter reads it: None 0, an int itself, else printed, 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends the interpreter
            traceback.print_exc()
            code = 1
    conn.send((code, out.getvalue(), err.getvalue()))
    conn.close()
