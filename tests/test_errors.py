"""Bad input gets a clear error naming the module/parameter, the rule and the fix, and leaves
the model as it was (checked in a fake world: errors need no real communication)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fake_world import fake_world
from fully_shard import CPUOffloadPolicy, FSDPModule, fully_shard


def _untouched(model: nn.Module) -> bool:
    return not any(isinstance(m, FSDPModule) for m in model.modules()) and not any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def test_fully_shard_twice():
    with fake_world(2) as mesh:
        model = nn.Linear(4, 4)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="^fully_shard: fully_shard was already applied to this Linear.*Fix"):
            fully_shard(model, mesh=mesh)


def test_replicate_and_fully_shard_on_one_module_name_the_call_that_came_first():
    from fully_shard import replicate

    with fake_world(2) as mesh:
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        fully_shard(first, mesh=mesh)
        with pytest.raises(ValueError, match="^replicate: fully_shard was already applied to this Linear.*Fix"):
            replicate(first, mesh=mesh)
        replicate(second, mesh=mesh)
        with pytest.raises(ValueError, match="^fully_shard: replicate was already applied to this Linear.*Fix"):
            fully_shard(second, mesh=mesh)
        with pytest.raises(ValueError, match="^replicate got the same module twice"):
            replicate([nn.Linear(2, 2)] * 2, mesh=mesh)


def test_fully_shard_on_an_fsdp1_wrapper_names_it():
    from fully_shard.fsdp1 import FullyShardedDataParallel, ShardingStrategy

    with fake_world(2) as mesh:
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
            wrapped = FullyShardedDataParallel(nn.Linear(4, 4), device_mesh=mesh, sharding_strategy=strategy)
            with pytest.raises(ValueError, match="^fully_shard: FullyShardedDataParallel was already applied"):
                fully_shard(wrapped, mesh=mesh)


def test_parent_before_child():
    with fake_world(2) as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match=r"'weight' \(in this Linear\) is already a DTensor.*bottom-up"):
            fully_shard(model[0], mesh=mesh)


def test_foreign_dtensor_parameter_refused():
    from torch.distributed.tensor import distribute_tensor

    with fake_world(2) as mesh:
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match=r"'weight' is already a DTensor.*that fully_shard did not make.*Fix: shard plain parameters"):
            fully_shard(model, mesh=mesh)
        assert not isinstance(model, FSDPModule) and not isinstance(model.bias, DTensor)


def test_scalar_parameter_refused_with_fix():
    with fake_world(2) as mesh:
        model = nn.Linear(4, 4)
        model.scale = nn.Parameter(torch.tensor(2.0))
        with pytest.raises(ValueError, match="'scale' is a 0-dim scalar.*reshape\\(1\\)"):
            fully_shard(model, mesh=mesh)
        assert _untouched(model)


def test_bad_options():
    with fake_world(2) as mesh:
        model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="reshard_after_forward"):
            fully_shard(model, mesh=mesh, reshard_after_forward="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="mp_policy must be a fully_shard.MixedPrecisionPolicy.*got torch.dtype"):
            fully_shard(model, mesh=mesh, mp_policy=torch.bfloat16)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="offload_policy must be a fully_shard.OffloadPolicy.*got builtins.str"):
            fully_shard(model, mesh=mesh, offload_policy="cpu")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="DeviceMesh"):
            fully_shard(model, mesh="cpu")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty list"):
            fully_shard([], mesh=mesh)
        assert _untouched(model)
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())  # a no-op on a CPU mesh
        assert isinstance(model.weight, DTensor)


def test_control_surface_bad_input():
    from fully_shard import register_fsdp_forward_method, unsharded

    with fake_world(4) as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="set_modules_to_forward_prefetch got a Linear.*not applied"):
            model.set_modules_to_forward_prefetch([model[1]])
        for bad in (0, -2.0, float("inf"), float("nan"), True):
            with pytest.raises(ValueError, match="finite number > 0 .* got"):
                model.set_gradient_divide_factor(bad)
        assert all(s.group is None or s.group.settings.gradient_divide_factor is None for s in model._fsdp_states(True))
        with pytest.raises(ValueError, match="requires_gradient_sync must be True or False"):
            model.set_requires_gradient_sync("no")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="torch.Event"):
            model.set_post_optim_event(object())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="has no method 'generate'"):
            register_fsdp_forward_method(model, "generate")
        with pytest.raises(ValueError, match="needs a module fully_shard was applied to"):
            register_fsdp_forward_method(model[1], "forward")
        with pytest.raises(ValueError, match="no fully_shard module inside"):
            with unsharded(nn.Linear(2, 2)):
                pass
        with pytest.raises(ValueError, match="int that divides the shard world size 4"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)


def test_three_dimensional_mesh_refused_with_fix():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="3-D mesh.*Pass the data-parallel dimensions"):
            fully_shard(model, mesh=mesh)
        assert _untouched(model)
        fully_shard(model, mesh=mesh["replicate", "shard"])  # the 2-D (HSDP) sub-mesh works
        assert isinstance(model.weight, DTensor) and model.weight.placements == (Replicate(), Shard(0))


def test_bad_shard_placement_fn_refused_before_anything_changes():
    with fake_world(2) as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with pytest.raises(ValueError, match=r"returned Replicate\(\) for parameter '0.weight'.*Shard\(dim\), None .*FlatShard\(\)"):
            fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Replicate())
        assert _untouched(model)
        with pytest.raises(ValueError, match=r"Shard\(2\) for parameter '0.weight' of shape \(4, 4\)"):
            fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(2))
        assert _untouched(model)
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.dim() == 2 else None)
        assert model[0].weight.placements == (Shard(1),) and model[0].bias.placements == (Shard(0),)


def test_torchscript_modules_refused_before_anything_changes():
    with fake_world(2) as mesh:
        scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        with pytest.raises(ValueError, match="got a TorchScript module .*Fix: apply fully_shard to the eager module"):
            fully_shard(scripted, mesh=mesh)
        inside = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Linear(4, 4)))
        with pytest.raises(ValueError, match="parameters of module '1': it is a TorchScript module.*ignored_params"):
            fully_shard(inside, mesh=mesh)
        assert _untouched(inside)
        in_list = [nn.Linear(4, 4), torch.jit.script(nn.Linear(4, 4))]  # the first one must stay untouched too
        with pytest.raises(ValueError, match="got a TorchScript module"):
            fully_shard(in_list, mesh=mesh)
        assert all(_untouched(m) for m in in_list)
        # The documented way out: leave the scripted module's parameters alone.
        fully_shard(inside, mesh=mesh, ignored_params=set(inside[1].parameters()))
        assert isinstance(inside[0].weight, DTensor) and not isinstance(inside[1].weight, DTensor)


def test_uneven_complex_parameter_warns_about_adam():
    with fake_world(2) as mesh:
        model = nn.Module()
        model.even = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        model.odd = nn.Parameter(torch.randn(5, 3, dtype=torch.complex64))
        model.forward = lambda x: x  # type: ignore[method-assign]
        with pytest.warns(UserWarning, match=r"'odd' is complex with dim 0 of size 5, which does not divide evenly over 2"):
            fully_shard(model, mesh=mesh)
        assert isinstance(model.odd, DTensor)


def test_the_sharded_class_forward_keeps_the_signature_and_not_dynamos_marks():
    """The class ``fully_shard`` gives a module has a forward of its own (it ends a traced root
    forward, docs/compile.md); ``inspect.signature`` reads the module's, and the marks torch's
    decorators leave on the module's forward (``@torch.compiler.disable``'s) are not copied onto it:
    dynamo would skip ours for them."""
    import inspect

    class Scaled(nn.Linear):
        @torch.compiler.disable
        def forward(self, x, *, scale: float = 1.0):
            return super().forward(x) * scale

    with fake_world(2) as mesh:
        model = fully_shard(Scaled(4, 4), mesh=mesh)
        marks = {k for k in vars(Scaled.forward) if k.startswith("_torchdynamo")}
        assert marks, "torch's decorator left no mark: the test checks nothing"
        assert not marks & set(vars(type(model).forward)), vars(type(model).forward)
        assert inspect.signature(model.forward) == inspect.signature(Scaled(4, 4).forward)
        assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]
