"""``recommend``: try the usual settings for one world size, simulate each, and rank the ones
that fit a memory budget by estimated step time."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn

from .simulate import Plan, default_shard_fn, simulate
from .timing import PRESETS, Cluster, StepTime


@dataclass(frozen=True)
class Candidate:
    """A setting of your own for `recommend` to rank with the ones it makes, e.g. tensor parallel:
    a ``shard_fn(model, mesh)`` that calls ``parallelize_module`` and ``fully_shard`` on a mesh of
    ``mesh_shape`` named ``mesh_dim_names``. ``param_dtype`` ("fp32" / "bf16") says which compute
    rate prices it (set the policy itself in ``shard_fn``)."""

    label: str
    mesh_shape: tuple[int, ...]
    shard_fn: Callable[[nn.Module, Any], None]
    mesh_dim_names: Optional[tuple[str, ...]] = None
    param_dtype: str = "fp32"


@dataclass
class Option:
    """One setting tried: its mesh, ``reshard_after_forward``, parameter dtype, bucket budget
    (None: the default), whether shards are offloaded, and what the simulation says about it."""

    mesh_shape: tuple[int, ...]
    reshard_after_forward: Union[bool, int, None]  # None for a Candidate (its shard_fn decides)
    param_dtype: str
    plan: Plan
    time: StepTime
    fits: bool
    bucket_bytes: Optional[int] = None
    offload: bool = False
    int8_all_gather: bool = False
    label: str = ""  # a `Candidate`'s

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        host = f" (+{self.plan.host_peak_bytes / 2**30:.2f} host)" if self.plan.host_peak_bytes else ""
        tail = f"peak {self.plan.peak_bytes / 2**30:6.2f} GiB{host}  {self.time}" + (
            "" if self.fits else "  (does not fit)"
        )
        if self.label:
            return f"mesh {mesh:>8}  {self.label} (params {self.param_dtype})  {tail}"
        bucket = "default" if self.bucket_bytes is None else f"{self.bucket_bytes / 2**20:g} MiB"
        return (
            f"mesh {mesh:>8}  reshard_after_forward={str(self.reshard_after_forward):<5}  params "
            f"{self.param_dtype}  bucket {bucket:>8}  offload {'yes' if self.offload else 'no ':<3}  "
            + ("int8 all-gather  " if self.int8_all_gather else "")
            + tail
        )


def recommend(
    build_model: Callable[[], nn.Module],
    sample_inputs: Any,
    *,
    world_size: int,
    bytes_per_rank: int,
    cluster: Union[str, Cluster] = "h100-nvlink-ib400-bf16",
    shard_sizes: Optional[Sequence[int]] = None,
    param_dtypes: Sequence[str] = ("fp32", "bf16"),
    bucket_sizes: Sequence[Optional[int]] = (None, 2**30),
    offload: Sequence[bool] = (False, True),
    int8_all_gather: Sequence[bool] = (False,),
    candidates: Sequence[Candidate] = (),
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
      ``set_bucket_bytes`` budgets in ``bucket_sizes`` (None: the default, 2 MiB);
    * ``CPUOffloadPolicy`` or not (``offload``; offloaded groups are never bucketed, so once per
      other setting);
    * int8 all-gathers (``fully_shard.quant.Int8AllGather``) if ``int8_all_gather`` holds True
      (off by default: they change the numerics, see docs/extensions.md);
    * and your own ``candidates`` (`Candidate`: tensor parallel layouts, anything a shard_fn does).

    Returns the options that fit ``bytes_per_rank`` (device memory) first, fastest first, then the
    rest, smallest first. Each option is one simulation (the defaults make 5 per layout and dtype,
    7 for FSDP beyond a node: 44 for 512 ranks of 8-GPU nodes, about 90 s for a 1B model on a
    2-core CPU); narrow an axis to go faster."""
    search = _Search(build_model, sample_inputs, _preset(cluster), bytes_per_rank, optimizer, steps)
    grid = _Grid(world_size, shard_sizes, param_dtypes, bucket_sizes, offload, int8_all_gather)
    _check_candidates(candidates, world_size)
    options = [search.run(setting) for setting in grid.settings(search.cluster.gpus_per_node)]
    return _ranked(options + [search.run_candidate(c) for c in candidates])


def _preset(cluster: Union[str, Cluster]) -> Cluster:
    if isinstance(cluster, str):
        if cluster not in PRESETS:
            raise ValueError(
                f"unknown cluster preset {cluster!r}; presets: {sorted(PRESETS)}, or pass a timing.Cluster."
            )
        return PRESETS[cluster]
    return cluster


def _check_candidates(candidates: Sequence[Candidate], world_size: int) -> None:
    for c in candidates:
        if not c.label or math.prod(c.mesh_shape) != world_size or c.param_dtype not in ("fp32", "bf16"):
            raise ValueError(
                f"recommend: candidate {c.label!r} has mesh {tuple(c.mesh_shape)} for "
                f"world_size={world_size} and param_dtype {c.param_dtype!r}. Fix: a label, a mesh of "
                "world_size ranks, 'fp32' or 'bf16'."
            )


class _Setting(NamedTuple):
    """One combination of `_Grid`'s axes."""

    mesh_shape: tuple[int, ...]
    reshard_after_forward: Union[bool, int]
    param_dtype: str
    bucket_bytes: Optional[int]
    offload: bool
    int8_all_gather: bool


@dataclass(frozen=True)
class _Grid:
    """The axes of `recommend`'s settings (its arguments of the same names), checked."""

    world_size: int
    shard_sizes: Optional[Sequence[int]]
    param_dtypes: Sequence[str]
    bucket_sizes: Sequence[Optional[int]]
    offload: Sequence[bool]
    int8_all_gather: Sequence[bool]

    def __post_init__(self) -> None:
        unknown = [d for d in self.param_dtypes if d not in ("fp32", "bf16")]
        if unknown or not self.param_dtypes:
            raise ValueError(
                f"recommend(param_dtypes={tuple(self.param_dtypes)!r}): choose from 'fp32' and 'bf16'."
            )
        if not self.bucket_sizes or not self.offload or not self.int8_all_gather:
            raise ValueError(
                "recommend: bucket_sizes, offload and int8_all_gather each need at least one value (e.g. "
                "(None,), (False,) and (False,))."
            )

    def layouts(self, node: int) -> list[tuple[int, ...]]:
        """FSDP over the world, then HSDP for each shard size that divides it (default: one node,
        2 and 4 nodes of ``node`` ranks)."""
        world = self.world_size
        sizes = self.shard_sizes if self.shard_sizes is not None else [node * k for k in (1, 2, 4)]
        return [(world,)] + [(world // s, s) for s in sizes if 1 < s < world and world % s == 0]

    def settings(self, node: int) -> Iterator[_Setting]:
        """Every combination, in the order `recommend` simulates them; buckets only where the
        schedule follows them (resharding after forward, not offloaded)."""
        for mesh in self.layouts(node):
            shard = mesh[-1]
            reshards: list[Union[bool, int]] = [True, False] + (
                [node] if len(mesh) == 1 and shard > node and shard % node == 0 else []
            )
            for reshard, dtype in itertools.product(reshards, self.param_dtypes):
                for off, int8 in itertools.product(
                    dict.fromkeys(self.offload), dict.fromkeys(self.int8_all_gather)
                ):
                    buckets = (
                        list(dict.fromkeys(self.bucket_sizes)) if reshard is True and not off else [None]
                    )
                    for bucket in buckets:
                        yield _Setting(mesh, reshard, dtype, bucket, off, int8)


@dataclass(frozen=True)
class _Search:
    """What every simulation of one `recommend` call shares, and each one simulated as an `Option`."""

    build_model: Callable[[], nn.Module]
    sample_inputs: Any
    cluster: Cluster
    bytes_per_rank: int
    optimizer: Union[str, Callable, None]
    steps: int

    def run(self, s: _Setting) -> Option:
        """One of the usual settings, with ``default_shard_fn``."""
        from ..layouts.policy import CPUOffloadPolicy, MixedPrecisionPolicy

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_fn = functools.partial(
            _shard,
            mp_policy=bf16 if s.param_dtype == "bf16" else None,
            reshard_after_forward=s.reshard_after_forward,
            offload_policy=CPUOffloadPolicy() if s.offload else None,
            bucket_bytes=s.bucket_bytes,
            int8=s.int8_all_gather,
        )
        plan = simulate(
            self.build_model,
            self.sample_inputs,
            mesh_shape=s.mesh_shape,
            shard_fn=shard_fn,
            optimizer=self.optimizer,
            steps=self.steps,
        )
        time, fits = self._priced(plan, s.param_dtype), plan.fits(self.bytes_per_rank)
        return Option(
            s.mesh_shape,
            s.reshard_after_forward,
            s.param_dtype,
            plan,
            time,
            fits,
            bucket_bytes=s.bucket_bytes,
            offload=s.offload,
            int8_all_gather=s.int8_all_gather,
        )

    def run_candidate(self, c: Candidate) -> Option:
        """Your own setting, with its ``shard_fn``."""
        plan = simulate(
            self.build_model,
            self.sample_inputs,
            mesh_shape=c.mesh_shape,
            mesh_dim_names=c.mesh_dim_names,
            shard_fn=c.shard_fn,
            optimizer=self.optimizer,
            steps=self.steps,
        )
        time, fits = self._priced(plan, c.param_dtype), plan.fits(self.bytes_per_rank)
        return Option(tuple(c.mesh_shape), None, c.param_dtype, plan, time, fits, label=c.label)

    def _priced(self, plan: Plan, dtype: str) -> StepTime:
        """The step time at the cluster's rate for ``dtype`` (fp32 at 1/8 of bf16's)."""
        rate = self.cluster.flops if dtype == "bf16" else self.cluster.flops / 8
        return plan.estimate(dataclasses.replace(self.cluster, flops=rate))


def _ranked(options: list[Option]) -> list[Option]:
    """The options that fit first, fastest first; then the rest, smallest first."""
    fitting = sorted((o for o in options if o.fits), key=lambda o: o.time.step_s)
    rest = sorted((o for o in options if not o.fits), key=lambda o: o.plan.peak_bytes)
    return fitting + rest


def _shard(model: nn.Module, mesh: Any, *, int8: bool, **settings: Any) -> None:
    default_shard_fn(model, mesh, **settings)
    if int8:
        from ..quant import Int8AllGather

        model.set_all_gather_codec(Int8AllGather())  # type: ignore[operator]
