"""torchrun --nproc-per-node 2 benchmarks/walk_count.py [--impl ours|torch|both] [--json PATH] [--list]

How hard the runtime is to walk (issue #21): ``sys.setprofile`` (and ``threading.setprofile``, so
every thread is covered) over the training of ONE sharded ``nn.Linear(64, 64)`` at world size 2
(CPU, gloo; AdamW, an (8, 64) input per rank, loss = ``out.sum()``), counting the functions of the
package entered, on every thread, for this package's ``fully_shard`` and for PyTorch's
``torch.distributed.fsdp.fully_shard``. Two windows are measured:

* build + step 1: ``fully_shard(lin, mesh=mesh)``, the optimizer, and the first step (forward,
  backward, ``optimizer.step()``, ``zero_grad()``). The device mesh is made before the window.
* one steady step: step ``--step`` (default 3), after the earlier steps ran unmeasured.

Counting rules:

* The package is every file under its directory: ``fully_shard/`` (``src/fully_shard``, its
  subpackages included) for ours, ``torch/distributed/fsdp/_fully_shard/`` for PyTorch's.
* A function is a code object ``(file, first line number, name)``; a function of the package is
  *entered* on each ``'call'`` profile event of a code object in a package file. Module bodies
  (``<module>``: a lazy import) are not functions and are skipped; both packages are imported
  before measuring. Lambdas, comprehensions and nested functions are functions (Python 3.12+
  inlines list/dict/set comprehensions, so there they would not be). A generator or coroutine is
  entered again each time it resumes.
* "A->B->A returns between files": on each thread, a ``'return'`` event of a package frame in file
  B whose nearest package caller frame (the first frame up its ``f_back`` chain whose code is in a
  package file, non-package frames such as ``nn.Module.__call__`` or autograd skipped) is in a
  file A != B, i.e. control goes back from B into A after A called into B. A return with no
  package caller (a hook called by torch from user code) does not count. A generator's ``yield``
  is a ``'return'`` event, so it counts like a return. Exceptions unwinding a frame count too.
* Distinct functions / files are the union over all threads and over the window; the thread
  names that entered package code are kept in the JSON.

Threads: ``threading.setprofile`` covers threads started after it is called (Python 3.11 has no
way to install a profile function on a running thread), so the profile function is installed on
this thread and for new threads before each model is built, and stays installed (idle between
the windows) until that implementation's steady window closes, so work on any thread a step
starts is counted (ours starts none since #22; before, its ``fully_shard-release`` thread).
Gloo's and autograd's CPU threads run no Python (CPU backward runs on the calling thread). Each
window opens and closes only once no package event has been seen for 50 ms on any thread, so a
helper thread's tail of the step before is not counted and that of the measured step is. When
done, the profile function is removed from this thread and from ``threading``, and every other
thread it was installed on removes it at its next profile event.

Rank 0 prints the table (its own numbers; a note follows if rank 1's differ). Options:
--impl {ours,torch,both} --step N --json PATH (all numbers, both windows' function lists with
calls, returns between files per (A, B) pair and how many skipped a non-package frame)
--list (steady-step functions grouped by file, with calls per step, for each measured impl)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from teardown import shutdown  # noqa: E402

Function = tuple[str, int, str]  # (file relative to the package directory, first line, name)


@dataclass
class Walk:
    """What one measured window saw."""

    calls: Counter[Function] = field(default_factory=Counter)  # 'call' events per function
    returns_between_files: int = 0
    return_pairs: Counter[tuple[str, str]] = field(default_factory=Counter)  # (A, B) of those returns
    indirect_returns: int = 0  # of those, returns whose direct caller is not a package frame
    threads: set[str] = field(default_factory=set)

    @property
    def functions(self) -> int:
        return len(self.calls)

    @property
    def files(self) -> int:
        return len({f[0] for f in self.calls})

    def summary(self) -> dict[str, Any]:
        return {"functions": self.functions, "files": self.files, "calls": sum(self.calls.values()),
                "returns_between_files": self.returns_between_files,
                "indirect_returns_between_files": self.indirect_returns,
                "returns_by_files": {f"{a} -> {b} -> {a}": n
                                     for (a, b), n in sorted(self.return_pairs.items())},
                "threads": sorted(self.threads)}


class WalkProfiler:
    """A profile function counting the package's functions into ``window`` (idle when it is None)."""

    def __init__(self, package_dir: str) -> None:
        self.root = os.path.realpath(package_dir) + os.sep
        self._files: dict[CodeType, Optional[str]] = {}  # code -> file relative to root, None: not ours
        self._lock = threading.Lock()
        self.window: Optional[Walk] = None
        self.events = 0  # package 'call' / 'return' events, windows open or not (for settle())
        self.stopped = False

    def _file(self, code: CodeType) -> Optional[str]:
        try:
            return self._files[code]
        except KeyError:
            path = os.path.realpath(code.co_filename)
            rel = path[len(self.root):] if path.startswith(self.root) else None
            self._files[code] = rel
            return rel

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.stopped:
            sys.setprofile(None)  # removes it from the thread this event is on
            return
        if event != "call" and event != "return":
            return  # c_call / c_return / c_exception: C functions are not the package's
        code = frame.f_code
        file = self._file(code)
        if file is None or code.co_name == "<module>":
            return
        self.events += 1
        window = self.window
        if window is None:
            return
        if event == "call":
            with self._lock:
                window.calls[(file, code.co_firstlineno, code.co_name)] += 1
                window.threads.add(threading.current_thread().name)
            return
        caller = frame.f_back
        while caller is not None:
            caller_file = self._file(caller.f_code)
            if caller_file is not None:
                if caller_file != file:
                    with self._lock:
                        window.returns_between_files += 1
                        window.return_pairs[(caller_file, file)] += 1
                        window.indirect_returns += caller is not frame.f_back
                return
            caller = caller.f_back

    def install(self) -> None:
        """On this thread and on every thread started from now on."""
        sys.setprofile(self)
        threading.setprofile(self)

    def remove(self) -> None:
        self.window = None
        self.stopped = True
        sys.setprofile(None)
        threading.setprofile(None)
        assert sys.getprofile() is None and threading.getprofile() is None

    def settle(self, quiet_s: float = 0.05, timeout_s: float = 5.0) -> None:
        """Return once no package event has happened for ``quiet_s`` on any thread."""
        deadline = time.monotonic() + timeout_s
        seen = self.events
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            if self.events == seen:
                return
            seen = self.events

    def measure(self, fn: Callable[[], Any]) -> tuple[Walk, Any]:
        """(what ``fn`` and the threads running beside it did, ``fn()``)."""
        self.settle()
        self.window = walk = Walk()
        result = fn()
        self.settle()
        self.window = None
        return walk, result


class Trainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self, step: int, batch: int, dim: int) -> None:
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(batch, dim, generator=gen)
        self.model(x).sum().backward()
        self.opt.step()
        self.opt.zero_grad()


def build(impl: str, mesh: DeviceMesh, dim: int) -> Trainer:
    torch.manual_seed(0)
    lin = nn.Linear(dim, dim)
    if impl == "ours":
        from fully_shard import fully_shard

        fully_shard(lin, mesh=mesh)
    elif impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(lin, mesh=mesh)
    else:
        raise ValueError(impl)
    return Trainer(lin)


def package_dir(impl: str) -> str:
    if impl == "ours":
        import fully_shard

        return os.path.dirname(fully_shard.__file__)
    import torch.distributed.fsdp._fully_shard as torch_fully_shard_pkg

    return os.path.dirname(torch_fully_shard_pkg.__file__)


def measure(impl: str, mesh: DeviceMesh, args: argparse.Namespace) -> tuple[Walk, Walk]:
    """(build + step 1, steady step ``args.step``) of one implementation."""
    profiler = WalkProfiler(package_dir(impl))
    profiler.install()
    try:
        def build_and_step() -> Trainer:
            trainer = build(impl, mesh, args.dim)
            trainer.step(1, args.batch, args.dim)
            return trainer

        first, trainer = profiler.measure(build_and_step)
        for s in range(2, args.step):
            trainer.step(s, args.batch, args.dim)
        dist.barrier()
        steady, _ = profiler.measure(lambda: trainer.step(args.step, args.batch, args.dim))
        dist.barrier()
    finally:
        profiler.remove()
    return first, steady


def table_numbers(summaries: tuple[dict[str, Any], dict[str, Any]]) -> str:
    """The table's cells from one rank's (build + step 1, steady) summaries."""
    first, steady = summaries
    return (f"{first['functions']} / {first['files']} | "
            f"{steady['functions']} / {steady['files']} / {steady['returns_between_files']}")


def function_list(walk: Walk) -> list[dict[str, Any]]:
    return [{"file": f, "line": line, "name": name, "calls": n}
            for (f, line, name), n in sorted(walk.calls.items())]


def format_list(impl: str, walk: Walk) -> str:
    by_file: dict[str, list[tuple[int, str, int]]] = {}
    for (f, line, name), n in sorted(walk.calls.items()):
        by_file.setdefault(f, []).append((line, name, n))
    lines = [f"Steady-step functions of {impl} ({walk.functions} in {walk.files} files; calls per step):", ""]
    for f, funcs in sorted(by_file.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"{f} ({len(funcs)} functions, {sum(n for _, _, n in funcs)} calls)")
        lines.extend(f"    {name}:{line}  x{n}" for line, name, n in funcs)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "torch", "both"], default="both")
    p.add_argument("--step", type=int, default=3,
                   help="the steady step measured (the steps before it run unmeasured)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the numbers here (rank 0)")
    p.add_argument("--list", action="store_true", help="print the steady-step functions grouped by file")
    args = p.parse_args()
    if args.step < 2:
        raise SystemExit("--step must be >= 2 (step 1 is in the build window)")

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    impls = ["ours", "torch"] if args.impl == "both" else [args.impl]
    for impl in impls:
        package_dir(impl)  # import it (and its modules) before any window
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    results: dict[str, tuple[Walk, Walk]] = {impl: measure(impl, mesh, args) for impl in impls}
    mine = {impl: (first.summary(), steady.summary()) for impl, (first, steady) in results.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)

    if dist.get_rank() == 0:
        names = {"ours": "ours (fully_shard)", "torch": "torch (torch.distributed.fsdp)"}
        lines = [
            f"world {dist.get_world_size()}, one nn.Linear({args.dim}, {args.dim}), CPU gloo, rank 0; "
            f"steady = step {args.step}; torch {torch.__version__}",
            "",
            "| impl | build+step1 functions / files | steady functions / files / A->B->A returns |",
            "|---|---|---|",
        ]
        for impl, (first, steady) in results.items():
            lines.append(f"| {names[impl]} | {first.functions} / {first.files} | "
                         f"{steady.functions} / {steady.files} / {steady.returns_between_files} |")
        lines.append("")
        for impl, (first, steady) in results.items():
            lines.append(f"{impl}: threads entering the package: build+step1 {sorted(first.threads)}, "
                         f"steady {sorted(steady.threads)}; package calls: build+step1 "
                         f"{sum(first.calls.values())}, steady {sum(steady.calls.values())}")
        for rank, other in enumerate(gathered[1:], start=1):
            for impl in impls:
                theirs, ours_ = table_numbers(other[impl]), table_numbers(mine[impl])
                if theirs != ours_:
                    lines.append(f"note: rank {rank}'s numbers for {impl} differ: {theirs} (rank 0: {ours_})")
        print("\n".join(lines), flush=True)
        if args.list:
            for impl, (_, steady) in results.items():
                print("\n" + format_list(impl, steady), flush=True)
        if args.json:
            out = {
                "world": dist.get_world_size(), "dim": args.dim, "batch": args.batch,
                "steady_step": args.step, "torch": torch.__version__,
                "impls": {impl: {"build_step1": mine[impl][0], "steady": mine[impl][1],
                                 "steady_functions": function_list(results[impl][1]),
                                 "build_step1_functions": function_list(results[impl][0])}
                          for impl in impls},
                "other_ranks": {str(r): g for r, g in enumerate(gathered) if r},
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
