"""python benchmarks/plot_snapshot.py SNAPSHOT.pickle --png docs/cuda-memory-timeline.png

Draw a CUDA caching-allocator snapshot (``torch.cuda.memory._dump_snapshot``, as
``benchmarks/gpu_checks.py snapshot`` writes one on a GPU) as a timeline: the bytes allocated on
each stream over the recorded step (the compute stream filled, the side streams as lines), and
one bar per side-stream block from its allocation to its free, labelled with the runtime function
that allocated it and the one that freed it. Prints the same blocks as a table, and for each
block whose address a later block of the same stream takes again, the gap between the free and
the reuse (the stream order that makes the reuse safe is the side stream's ``wait_stream`` on the
compute stream before each collective: see docs/reliability.md).

Runs on any machine (matplotlib, no GPU): the snapshot is a pickle of plain Python values.
"""

from __future__ import annotations

import argparse
import pickle

STREAM_NAMES = {0: "compute"}


def _runtime_frame(event: dict) -> str:
    """The innermost frame of this package (or the script) that allocated or freed the block."""
    for f in event.get("frames", []):
        if "/fully_shard/" in f["filename"]:
            return f["name"]
    return "?"


def blocks(trace: list[dict]) -> list[dict]:
    """Every block of a non-default stream: stream, addr, size, alloc/free times (ms), who."""
    t0, open_, out = trace[0]["time_us"], {}, []
    for e in trace:
        if e["stream"] == 0:
            continue
        t = (e["time_us"] - t0) / 1000
        if e["action"] == "alloc":
            open_[e["addr"]] = dict(stream=e["stream"], addr=e["addr"], size=e["size"], start=t, by=_runtime_frame(e))
        elif e["action"] == "free_completed" and e["addr"] in open_:
            b = open_.pop(e["addr"])
            b.update(end=t, freed_by=_runtime_frame(e))
            out.append(b)
    return out


def live_by_stream(trace: list[dict]) -> dict[int, tuple[list[float], list[int]]]:
    t0, live, series = trace[0]["time_us"], {}, {}
    for e in trace:
        if e["action"] not in ("alloc", "free_completed"):
            continue
        s = e["stream"]
        live[s] = live.get(s, 0) + (e["size"] if e["action"] == "alloc" else -e["size"])
        xs, ys = series.setdefault(s, ([], []))
        xs.append((e["time_us"] - t0) / 1000)
        ys.append(live[s])
    return series


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("--png", default=None)
    p.add_argument("--title", default="one training step, CUDA caching allocator (torch.cuda.memory._record_memory_history)")
    args = p.parse_args()
    with open(args.snapshot, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    side = blocks(trace)
    names = dict(STREAM_NAMES)
    for b in side:
        names.setdefault(b["stream"], "all_gather" if b["by"] == "empty_buffer" else f"stream {b['stream']}")
    print("| stream | bytes | allocated (ms) | by | freed (ms) | by | reused after (ms) |")
    print("|---|---|---|---|---|---|---|")
    for i, b in enumerate(side):
        later = next((c for c in side[i + 1:] if c["stream"] == b["stream"] and c["addr"] == b["addr"]), None)
        reuse = f"{later['start'] - b['end']:.3f}" if later else "-"
        print(f"| {names[b['stream']]} | {b['size']} | {b['start']:.3f} | {b['by']} | {b['end']:.3f} | "
              f"{b['freed_by']} | {reuse} |")
    if not args.png:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = live_by_stream(trace)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for s, (xs, ys) in series.items():
        mib = [y / 2**20 for y in ys]
        if s == 0:
            top.fill_between(xs, mib, step="post", alpha=0.35, label=f"{names[s]} stream")
        else:
            top.step(xs, mib, where="post", linewidth=1.5, label=f"{names[s]} stream")
    top.set_ylabel("MiB allocated")
    top.legend(loc="upper right")
    top.set_title(args.title, fontsize=10)
    for row, b in enumerate(side):
        bottom.barh(row, b["end"] - b["start"], left=b["start"], height=0.6, color="#dd8452")
        bottom.text(b["end"] + 0.1, row, f"{b['size'] / 2**20:.1f} MiB: {b['by']} -> {b['freed_by']}",
                    va="center", fontsize=7)
    bottom.set_yticks(range(len(side)))
    bottom.set_yticklabels([f"{names[b['stream']]} #{i}" for i, b in enumerate(side)], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlabel("ms since the step began")
    bottom.set_title("side-stream blocks: allocated (copy-in) to freed (after the copy-out was queued)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
