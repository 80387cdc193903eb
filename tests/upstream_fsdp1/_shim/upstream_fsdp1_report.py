"""pytest plugin loaded by run.py (``-p upstream_fsdp1_report``): appends one JSON line per test
to ``$UPSTREAM_FSDP1_REPORT`` (nodeid, outcome, seconds, the error's first lines)."""

from __future__ import annotations

import json
import os
import re

_PATH = os.environ.get("UPSTREAM_FSDP1_REPORT")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Failure)\b.*|^[A-Za-z_][\w.]*: ")


def _write(record: dict) -> None:
    if _PATH:
        with open(_PATH, "a") as f:
            f.write(json.dumps(record) + "\n")


def error_lines(text: str) -> list[str]:
    """The raised exception's lines; for a failure in a spawned rank, that rank's exception
    (not the parent's "Process 1 exited with error code 10" wrapper)."""
    lines = text.splitlines()
    # the worker's traceback, if any: the last "Traceback" block
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        body = lines[starts[-1] + 1:]
        out: list[str] = []
        in_exc = False
        for line in body:
            if line.startswith("To execute this test") or line.startswith("Process ") and out:
                break
            if not in_exc:
                if line and not line.startswith(" ") and _EXC_LINE.match(line):
                    in_exc = True
                    out.append(line)
            else:
                out.append(line)
        while out and not out[-1].strip():
            out.pop()
        if out:
            return out
    return [line for line in lines if line.strip()] or ["(no message)"]


def pytest_sessionstart(session) -> None:  # noqa: ANN001
    import torch.distributed.fsdp as tfsdp

    cls = tfsdp.FullyShardedDataParallel
    _write({"banner": f"{cls.__module__}.{cls.__qualname__}"})


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001
    if report.when == "call" or report.outcome != "passed":
        if report.when != "call" and report.outcome == "passed":
            return
        rec = {"nodeid": report.nodeid, "outcome": report.outcome, "when": report.when,
               "seconds": round(report.duration, 2)}
        if report.outcome == "skipped":
            lr = report.longrepr
            rec["message"] = [lr[2] if isinstance(lr, tuple) else str(lr)]
        elif report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            rec["message"] = error_lines(text)[:12]
        _write(rec)
