"""``recommend``: try the usual settings for one world size, simulate each, and rank the ones
that fit a memory budget by estimated step time."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from .simulate import Plan, default_shard_fn, simulate
from .timing import PRESETS, Cluster, StepTime


@dataclass
class Option:
    """One setting tried: its mesh, ``reshard_after_forward``, parameter dtype, and what the
    simulation says about it."""

    mesh_shape: tuple[int, ...]
    reshard_after_forward: Union[bool, int]
    param_dtype: str
    plan: Plan
    time: StepTime
    fits: bool

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        return (f"mesh {mesh:>8}  reshard_after_forward={str(self.reshard_after_forward):<5}  params {self.param_dtype}  "
                f"peak {self.plan.peak_bytes / 2**30:6.2f} GiB  {self.time}" + ("" if self.fits else "  (does not fit)"))


def recommend(
    build_model: Callable[[], nn.Module],
    sample_inputs: Any,
    *,
    world_size: int,
    bytes_per_rank: int,
    cluster: Union[str, Cluster] = "h100-nvlink-ib400-bf16",
    shard_sizes: Optional[list[int]] = None,
    optimizer: Union[str, Callable, None] = "adamw",
    steps: int = 2,
) -> list[Option]:
    """Every combination of: FSDP over all ranks or HSDP with shard groups of ``shard_sizes``
    (default: one node, 2 and 4 nodes, as far as they divide the world), ``reshard_after_forward``
    True / False (and one node's ranks, for FSDP beyond a node), and fp32 or bf16 parameters
    (bf16 reduces in fp32; fp32 compute is priced at 1/8 of the cluster's bf16 rate). Returns the
    options that fit ``bytes_per_rank`` first, fastest first, then the rest, smallest first."""
    if isinstance(cluster, str):
        if cluster not in PRESETS:
            raise ValueError(f"unknown cluster preset {cluster!r}; presets: {sorted(PRESETS)}, or pass a timing.Cluster.")
        cluster = PRESETS[cluster]
    node = cluster.gpus_per_node
    sizes = shard_sizes if shard_sizes is not None else [node * k for k in (1, 2, 4)]
    layouts: list[tuple[int, ...]] = [(world_size,)]
    layouts += [(world_size // s, s) for s in sizes if 1 < s < world_size and world_size % s == 0]
    from ..policy import MixedPrecisionPolicy

    policies = {"fp32": None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    options = []
    for mesh in layouts:
        shard = mesh[-1]
        reshards: list[Union[bool, int]] = [True, False] + ([node] if len(mesh) == 1 and shard > node and shard % node == 0 else [])
        for reshard in reshards:
            for dtype, mp in policies.items():
                shard_fn = functools.partial(_shard, mp=mp, reshard=reshard)
                plan = simulate(build_model, sample_inputs, mesh_shape=mesh, shard_fn=shard_fn, optimizer=optimizer, steps=steps)
                rate = cluster.flops if dtype == "bf16" else cluster.flops / 8
                time = plan.estimate(dataclasses.replace(cluster, flops=rate))
                options.append(Option(mesh, reshard, dtype, plan, time, plan.fits(bytes_per_rank)))
    fitting = sorted((o for o in options if o.fits), key=lambda o: o.time.step_s)
    rest = sorted((o for o in options if not o.fits), key=lambda o: o.plan.peak_bytes)
    return fitting + rest


def _shard(model: nn.Module, mesh: Any, *, mp: Any, reshard: Union[bool, int]) -> None:
    default_shard_fn(model, mesh, mp, reshard)
