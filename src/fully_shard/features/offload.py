"""Per-parameter offload: which parameters of one ``fully_shard`` call keep their shards (and
gradients and optimizer state) on the host. Every choice is made and checked before ``fully_shard``
changes anything."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Mapping, Optional

import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ..layouts.policy import CPUOffloadPolicy, OffloadPolicy, as_offload_policy

Chooser = Callable[[nn.Parameter, str], Optional[CPUOffloadPolicy]]


def offload_chooser(value: Any) -> Chooser:
    """Turn ``fully_shard``'s ``offload_policy`` into ``(param, name) -> CPUOffloadPolicy | None``.

    ``value`` is one policy; a mapping from ``fnmatch`` patterns over parameter names (relative to the
    module passed) to policies, where the first match decides and no match means the device; or a
    callable ``param -> policy | None`` (e.g. `offload_by_budget`'s plan).
    """
    if isinstance(value, Mapping):
        rules = []
        for pattern, policy in value.items():
            if not isinstance(pattern, str):
                raise TypeError(
                    f"offload_policy mapping keys must be parameter-name patterns (str), got {pattern!r}."
                )
            rules.append((pattern, _on_host(policy)))

        def by_name(param: nn.Parameter, name: str) -> Optional[CPUOffloadPolicy]:
            for pattern, policy in rules:
                if fnmatch.fnmatchcase(name, pattern):
                    return policy
            return None

        return by_name
    if callable(value) and not isinstance(value, OffloadPolicy):
        return lambda param, name: _on_host(value(param))
    fixed = _on_host(value)
    return lambda param, name: fixed


def _on_host(policy: object) -> Optional[CPUOffloadPolicy]:
    """The host policy ``policy`` (any form `as_offload_policy` takes) asks for, or ``None`` (device)."""
    policy = as_offload_policy(policy)
    return policy if isinstance(policy, CPUOffloadPolicy) else None


class OffloadPlan:
    """`offload_by_budget`'s choice: callable as ``offload_policy`` for every ``fully_shard`` call."""

    def __init__(self, chosen: dict[str, nn.Parameter], policy: CPUOffloadPolicy, nbytes: int) -> None:
        self.names = list(chosen)  # the parameters offloaded, largest first
        self.nbytes = nbytes  # their bytes in total
        self.policy = policy
        self._params: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for p in chosen.values():
            self._params[p] = True

    def __call__(self, param: nn.Parameter) -> Optional[CPUOffloadPolicy]:
        return self.policy if param in self._params else None

    def __repr__(self) -> str:
        return (
            f"OffloadPlan({len(self.names)} parameters, {self.nbytes / 2**20:.1f} MiB: {self.names[:4]}...)"
        )


def offload_by_budget(
    model: nn.Module, budget_bytes: int, policy: Optional[CPUOffloadPolicy] = None
) -> OffloadPlan:
    """Offload the largest parameters of ``model`` whose unsharded bytes fit in ``budget_bytes``.

    Pass the result as ``offload_policy`` to every ``fully_shard`` call on the model, before any of
    them runs (it recognises the parameters). Raises ``ValueError`` on a negative or non-int budget.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"offload_by_budget expects a byte budget >= 0, got {budget_bytes!r}.")
    policy = policy if policy is not None else CPUOffloadPolicy()
    chosen: dict[str, nn.Parameter] = {}
    total = 0
    for name, p in sorted(model.named_parameters(), key=lambda item: _nbytes(item[1]), reverse=True):
        if total + _nbytes(p) <= budget_bytes:
            chosen[name] = p
            total += _nbytes(p)
    return OffloadPlan(chosen, policy, total)


def _nbytes(p: nn.Parameter) -> int:
    return p.numel() * p.element_size()
