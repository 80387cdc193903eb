"""Which `FSDPParam` manages a tensor.

Every original parameter a ``fully_shard`` call replaced (keyed weakly by identity) and every
sharded DTensor parameter (keyed by id, the FSDPParam held weakly: a weak reference on the
parameter itself would stop ``to_empty`` from swapping it). Why a registry: after
``fully_shard(embed)``, a module tied to ``embed.weight`` (``lm_head``) still holds the original
tensor, and nothing reachable from ``lm_head`` says it was sharded; sharding it again would
silently untie the weights. A later call that meets such a tensor borrows the owner's parameter
instead. Everything is weak, so this holds no per-rank state (ranks running as threads never share
a tensor) and forgets a parameter when it dies.

It also knows every place (``module.<name>``) a managed parameter is registered at, so assigning a
new parameter there (attribute assignment, ``load_state_dict(..., assign=True)``, DCP's
``set_model_state_dict``) is noticed where it happens: one global parameter-registration hook of
``nn.Module`` tells the owner (`Managed.note_assigned`), which takes the new one over at its next
unshard. Nothing asks every parameter at every unshard.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook
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

    def note_assigned(self) -> None: ...


_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SHARDED: "weakref.WeakValueDictionary[int, Managed]" = weakref.WeakValueDictionary()
# module -> {parameter name: its owner, weakly (the owner holds the module)}.
_PLACES: "weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref]]" = weakref.WeakKeyDictionary()
_hook: list[Any] = []  # the registration hook's handle, once installed


def register_places(managed: Managed, places: list[Any]) -> None:
    """``managed`` is registered at ``places`` (each with ``module`` and ``name``): tell it when
    something else is registered there."""
    if not _hook:
        _hook.append(register_module_parameter_registration_hook(_on_register))
    for place in places:
        _PLACES.setdefault(place.module, {})[place.name] = weakref.ref(managed)


def _on_register(module: nn.Module, name: str, param: Any) -> None:
    owners = _PLACES.get(module)
    ref = owners.get(name) if owners is not None else None
    managed = ref() if ref is not None else None
    if managed is not None:
        managed.note_assigned()


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
