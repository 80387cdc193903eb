"""Sharded checkpoints for the main job (examples/train.py), written so that a crash never leaves
a half-written one behind that a resume would load.

Layout under ``--ckpt DIR``: one folder per checkpoint, ``step_00000006/`` (what
``torch.distributed.checkpoint`` writes: each rank its shards, plus ``.metadata``), and ``latest``,
a text file naming the newest complete one. A checkpoint is written into ``step_N.partial/``
first; only when every rank has finished does rank 0 rename it to ``step_N/`` (one ``rename``:
atomic on a POSIX file system) and then replace ``latest`` (written aside, then ``os.replace``).
A kill at any moment leaves either the previous checkpoint or the new one as the latest, never a
partial one; ``.partial`` folders are ignored and cleaned up by the next save. The ``keep`` newest
complete checkpoints are kept.

What is saved: the model and optimizer (``get_state_dict``: sharded DTensors, so a checkpoint
loads at any world size and layout), the step (the data position: examples/textdata.py derives
the batch from the step), the CPU RNG state, and the training curve so far.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")
                  and (p / "meta.json").exists())


def latest(root: str) -> Path | None:
    """The newest complete checkpoint under ``root`` (None: there is none)."""
    r = Path(root)
    if not r.is_dir():
        return None
    named = r / "latest"
    if named.exists():
        path = r / named.read_text().strip()
        if (path / "meta.json").exists():
            return path
    done = _complete(r)
    return done[-1] if done else None


def save(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any], keep: int = 2, after_write: Callable[[], None] | None = None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    r = Path(root)
    final = r / f"step_{step:08d}"
    partial = r / f"step_{step:08d}.partial"
    rank = dist.get_rank()
    if rank == 0:
        r.mkdir(parents=True, exist_ok=True)
        for old in r.glob("*.partial"):  # left by a run killed while saving
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(partial))
    if after_write is not None:  # a fault drill (examples/faults.py): die before the checkpoint is published
        after_write()
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        meta = {"step": step, "world_size": dist.get_world_size(), **extra}
        (partial / "meta.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)  # published
        tmp = r / "latest.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, r / "latest")
        for old in _complete(r)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (any world size); returns its
    ``meta.json`` (step, curve, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])
    return json.loads((path / "meta.json").read_text())
