"""`Settings`: what the user set on one ``fully_shard`` call, one frozen value shared by the call's
`FSDPState` and its groups; ``FSDPModule.set_*`` replaces it whole (`FSDPState.update_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .comm import DEFAULT_IN_FLIGHT

# 2 MiB: the knee of the measured curve (docs/benchmarks.md): deep-narrow 192 -> 6 collectives, and
# llama-sized blocks (about 2 MiB each in their collectives) stay alone, at PyTorch's peak.
DEFAULT_BUCKET_BYTES = 2 << 20


@dataclass(frozen=True)
class Settings:
    # -- the module's schedule --
    reshard_after_forward: Union[bool, int, None] = None  # None: True, except for the root
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    unshard_in_backward: bool = True
    forward_prefetch: Optional[tuple[Any, ...]] = None  # FSDPStates
    backward_prefetch: Optional[tuple[Any, ...]] = None  # None: implicit (reverse forward order)
    # -- read from the root's settings --
    is_last_backward: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    collectives_in_flight: int = DEFAULT_IN_FLIGHT  # CPU: issued, not yet completed (comm.py)
    grad_finite_check: str = "env"  # "env" (FULLY_SHARD_CHECK_FINITE), "off", "raise" or "report"
    # -- the reduction --
    gradient_divide_factor: Optional[float] = None  # None: the data-parallel size (an average)
    requires_all_reduce: bool = True  # HSDP: False defers the all-reduce across replicas
    force_sum_reduction: bool = False  # SUM collectives only, dividing ourselves
    # True: every trainable parameter takes part in each reduction (zeros where this rank has no
    # gradient), with used-counts; False: only this rank's gradients (PyTorch's layout).
    reduce_unused: bool = True
    reduce_dtype: Optional[torch.dtype] = None  # overrides the policy's (FSDP1's compress hooks)
    keep_low_precision_grads: bool = False  # FSDP1's: .grad in param_dtype after the last backward
    # FSDP2's: gradients accumulated without sync are summed in the reduce dtype where it differs from
    # the param dtype; False (FSDP1's): in the param dtype until the reduction (runtime/param.py)
    accumulate_in_reduce_dtype: bool = True
    # the reduce-scatter on its own process group (`FSDPParamGroup.separate_rs`)
    separate_reduce_scatter: bool = False
    # reduce-scatter inputs a root keeps in flight (the largest of its modules' settings): the
    # next module's reduce-scatter does not wait for the oldest until this many are pending
    reduce_scatter_max_input_buffers: int = 1
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
    all_reduce_hook_stream: Optional[torch.Stream] = None
    # -- communication --
    custom_all_gather: Any = None  # PyTorch's AllGather interface
    custom_reduce_scatter: Any = None  # PyTorch's ReduceScatter interface
    codecs: tuple[tuple[str, Any], ...] = ()  # (parameter fqn in the call, all-gather codec)

    def codec_for(self, fqn: str) -> Any:
        """The all-gather codec for the parameter ``fqn`` (None: the plain all-gather)."""
        for name, codec in self.codecs:  # (a loop, not next() of a generator: dynamo traces it)
            if name == fqn:
                return codec
        return None

    def reduction_key(self) -> tuple[object, ...]:
        """Groups of one mesh with equal keys may share a reduce-scatter."""
        return (
            self.gradient_divide_factor,
            self.force_sum_reduction,
            self.requires_all_reduce,
            self.reduce_unused,
            self.separate_reduce_scatter,
        )

    def communicates_plainly(self) -> bool:
        """No custom collective and no all-reduce hook: a group may share collectives (bucket.py)."""
        return (
            self.all_reduce_hook is None
            and self.custom_all_gather is None
            and self.custom_reduce_scatter is None
        )
