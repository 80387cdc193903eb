"""`FlatShard` parameters in state dicts: shown in their own shape, sharded on dim 0.

A flat-sharded parameter is a 1-D DTensor of ``numel`` elements between steps. Its state dict
entry is what the default layout would hold (the parameter's shape, ``Shard(0)``), so checkpoints,
``torch.distributed.checkpoint`` and full state dicts interchange with the default layout and
across world sizes. Each conversion gathers the whole parameter once (only at save and load).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import ShardLayout, contiguous_stride
from .mesh import MeshInfo


def _dtensor(local: torch.Tensor, info: MeshInfo, shape: torch.Size) -> DTensor:
    return DTensor.from_local(
        local, info.mesh, info.placements(0), run_check=False, shape=shape, stride=contiguous_stride(shape)
    )


def to_rows(flat: DTensor, shape: torch.Size, info: MeshInfo) -> DTensor:
    """A flat shard as the default layout's: ``shape``, this rank's dim-0 chunk (on the shard's
    device)."""
    full = _full(flat, info).view(shape)
    layout = ShardLayout(shape, 0, info.world_size, info.rank)
    return _dtensor(full.narrow(0, layout.start, layout.local_rows).to(flat.device, copy=True), info, shape)


def to_flat(value: torch.Tensor, fp: Any) -> DTensor:
    """A state dict's entry in the parameter's own shape (a DTensor in any layout, or the full
    tensor; also the full flat tensor) as ``fp``'s flat shard (`FSDPParam.local_chunk`: this
    rank's range), on the entry's device."""
    full = _full(value, fp.info) if isinstance(value, DTensor) else value
    return _dtensor(fp.local_chunk(full).to(value.device, copy=True), fp.info, fp.layout.shape)


def _full(t: DTensor, info: MeshInfo) -> torch.Tensor:
    """The whole tensor, gathered on the mesh's device (an offloaded shard is on the host, and an
    accelerator's communicator takes only its own device's tensors)."""
    return (t.to(info.device) if t.device != info.device else t).full_tensor()


# Wrappers whose own state-dict hooks rename keys (torch's checkpoint_wrapper); compared without.
_RENAMED = ("_checkpoint_wrapped_module.",)


def _plain(key: str) -> str:
    for segment in _RENAMED:
        key = key.replace(segment, "")
    return key


def convert_entries(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    flat_of: Callable[[nn.Parameter], Optional[Any]],
    saving: bool,
) -> None:
    """Every flat-sharded parameter under ``module`` whose entry is in the other form: to the
    default layout when ``saving`` (after ``state_dict``), to the flat shard before loading.
    ``flat_of(param)``: its `FSDPParam` when flat-sharded (of more than one dim), else None.
    Entries are found by name, wrapper segments aside (`_RENAMED`); each converted by
    `convert_value`."""
    flats = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        fp = flat_of(param)
        if fp is not None:
            flats[_plain(prefix + name)] = fp
    if not flats:
        return
    for key, value in list(state_dict.items()):
        fp = flats.get(_plain(key))
        if fp is not None:
            state_dict[key] = convert_value(value, fp, saving, key)


def _rows_in_flat_spec(value: DTensor, fp: Any, key: str) -> DTensor:
    """torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` into a model on the meta
    device slices rank 0's full tensor by the live parameter's placements and wraps the slice in
    the parameter's global shape: a DTensor of shape ``(numel,)`` holding this rank's *rows* of
    the parameter's own shape, which are the default layout's shard; shown as that."""
    local = value.to_local()
    layout = ShardLayout(fp.shape, 0, fp.info.world_size, fp.info.rank)
    if tuple(local.shape) != (layout.local_rows, *fp.shape[1:]):
        raise RuntimeError(
            f"load_state_dict: '{key}' is a DTensor of shape {tuple(value.shape)} holding a local tensor "
            f"of shape {tuple(local.shape)}: neither this flat-sharded parameter's shard (of "
            f"{tuple(fp.layout.shape)}) nor its rows ({layout.local_rows}, ...) of {tuple(fp.shape)}; "
            "nothing was loaded. Fix: load a state dict made by state_dict() / get_model_state_dict, or full "
            "tensors of each parameter's shape."
        )
    return _dtensor(local, fp.info, fp.shape)


def convert_optimizer_state(
    optimizer: Any, state_dict: dict, flat_of: Callable[[Any], Optional[Any]], saving: bool
) -> dict:
    """An optimizer state dict (``Optimizer.state_dict()``'s form: state keyed by index, the
    indices in ``param_groups`` in the order of ``optimizer.param_groups``) whose per-parameter
    tensors of flat-sharded parameters are in the other form: the default layout's when
    ``saving``, the flat shard before loading. A new dict: the optimizer's own state is untouched
    (``state_dict()`` hands out the optimizer's per-parameter dicts themselves)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in state_dict.get("param_groups", ()) for i in group["params"]]
    state = dict(state_dict.get("state", {}))
    for index, param in zip(indices, params):  # (torch refuses mismatched lengths after the hooks)
        fp, entry = flat_of(param), state.get(index)
        if fp is not None and isinstance(entry, dict):
            state[index] = {k: convert_value(v, fp, saving, f"state {index} {k}") for k, v in entry.items()}
    return {**state_dict, "state": state}


def convert_value(value: Any, fp: Any, saving: bool, key: str = "") -> Any:
    """One state-dict tensor of a flat-sharded parameter (its model entry, or one of its optimizer
    states) in the other form; anything else (a step count, a tensor already in the wanted form)
    unchanged. Loading takes the parameter's shape (a DTensor in any layout, or full), the full
    flat tensor, or rows wrapped in the flat shape (`_rows_in_flat_spec`)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape, flat_shape = tuple(value.shape), tuple(fp.layout.shape)
    if saving:
        return (
            to_rows(value, fp.shape, fp.info) if isinstance(value, DTensor) and shape == flat_shape else value
        )
    if shape == tuple(fp.shape) or (shape == flat_shape and not isinstance(value, DTensor)):
        return to_flat(value, fp)
    if shape == flat_shape and value.to_local().dim() > 1:
        return to_flat(_rows_in_flat_spec(value, fp, key), fp)
    return value
