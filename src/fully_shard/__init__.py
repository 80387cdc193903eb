"""fully_shard: FSDP2-style sharding of parameters, gradients and optimizer state."""

from .api import FSDPModule, UnshardHandle, fully_shard
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
]
