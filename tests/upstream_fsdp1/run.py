#!/usr/bin/env python
"""Run PyTorch's own FSDP1 tests (the files next to this one, copied verbatim from
pytorch/pytorch test/distributed/fsdp/) against ``fully_shard.fsdp1``, or with ``--torch``
against PyTorch's FSDP1 (the reference).

    python tests/upstream_fsdp1/run.py                 # ours
    python tests/upstream_fsdp1/run.py --torch         # PyTorch's FSDP1
    python tests/upstream_fsdp1/run.py test_fsdp_apply.py -k nested -v

How: ``_shim/`` goes first on ``PYTHONPATH``, so its ``sitecustomize`` patches every Python
process of the run, the pytest process and each rank that the tests spawn, before any test
module (or ``torch.testing._internal.common_fsdp``) is imported; see
``_shim/upstream_fsdp1_shim.py`` for what it patches. pytest runs with ``--noconftest``, so the
``conftest.py`` here (which keeps the project's default ``pytest`` run from collecting these
files) and ``tests/conftest.py`` are not loaded. One line per test is printed as it finishes, then
a summary; the raw pytest output and a JSON-lines report go to ``--out`` (a temporary folder by
default). Exit status: 0 when no test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "_shim")
FILES = sorted(f for f in os.listdir(HERE) if f.startswith("test_") and f.endswith(".py"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help=f"test files (default: all of {', '.join(FILES)})")
    ap.add_argument("--torch", action="store_true", help="run against PyTorch's FSDP1 (the reference)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--world", type=int, default=2,
                    help="world size for test classes that do not fix their own (default 2)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print up to 12 lines of each error")
    ap.add_argument("--out", help="folder for pytest.log and report.jsonl (default: a new temporary one)")
    args = ap.parse_args()

    files = [os.path.join(HERE, os.path.basename(f)) for f in (args.files or FILES)]
    impl = "torch" if args.torch else "ours"
    out = args.out or tempfile.mkdtemp(prefix=f"upstream_fsdp1_{impl}_")
    os.makedirs(out, exist_ok=True)
    report = os.path.join(out, "report.jsonl")
    log = os.path.join(out, "pytest.log")

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM, env.get("PYTHONPATH")) if p)
    env["UPSTREAM_FSDP1_IMPL"] = impl
    env["UPSTREAM_FSDP1_WORLD"] = str(args.world)
    env["UPSTREAM_FSDP1_REPORT"] = report
    env.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider",
           "-p", "upstream_fsdp1_report", "-q", "-rN", "-W", "ignore::pytest.PytestAssertRewriteWarning",
           ]

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    seen: dict[str, str] = {}
    poisoned: list[str] = []
    aborted: list[str] = []  # a rank died of SIGABRT: rerun once, said in the output
    start = time.time()

    def emit(rec: dict, rerun: bool) -> None:
        if "banner" in rec:
            if not rerun:
                print(f"FSDP1 under test: {rec['banner']}   (log: {log})", flush=True)
            return
        nodeid = rec["nodeid"].split("upstream_fsdp1/")[-1]
        outcome = rec["outcome"]
        msg = rec.get("message") or []
        prev = seen.get(nodeid)
        if prev is not None:
            # a second report for one test: a teardown error, or the result of a rerun
            if not rerun and (outcome != "failed" or prev == "failed"):
                return
            counts[prev] -= 1
        seen[nodeid] = outcome
        counts[outcome] += 1
        if not rerun and outcome == "skipped" and msg and "Previous test failed" in msg[0]:
            # FSDPTestContinuous (MultiProcContinuousTest) skips the rest of a class after a
            # failure; such tests are rerun alone below.
            poisoned.append(nodeid)
            return
        if not rerun and outcome == "failed" and any("but got -6" in m for m in msg):
            # Seen once in CI (1 of ~400 runs of these tests): "terminate called without an active
            # exception" as a rank's interpreter shut down while a gloo thread dropped a tensor.
            aborted.append(nodeid)
        line = f"{outcome.upper():8} {nodeid} ({rec['seconds']:.1f}s)"
        if rerun:
            line += " [run alone]"
        if msg:
            line += f"  -- {msg[0]}"
        print(line, flush=True)
        if args.verbose and outcome == "failed":
            for extra in msg[1:]:
                print(f"             {extra}", flush=True)

    pos = 0

    def run_pytest(targets: list[str], rerun: bool) -> int:
        def drain() -> None:
            nonlocal pos
            if not os.path.exists(report):
                return
            with open(report) as f:
                f.seek(pos)
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break
                    pos = f.tell()
                    emit(json.loads(line), rerun)

        with open(log, "a") as logf:
            logf.write(f"\n===== {' '.join(cmd + targets)}\n")
            logf.flush()
            proc = subprocess.Popen(cmd + targets, cwd=HERE, env=env, stdout=logf, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                time.sleep(0.5)
                drain()
            drain()
        return proc.returncode

    open(log, "w").close()
    open(report, "w").close()
    rc = run_pytest(files + (["-k", args.keyword] if args.keyword else []), rerun=False)
    while poisoned:
        nodeid = poisoned.pop(0)
        run_pytest([os.path.join(HERE, nodeid)], rerun=True)
    for nodeid in aborted:
        print(f"         {nodeid}: a rank aborted (SIGABRT, exit -6); run once more, alone", flush=True)
        run_pytest([os.path.join(HERE, nodeid)], rerun=True)

    elapsed = time.time() - start
    total = sum(counts.values())
    print(f"\n{impl}: {total} tests: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped in {elapsed:.0f}s (pytest exit {rc}; log: {log})")
    if rc not in (0, 1) or total == 0:
        print("pytest did not run normally; see the log", file=sys.stderr)
        return rc or 2
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
