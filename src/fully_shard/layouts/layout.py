"""`ShardLayout`: where one parameter's elements go when sharded. Pure arithmetic, no tensors.

Dim ``dim`` of size ``n`` is split with ``torch.chunk`` semantics (``Shard(dim)``): ``rows =
ceil(n / world)`` rows per rank, rank ``r`` holding ``[r * rows, (r + 1) * rows)`` clipped to ``n``
(ranks past the end hold empty shards). Collectives move dim 0: the sharded dim goes in front
(``moved_shape``) and each chunk is padded to ``rows`` rows, so every rank sends the same count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


FLAT = -1  # a shard dim: the parameter flattened, one contiguous range per rank (`FlatShard`)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def rows_per_rank(n: int, world: int) -> int:
    return -(-n // world)


def local_rows(n: int, world: int, rank: int) -> int:
    """Rows of a dim of size ``n`` that rank ``rank`` holds under ``torch.chunk`` semantics."""
    rows = rows_per_rank(n, world)
    return max(0, min(rows, n - rank * rows))


@dataclass(frozen=True)
class ShardLayout:
    shape: torch.Size  # what is sharded (the TP-local shape under tensor parallelism)
    dim: int
    world: int
    rank: int
    rows: int = field(init=False)  # padded rows of the sharded dim per rank
    local_rows: int = field(init=False)  # rows this rank really holds (0 past the end)
    start: int = field(init=False)  # first row of this rank's chunk (clipped to the dim's size)
    moved_shape: torch.Size = field(init=False)  # ``shape`` with the sharded dim in front
    shard_numel: int = field(init=False)  # elements per rank in a collective (padding included)

    def __post_init__(self) -> None:
        n = self.shape[self.dim]
        rows = rows_per_rank(n, self.world)
        moved = torch.Size([n, *self.shape[: self.dim], *self.shape[self.dim + 1 :]])
        values = {
            "rows": rows,
            "local_rows": local_rows(n, self.world, self.rank),
            "start": min(self.rank * rows, n),
            "moved_shape": moved,
            "shard_numel": rows * math.prod(moved[1:]),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's (unpadded) shard."""
        shape = list(self.shape)
        shape[self.dim] = self.local_rows
        return torch.Size(shape)

    @property
    def padded_shape(self) -> torch.Size:
        """This rank's shard padded to ``rows`` rows (dim 0 only)."""
        return torch.Size([self.rows, *self.shape[1:]])

    @property
    def full_chunks(self) -> int:
        """Ranks whose chunk is complete (``rows`` real rows); the next one, if any, is partial."""
        return self.moved_shape[0] // self.rows if self.rows else 0
