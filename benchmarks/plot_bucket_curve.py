"""python benchmarks/plot_bucket_curve.py deep.json llama.json --png docs/bucket-budget.png

The bucket budget curve: for each ``bench_step.py --json`` file (a run with ``--unbucketed`` and
several ``--bucket-bytes N``), collectives per step, median step time and the allocator-counted
peak per rank against the budget, PyTorch's ``fully_shard`` as a dashed line.
"""

from __future__ import annotations

import argparse
import json


def curve(run: dict) -> list[tuple[int, dict]]:
    """(budget, row) points: off (0), every ``ours_bucket_N`` and the default row at its budget."""
    rows = run["rows"]
    points = {0: rows["ours_unbucketed"]} if "ours_unbucketed" in rows else {}
    points.update({int(n.rsplit("_", 1)[1]): r for n, r in rows.items() if n.startswith("ours_bucket_")})
    points.setdefault(run["default_bucket_bytes"], rows["ours"])
    return sorted(points.items(), key=lambda point: point[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--png", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    fig, axes = plt.subplots(len(runs), 3, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        points = curve(run)
        x = [max(b, 2**16) / 2**20 for b, _ in points]  # 0 (off) drawn at the left edge
        for ax, key, label in zip(row, ("collectives", "step_ms", "peak_mib"),
                                  ("collectives / step", "median step (ms)", "peak MiB / rank (allocator)")):
            ax.plot(x, [r[key] for _, r in points], "o-", label="ours")
            ax.axhline(run["rows"]["torch_fsdp2"][key], ls="--", color="gray", label="PyTorch fully_shard")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("set_bucket_bytes (MiB; leftmost: 0 = off)")
            ax.set_title(f"{run['model']}, world {run['world']}: {label}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print("wrote", args.png)


if __name__ == "__main__":
    main()
