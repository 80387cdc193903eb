"""``recommend``: try the usual settings for one world size, simulate each, and rank the ones
that fit a memory budget by estimated step time."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from .simulate import Plan, default_shard_fn, simulate
from .timing import PRESETS, Cluster, StepTime


@dataclass
class Option:
    """One setting tried: its mesh, ``reshard_after_forward``, parameter dtype, bucket budget
    (None: the default), whether shards are offloaded, and what the simulation says about it."""

    mesh_shape: tuple[int, ...]
    reshard_after_forward: Union[bool, int]
    param_dtype: str
    plan: Plan
    time: StepTime
    fits: bool
    bucket_bytes: Optional[int] = None
    offload: bool = False

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        bucket = "default" if self.bucket_bytes is None else f"{self.bucket_bytes / 2**20:g} MiB"
        host = f" (+{self.plan.host_peak_bytes / 2**30:.2f} host)" if self.offload else ""
        return (f"mesh {mesh:>8}  reshard_after_forward={str(self.reshard_after_forward):<5}  params {self.param_dtype}  "
                f"bucket {bucket:>8}  offload {'yes' if self.offload else 'no ':<3}  "
                f"peak {self.plan.peak_bytes / 2**30:6.2f} GiB{host}  {self.time}" + ("" if self.fits else "  (does not fit)"))


def recommend(
    build_model: Callable[[], nn.Module],
    sample_inputs: Any,
    *,
    world_size: int,
    bytes_per_rank: int,
    cluster: Union[str, Cluster] = "h100-nvlink-ib400-bf16",
    shard_sizes: Optional[Sequence[int]] = None,
    param_dtypes: Sequence[str] = ("fp32", "bf16"),
    bucket_sizes: Sequence[Optional[int]] = (None, 2**28),
    offload: Sequence[bool] = (False, True),
    optimizer: Union[str, Callable, None] = "adamw",
    steps: int = 2,
) -> list[Option]:
    """Simulate every combination of:

    * FSDP over all ranks, or HSDP with shard groups of ``shard_sizes`` (default: one node, 2 and 4
      nodes, as far as they divide the world);
    * ``reshard_after_forward`` True / False, and one node's ranks (FSDP beyond a node);
    * parameters in ``param_dtypes``: fp32, or bf16 (reduced in fp32; fp32 compute is priced at
      1/8 of the cluster's bf16 rate);
    * with ``reshard_after_forward=True`` (the schedule buckets follow), the root's
      ``set_bucket_bytes`` budgets in ``bucket_sizes`` (None: the default, 1 MiB);
    * ``CPUOffloadPolicy`` or not (``offload``; offloaded groups are never bucketed, so once per
      other setting).

    Returns the options that fit ``bytes_per_rank`` (device memory) first, fastest first, then the
    rest, smallest first. Each option is one simulation (the defaults make 5 per layout and dtype,
    7 for FSDP beyond a node: 44 for 512 ranks of 8-GPU nodes, about 90 s for a 1B model on a
    2-core CPU); narrow an axis to go faster."""
    if isinstance(cluster, str):
        if cluster not in PRESETS:
            raise ValueError(f"unknown cluster preset {cluster!r}; presets: {sorted(PRESETS)}, or pass a timing.Cluster.")
        cluster = PRESETS[cluster]
    unknown = [d for d in param_dtypes if d not in ("fp32", "bf16")]
    if unknown or not param_dtypes:
        raise ValueError(f"recommend(param_dtypes={tuple(param_dtypes)!r}): choose from 'fp32' and 'bf16'.")
    if not bucket_sizes or not offload:
        raise ValueError("recommend: bucket_sizes and offload each need at least one value (e.g. (None,) and (False,)).")
    node = cluster.gpus_per_node
    sizes = shard_sizes if shard_sizes is not None else [node * k for k in (1, 2, 4)]
    layouts: list[tuple[int, ...]] = [(world_size,)]
    layouts += [(world_size // s, s) for s in sizes if 1 < s < world_size and world_size % s == 0]
    from ..policy import CPUOffloadPolicy, MixedPrecisionPolicy

    policies = {"fp32": None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    options = []
    for mesh in layouts:
        shard = mesh[-1]
        reshards: list[Union[bool, int]] = [True, False] + ([node] if len(mesh) == 1 and shard > node and shard % node == 0 else [])
        for reshard in reshards:
            for dtype in param_dtypes:
                for off in dict.fromkeys(offload):
                    buckets = list(dict.fromkeys(bucket_sizes)) if reshard is True and not off else [None]
                    for bucket in buckets:
                        shard_fn = functools.partial(
                            default_shard_fn, mp_policy=policies[dtype], reshard_after_forward=reshard,
                            offload_policy=CPUOffloadPolicy() if off else None, bucket_bytes=bucket,
                        )
                        plan = simulate(build_model, sample_inputs, mesh_shape=mesh, shard_fn=shard_fn, optimizer=optimizer,
                                        steps=steps)
                        rate = cluster.flops if dtype == "bf16" else cluster.flops / 8
                        time = plan.estimate(dataclasses.replace(cluster, flops=rate))
                        options.append(Option(mesh, reshard, dtype, plan, time, plan.fits(bytes_per_rank), bucket, off))
    fitting = sorted((o for o in options if o.fits), key=lambda o: o.time.step_s)
    rest = sorted((o for o in options if not o.fits), key=lambda o: o.plan.peak_bytes)
    return fitting + rest
