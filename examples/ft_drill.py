"""python examples/ft_drill.py [--steps N] [--kill-at-step K] [--away S] [--fp64] [--compile] [--out DIR]

A fault drill of the main job's fault-tolerant replica groups (``examples/train.py --ft``,
docs/fault_tolerance.md) on one machine: a torchft lighthouse and two replica groups of 2 ranks
each (two ``torchrun``s, world 4 in all). Rank 1 of group 1 is killed with SIGKILL in the middle of
step K's backward; its torchrun stops the rest of the group. ``--away S`` (default 5): the group is
relaunched S seconds later, as a lost machine is replaced; ``--away -1``: the group's own
``torchrun --max-restarts 1`` relaunches it at once, as after a process crash. The relaunched
group copies the weights and optimizer state from group 0 and rejoins. Checks that group 0 kept
training (alone while group 1 was away: no restart, no hang), that group 1 came back, and that
both groups end with identical weights (their final checkpoints compared tensor by tensor).
Prints what the fault cost. Needs the ``[ft]`` extra (torchft).

``tests/test_faults.py`` runs it in float64 and checks the final weights against a single-process
model trained on the same batches, each step on the groups that took part in it."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ["--max-bytes", "400000", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "8",
         "--ckpt-every", "100000", "--eval-batches", "2", "--samples", "0", "--log-every", "1"]


def launch(group: int, port: int, env: dict, out: str, extra: list[str], log: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           "--monitor-interval=0.1", f"--max-restarts={restarts}",
           os.path.join(HERE, "train.py"), "--ft", "--out", os.path.join(out, f"group{group}"), *extra]
    log = open(os.path.join(out, log), "w")
    return subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": str(group)}, stdout=log, stderr=subprocess.STDOUT)


def committed(text: str) -> list[tuple[int, int]]:
    """(step, replica groups in it) of every step a group's rank 0 logged as done."""
    return [(int(s), int(g)) for s, g in re.findall(r"^step +(\d+)/\d+ .* groups (\d+)", text, re.M)]


def who_trained(logs: dict[str, str]) -> dict[int, list[int]]:
    """Step -> the replica groups whose batches it was computed on: the groups that logged it as
    done (a group copying another's state takes the copied steps without computing them). Each
    group's count of groups in the step must agree."""
    seen: dict[int, set[int]] = {}
    counts: dict[int, set[int]] = {}
    for name, text in logs.items():
        group = int(re.match(r"group(\d)", name)[1])
        for step, n in committed(text):
            seen.setdefault(step, set()).add(group)
            counts.setdefault(step, set()).add(n)
    for step, groups in seen.items():
        assert counts[step] == {len(groups)}, f"step {step}: logged by groups {groups}, counts {counts[step]}"
    return {step: sorted(groups) for step, groups in sorted(seen.items())}


def final_weights(out: str, group: int, steps: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(out, f"group{group}.pt")
    dcp_to_torch_save(os.path.join(out, f"group{group}", "ckpt", f"step_{steps:08d}"), path)
    return torch.load(path, weights_only=False)["model"]


def drill(steps: int, kill_at: int, fp64: bool, out: str, away: float | None, step_seconds: float = 0.1,
          head_start: float = 0.0, compile: bool = False) -> dict:
    """``away``: seconds group 1 stays dead before the drill relaunches it (a machine lost and
    replaced); None: its own ``torchrun --max-restarts 1`` relaunches it at once (a process crash).
    ``head_start``: group 1 is launched this many seconds before group 0 (the job's first step
    still waits for both groups: ``--ft-start-groups``)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{lighthouse.address().rsplit(':', 1)[1]}",
           "NUM_REPLICA_GROUPS": "2"}
    common = [*SMALL, "--steps", str(steps), "--eval-every", str(steps), "--min-step-seconds", str(step_seconds),
              *(["--fp64"] if fp64 else []), *(["--compile"] if compile else [])]
    groups: list[subprocess.Popen] = []
    try:
        kill = ["--kill-at-step", str(kill_at), "--kill-rank", "1"]
        groups.append(launch(1, 29641, env, out, [*common, *kill], "group1.log", restarts=0 if away is not None else 1))
        time.sleep(head_start)
        groups.insert(0, launch(0, 29640, env, out, common, "group0.log"))
        if away is not None:
            groups[1].wait(timeout=600)  # the group is gone: its torchrun stopped the surviving rank
            time.sleep(away)
            groups.append(launch(1, 29642, env, out, common, "group1_relaunched.log"))
        for p in groups:
            p.wait(timeout=600)
    finally:
        for p in groups:
            p.kill()
        lighthouse.shutdown()
    logs = {name: open(os.path.join(out, name)).read() for name in sorted(os.listdir(out)) if name.endswith(".log")}
    killed = float(re.search(r"fault: rank 1 killed in the backward of step \d+ at t=([0-9.]+)", logs["group1.log"])[1])
    after = logs["group1.log"].split("fault: rank 1 killed")[1] if away is None else logs["group1_relaunched.log"]
    back = re.search(r"step (\d+): 2 replica group\(s\) in the quorum \(was \S+\) at t=([0-9.]+)", after)
    back = (int(back[1]), float(back[2])) if back else None
    history = who_trained(logs)
    alone = [s for s, g in history.items() if g == [0] and s >= kill_at]
    solo = re.search(r"step \d+: 1 replica group\(s\) in the quorum \(was 2\) at t=([0-9.]+)", logs["group0.log"])
    a, b = final_weights(out, 0, steps), final_weights(out, 1, steps)
    return {"exit": [groups[0].returncode, groups[-1].returncode], "killed": killed, "back": back, "alone": alone,
            "solo_after": float(solo[1]) - killed if solo and float(solo[1]) > killed else None,
            "history": history, "identical": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "weights": a, "logs": logs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--kill-at-step", type=int, default=20)
    p.add_argument("--fp64", action="store_true")
    p.add_argument("--away", type=float, default=5.0,
                   help="seconds group 1 stays dead before it is relaunched (a machine replaced); "
                        "-1: its own torchrun --max-restarts 1 relaunches it at once (a process crash)")
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true",
                   help="every group's training step compiled whole (train.py --compile): torchft's all-reduce "
                        "runs inside the compiled backward")
    args = p.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ft_drill_")
    os.makedirs(out, exist_ok=True)
    away = None if args.away < 0 else args.away
    r = drill(args.steps, args.kill_at_step, args.fp64, out, away, compile=args.compile)
    print(f"group 1: rank 1 killed (SIGKILL) in the backward of step {args.kill_at_step}; "
          + ("its torchrun relaunched the group at once" if away is None else f"the group relaunched {away:g} s later"))
    print(f"group 0: exit {r['exit'][0]}, trained {len(r['alone'])} steps alone after the kill "
          f"(steps {r['alone'][0] if r['alone'] else '-'}..{r['alone'][-1] if r['alone'] else '-'}"
          + (f", alone from {r['solo_after']:.1f} s after the kill" if r["solo_after"] is not None else "")
          + f"), {len(r['history'])} of {args.steps} steps trained")
    if r["back"]:
        print(f"group 1: back in the quorum at step {r['back'][0]}, {r['back'][1] - r['killed']:.1f} s after the kill; "
              f"exit {r['exit'][1]}")
    print(f"final weights of the two groups identical: {r['identical']}  (logs: {out})")
    if not (r["identical"] and r["exit"] == [0, 0] and r["back"] and (r["alone"] or away is None)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
