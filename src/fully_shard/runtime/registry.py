"""Which `FSDPParam` manages a tensor, and at which places (``module.<name>``) it is registered.

After ``fully_shard(embed)`` a tied ``lm_head`` still holds the original tensor; a later call that
meets it borrows the owner's parameter instead of sharding it again (which would untie them). A
global parameter-registration hook hands what is assigned at one of its places to the owner
(`Managed.note_assigned`), which registers its sharded form instead. Everything is weak: no
per-rank state, nothing kept alive (a weak reference on the sharded parameter itself would stop
``to_empty`` from swapping it).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.weak import WeakIdKeyDictionary


class Managed(Protocol):
    """What the registry holds: an `FSDPParam`, by what its users read (so no import of it)."""

    sharded_param: nn.Parameter
    unsharded_param: Optional[nn.Parameter]
    places: list[Any]
    group: Any

    @property
    def path(self) -> str: ...

    def add_places(self, places: list[Any]) -> None: ...

    def note_assigned(self, module: nn.Module, name: str, new: object) -> Optional[nn.Parameter]: ...


_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SHARDED: "weakref.WeakValueDictionary[int, Managed]" = weakref.WeakValueDictionary()
_UNSHARDED: "weakref.WeakValueDictionary[int, Managed]" = weakref.WeakValueDictionary()
_BY_ID: "weakref.WeakValueDictionary[int, Managed]" = weakref.WeakValueDictionary()
# module -> {parameter name: its owner, weakly (the owner holds the module)}.
_PLACES: "weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref]]" = weakref.WeakKeyDictionary()
_hook: list[Any] = []  # the registration hook's handle, once installed

# What compiled code reads by key (`key_of`): a trace reaching one object by two paths (a group
# through its state and through each of its parameters' entries, runtime/traced.py) makes dynamo
# guard that the two are the same object, in one Python function built and run for every such
# pair; so a traced parameter's entry names its group by a key, read from here: one path. A plain
# dict of weak references (dynamo reads no WeakValueDictionary, and guards only on the keys a trace
# reads), changed only by `key_of`, eagerly: dynamo iterates the dict when it wraps it, and a weak
# reference's callback could run then (a garbage collection).
BY_KEY: dict[int, "weakref.ref[Any]"] = {}
_prune_at = [64]  # `key_of` drops dead references when the dict grows past this


def register_places(managed: Managed, places: list[Any]) -> None:
    """Tell ``managed`` when something else is registered at one of ``places`` (module, name)."""
    if not _hook:
        _hook.append(register_module_parameter_registration_hook(_on_register))
    for place in places:
        _PLACES.setdefault(place.module, {})[place.name] = weakref.ref(managed)


def _on_register(module: nn.Module, name: str, param: Any) -> Optional[nn.Parameter]:
    """What ``module.<name>`` registers instead of ``param`` (None: ``param`` itself)."""
    ref = _PLACES.get(module, {}).get(name)
    managed = ref() if ref is not None else None
    return managed.note_assigned(module, name, param) if managed is not None else None


def register_original(original: nn.Parameter, managed: Managed) -> None:
    _ORIGINALS[original] = weakref.ref(managed)


def register_sharded(managed: Managed) -> None:
    """Record ``managed.sharded_param`` (call again whenever it is replaced), and ``managed`` by
    its ``id`` (`managed_by_id`: what compiled graphs look their groups up by)."""
    _SHARDED[id(managed.sharded_param)] = managed
    _BY_ID[id(managed)] = managed


def key_of(obj: Any) -> int:
    """``obj``'s key in `BY_KEY` (its id), recorded there."""
    key = id(obj)
    ref = BY_KEY.get(key)
    if ref is None or ref() is not obj:
        BY_KEY[key] = weakref.ref(obj)
        if len(BY_KEY) > _prune_at[0]:
            for dead in [k for k, r in BY_KEY.items() if r() is None]:
                del BY_KEY[dead]
            _prune_at[0] = 2 * len(BY_KEY) + 64
    return key


def managed_by_id(key: int) -> Optional[Managed]:
    return _BY_ID.get(key)


def register_unsharded(managed: Managed, unsharded: nn.Parameter) -> None:
    """Record ``managed``'s unsharded parameter (made once, reused every step)."""
    _UNSHARDED[id(unsharded)] = managed


def unsharded_owner(param: nn.Parameter) -> Optional[Managed]:
    """Whose unsharded parameter ``param`` is (None: nobody's)."""
    managed = _UNSHARDED.get(id(param))
    return managed if managed is not None and managed.unsharded_param is param else None


def manager_of(param: nn.Parameter) -> Optional[Managed]:
    managed = _SHARDED.get(id(param))
    if managed is not None and managed.sharded_param is param:
        return managed
    ref = _ORIGINALS.get(param)
    return ref() if ref is not None else None


def class_name(module: object) -> str:
    """The user's class name for ``module`` (not the ``FSDP``-prefixed one), for error messages."""
    cls = type(module)
    return getattr(cls, "_fsdp_original_class", cls).__name__
