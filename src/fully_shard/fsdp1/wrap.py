"""FSDP1's auto-wrap policies (PyTorch's ``fsdp.wrap`` module), with their semantics: which
submodules become their own `FullyShardedDataParallel` (one `fully_shard` group each), bottom up.

* policy objects (`ModuleWrapPolicy`, `CustomPolicy`) choose target modules with their keyword
  arguments (`_Policy._run_policy`);
* callables ``policy(module, recurse, nonwrapped_numel) -> bool`` (``size_based_auto_wrap_policy``
  and friends, usually through ``functools.partial``) run FSDP1's recursive walk: a module is
  descended into while ``recurse=True`` says so, and wrapped if ``recurse=False`` says so for the
  parameters its wrapped descendants left;
* ``enable_wrap`` / ``wrap`` wrap explicitly annotated modules at construction time.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch.nn as nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


class _Policy(ABC):
    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """Map each module to wrap to the keyword arguments of its wrapper."""


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = set(module_classes)

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        classes = tuple(self._module_classes)
        return {
            m: copy.copy(root_kwargs)
            for m in root_module.modules()
            if m not in ignored_modules and isinstance(m, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._module_classes})"


class CustomPolicy(_Policy):
    """``lambda_fn(module)`` returns ``False`` (or ``{}``): not wrapped; ``True``: wrapped with the
    root's arguments; a dict: wrapped with the root's arguments updated by it."""

    def __init__(self, lambda_fn: Callable[[nn.Module], Any]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        out: dict[nn.Module, dict[str, Any]] = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            res = self._lambda_fn(module)
            if not isinstance(res, (dict, bool)):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, but it "
                    f"returned {res}"
                )
            if res:
                kwargs = copy.copy(root_kwargs)
                if isinstance(res, dict):
                    kwargs.update(res)
                out[module] = kwargs
        return out


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    return True


def _module_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes: set[type[nn.Module]]
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable
) -> bool:
    if recurse:
        return True
    return lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: set[type[nn.Module]]
) -> bool:
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Sequence[type], recurse: bool, *args: Any, **kwargs: Any
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable]) -> bool:
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies
    )


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[set[type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[set[type[nn.Module]]] = None,
) -> bool:
    force_leaf = (
        size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    )  # type: ignore[attr-defined]
    exclude = (
        size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
        if exclude_wrap_modules is None
        else exclude_wrap_modules
    )  # type: ignore[attr-defined]
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf))
    return is_large and not isinstance(module, tuple(exclude))


_EXCLUDED = {nn.ModuleList, nn.ModuleDict}
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = _EXCLUDED  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def targets_of(
    policy: Any,
    root: nn.Module,
    ignored_modules: set[nn.Module],
    ignored_params: set[int],
    root_kwargs: dict[str, Any],
) -> dict[nn.Module, dict[str, Any]]:
    """The modules under ``root`` (``root`` excluded) that ``policy`` wraps, with their kwargs."""
    if isinstance(policy, _Policy) or (
        type(policy).__name__ in ("ModuleWrapPolicy", "CustomPolicy") and hasattr(policy, "_run_policy")
    ):  # ours, or PyTorch's objects
        chosen = policy._run_policy(root, ignored_modules, root_kwargs)
        chosen.pop(root, None)
        return chosen
    if not callable(policy):
        raise TypeError(
            "FullyShardedDataParallel(auto_wrap_policy=...) expects a policy object (ModuleWrapPolicy, "
            f"CustomPolicy) or a callable (module, recurse, nonwrapped_numel) -> bool, got {policy!r}."
        )
    chosen: dict[nn.Module, dict[str, Any]] = {}
    _recursive(root, policy, ignored_modules, ignored_params, chosen, root_kwargs, only_children=True)
    return chosen


def _recursive(
    module: nn.Module,
    policy: Callable,
    ignored_modules: set[nn.Module],
    ignored_params: set[int],
    chosen: dict[nn.Module, dict[str, Any]],
    kwargs: dict[str, Any],
    only_children: bool = False,
) -> int:
    """FSDP1's ``_recursive_wrap`` as a walk that records targets: returns the parameter count
    wrapped at or below ``module``."""
    nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return 0
    wrapped = 0
    for child in module.children():
        if child not in ignored_modules:
            wrapped += _recursive(child, policy, ignored_modules, ignored_params, chosen, kwargs)
    if not only_children and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped):
        chosen[module] = copy.copy(kwargs)
        return nonwrapped
    return wrapped


class _WrapContext:
    active = False
    wrapper_cls: Any = None
    kwargs: dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, `wrap(module, **overrides)` returns ``wrapper_cls(module, **kwargs)``."""
    if _WrapContext.active:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not supported nested autowrap."
        )
    _WrapContext.active, _WrapContext.wrapper_cls, _WrapContext.kwargs = True, wrapper_cls, wrapper_kwargs
    try:
        yield
    finally:
        _WrapContext.active, _WrapContext.wrapper_cls, _WrapContext.kwargs = False, None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` when inside `enable_wrap`; otherwise return it unchanged (FSDP1's rule)."""
    if not _WrapContext.active:
        return module
    kwargs = {**_WrapContext.kwargs, **wrap_overrides}
    overrides = getattr(module, "_wrap_overrides", None)
    if overrides:
        kwargs.update(overrides)
    return _WrapContext.wrapper_cls(module, **kwargs)
