"""Pipeline parallelism with ``torch.distributed.pipelining`` over modules sharded by fully_shard.

torch's pipeline stages drive data parallelism only for the modules they recognise (DDP and
PyTorch's own ``fully_shard``, by class). Give them ours through `PipelineStage`, a drop-in
subclass of ``torch.distributed.pipelining.PipelineStage``::

    from fully_shard.pipelining import PipelineStage  # instead of torch's: same arguments

    for block in stage_module.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_group)
    schedule = ScheduleInterleaved1F1B([stage, ...], n_microbatches=8, loss_fn=loss_fn)

Every micro-batch's backward (also the separate input- and weight-gradient passes of the
zero-bubble schedules) runs without gradient sync and keeps the parameters unsharded, so with
``reshard_after_forward=False`` a stage gathers its parameters once per step; after the last
micro-batch's backward (or weight pass) the stage reduces what accumulated, once per step,
waits and reshards (`FSDPModule.reduce_grads`). A module not sharded by fully_shard is left to
torch's own handling. Importing this module imports ``torch.distributed.pipelining`` (which
imports PyTorch's FSDP for its own checks); ``import fully_shard`` does not.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .api.module import FSDPModule

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` that drives a fully_shard module's gradient
    sync the way the schedules expect: accumulate over the micro-batches, reduce once at the end."""

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[Any, Any]:
        module = self.submod
        if not isinstance(module, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # Accumulate on the unsharded parameters, which stay registered for the weight pass of a
        # split backward (it finds each parameter's gradient accumulator in the graph). Set once
        # per step: the setters walk the whole tree.
        if not self.__dict__.get("_fsdp_accumulating"):
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
            module.set_is_last_backward(False)
            self._fsdp_accumulating = True
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # The last gradient of the step is in (schedules without a REDUCE_GRAD action only say
        # so here): reduce now. The input-gradient pass of a split backward is never the last.
        if last_backward and backward_type != "input":
            self._reduce(module)
        return result

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The schedule's REDUCE_GRAD action: reduce what is left (nothing when the last backward
        already did), then torch scales the reduced gradients."""
        if isinstance(self.submod, FSDPModule):
            self._reduce(self.submod)
        super().perform_reduce_grad(grad_scale_factor)

    def _reduce(self, module: FSDPModule) -> None:
        self._fsdp_accumulating = False
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        module.set_is_last_backward(True)
        module.reduce_grads()
