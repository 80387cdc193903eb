"""Which `FSDPParam` manages a tensor.

Every original parameter a ``fully_shard`` call replaced (keyed weakly by identity) and every
sharded DTensor parameter (keyed by id, the FSDPParam held weakly: a weak reference on the
parameter itself would stop ``to_empty`` from swapping it). Why a registry: after
``fully_shard(embed)``, a module tied to ``embed.weight`` (``lm_head``) still holds the original
tensor, and nothing reachable from ``lm_head`` says it was sharded; sharding it again would
silently untie the weights. A later call that meets such a tensor borrows the owner's parameter
instead. Everything is weak, so this holds no per-rank state (ranks running as threads never share
a tensor) and forgets a parameter when it dies.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary


class Managed(Protocol):
    """What the registry holds (an `FSDPParam`; named by what its users read, so this module
    needs no import of it)."""

    sharded_param: nn.Parameter
    places: list[Any]
    group: Any

    @property
    def path(self) -> str: ...

    def add_places(self, places: list[Any]) -> None: ...


_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SHARDED: "weakref.WeakValueDictionary[int, Managed]" = weakref.WeakValueDictionary()


def register_original(original: nn.Parameter, managed: Managed) -> None:
    _ORIGINALS[original] = weakref.ref(managed)


def register_sharded(managed: Managed) -> None:
    """Record ``managed.sharded_param`` (call again whenever it is replaced)."""
    _SHARDED[id(managed.sharded_param)] = managed


def manager_of(param: nn.Parameter) -> Optional[Managed]:
    managed = _SHARDED.get(id(param))
    if managed is not None and managed.sharded_param is param:
        return managed
    ref = _ORIGINALS.get(param)
    return ref() if ref is not None else None


def class_name(module: object) -> str:
    """The class name the user wrote for ``module`` (not the ``FSDP``-prefixed class ``fully_shard``
    made for it), for error messages."""
    cls = type(module)
    return getattr(cls, "_fsdp_original_class", cls).__name__
