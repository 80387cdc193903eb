"""``copy.deepcopy`` of a sharded model: an independent sharded model on the same mesh. Fields that
describe an iteration in flight start fresh; meshes and process groups are shared, so the copy
talks to the same ranks. It finds its own root at its first forward.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

T = TypeVar("T")


def copy_fields(obj: T, memo: dict[int, Any], **fresh: Any) -> T:
    """A new ``type(obj)`` with deep copies of ``obj``'s fields, except those given in ``fresh``."""
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    for name, value in obj.__dict__.items():
        new.__dict__[name] = fresh[name] if name in fresh else copy.deepcopy(value, memo)
    return new


def refuse_busy(what: str, why: str) -> None:
    raise RuntimeError(
        f"copy.deepcopy of a sharded model: {what} {why}, so its state is mid-iteration. Fix: deepcopy "
        "between steps (after backward, or after a forward under torch.no_grad()), or call reshard() on the "
        "model first."
    )
