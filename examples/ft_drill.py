"""python examples/ft_drill.py

A fault drill for examples/train_ft.py on one machine: a torchft lighthouse, two replica groups
of 2 ranks each (two ``torchrun``s, world 4 in all), group 1 killed with SIGKILL in the middle of
training, restarted 5 s later. Checks that group 0 kept training alone (no restart, no hang),
that group 1 came back with the live group's weights (its step jumps forward), and that both
groups end with identical weights (full state dicts compared). Prints what the fault cost.
Linux only (finds group 1's processes through /proc). Needs the ``[ft]`` extra (torchft).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DRILL = f"ftdrill{os.getpid()}"


def launch(group: int, port: int, env: dict, log: str) -> subprocess.Popen:
    env = {**env, "REPLICA_GROUP_ID": str(group), "FT_DRILL": DRILL}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           os.path.join(HERE, "train_ft.py")]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def kill_group(group: int) -> int:
    """SIGKILL every process of this drill's group (torchrun and its workers)."""
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"FT_DRILL={DRILL}".encode() in env and f"REPLICA_GROUP_ID={group}".encode() in env:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
    return killed


def steps(log: str) -> list[tuple[int, int, float]]:
    """(step, participants, time) of each step rank 0 of a group logged."""
    text = open(log).read()
    return [(int(a), int(b), float(c)) for a, b, c in
            re.findall(r"step (\d+) participants (\d+) loss \S+ t=([0-9.]+)", text)]


def main() -> None:
    from torchft.coordination import LighthouseServer

    out = tempfile.mkdtemp(prefix="ft_drill_")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    port = lighthouse.address().rsplit(":", 1)[1]
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "NUM_REPLICA_GROUPS": "2",
           "STEPS": os.environ.get("STEPS", "100"), "FT_OUT": out}
    logs = [os.path.join(out, n) for n in ("group0.log", "group1.log", "group1_restarted.log")]
    g0, g1 = launch(0, 29640, env, logs[0]), launch(1, 29641, env, logs[1])
    while not any(s >= 20 for s, _, _ in steps(logs[1])):  # both groups training together
        time.sleep(0.2)
        if g0.poll() is not None or g1.poll() is not None:
            raise SystemExit(f"a group ended before the fault; logs in {out}")
    killed_at = time.time()
    print(f"killed {kill_group(1)} processes of group 1 at its step {steps(logs[1])[-1][0]}", flush=True)
    time.sleep(5)
    g1b = launch(1, 29642, env, logs[2])
    for p in (g0, g1b):
        p.wait(timeout=300)
    lighthouse.shutdown()
    alone = [s for s, n, t in steps(logs[0]) if n == 1 and t > killed_at]
    back = [(s, t) for s, n, t in steps(logs[2]) if n == 2]
    a, b = (torch.load(os.path.join(out, f"final_group{g}.pt")) for g in (0, 1))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"group 0: exit {g0.returncode}, trained {len(alone)} steps alone while group 1 was away "
          f"(steps {alone[0] if alone else '-'}..{alone[-1] if alone else '-'})")
    print(f"group 1: back in the quorum at step {back[0][0]}, {back[0][1] - killed_at:.1f} s after the kill "
          f"(5 s of it waiting before the restart); exit {g1b.returncode}")
    print(f"final weights of the two groups identical: {same}  (logs: {out})")
    if not (same and g0.returncode == 0 and g1b.returncode == 0 and alone and back):
        raise SystemExit(1)


if __name__ == "__main__":
    try:
        main()
    finally:  # nothing of the drill outlives it (a failed run would hold its ports)
        kill_group(0)
        kill_group(1)
