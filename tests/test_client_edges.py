"""What real client code (transformers, accelerate, torchtitan) does to a model after
``fully_shard``: assigning parameters, converting dtypes, slicing containers, meta init. Each case
is checked against a single-process float64 reference (world 1, 2 and 4)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from _parity import TOL64, _mlp_loss, _train_pair, make_mlp, mlp_batch, shard_mlp
from rank_utils import cpu_mesh, world

WORLDS = [1, 2, 4]


def _forward_diff(model: nn.Module, ref: nn.Module, step: int = 0) -> float:
    """Max difference between the sharded model's output on this rank's rows and the reference's."""
    rank, w = world()
    x, _ = mlp_batch(step)
    with torch.no_grad():
        return (model(x.chunk(w)[rank]) - ref(x).chunk(w)[rank]).abs().max().item()


def _other_weights() -> nn.Sequential:
    """The parity MLP with other values (another seed)."""
    torch.manual_seed(1)
    other = make_mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p))
    return other


# -- p.data = t on a sharded parameter ------------------------------------------------------


def _data_assignment(what: str) -> dict:
    """``p.data = t`` replaces only the DTensor wrapper's metadata (PyTorch's fully_shard ignores it
    silently): refused at the next forward, naming the parameter and the fix, with the wrapper put
    back, so training after the refusal equals the float64 reference."""
    from fully_shard import fully_shard

    model, ref = make_mlp(), make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    p = model[0][0].weight
    new = {
        "full": lambda: torch.zeros(p.shape, dtype=p.dtype),
        "other_shape": lambda: torch.zeros(2, 3, dtype=p.dtype),
        "dtensor": lambda: distribute_tensor(torch.zeros(p.shape, dtype=p.dtype), p.device_mesh, p.placements),
    }[what]()
    p.data = new
    try:
        _forward_diff(model, ref)
        error = ""
    except ValueError as e:
        error = str(e)
    shape_back = tuple(p.shape) == (13, 7)
    result = _train_pair(model, ref, mlp_batch, _mlp_loss, steps=2)
    return {"error": error, "shape_back": shape_back, **result}


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("what", ["full", "other_shape", "dtensor"])
def test_data_assignment_on_a_sharded_parameter_is_refused(ranks, world_size, what):
    for r in ranks(world_size).run(_data_assignment, what):
        assert "parameter 0.0.weight: '.data' was assigned a new tensor" in r["error"], r
        assert "p.copy_(distribute_tensor(t" in r["error"] and r["shape_back"], r
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


# -- assigned parameters -----------------------------------------------------------------------


def _assign(how: str, optimizer_first: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fully_shard import fully_shard

    rank, _ = world()
    new = _other_weights()
    ref = copy.deepcopy(new)
    if how.endswith("_on_meta"):
        with torch.device("meta"):
            model = make_mlp()
    else:
        model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    if not how.endswith("_on_meta") and not optimizer_first:
        model(mlp_batch(0)[0])  # ran once with the old weights
    if how == "load_state_dict_assign_full":  # a plain (unsharded) state dict: each rank keeps its chunk
        model.load_state_dict(copy.deepcopy(new).state_dict(), assign=True)
    elif how.startswith("load_state_dict_assign"):
        donor = copy.deepcopy(new)
        shard_mlp(donor, "nested", True, fully_shard)
        model.load_state_dict(donor.state_dict(), assign=True)
    elif how == "attribute_dtensor":
        mesh = cpu_mesh()
        for (name, _), p in zip(list(model.named_parameters()), new.parameters()):
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])))
    elif how == "attribute_full_tensor":
        for (name, _), p in zip(list(model.named_parameters()), new.parameters()):
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, nn.Parameter(p.detach().clone()))
    elif how == "broadcast_from_rank0_on_meta":
        full = new.state_dict() if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if optimizer_first:  # the optimizer is built right after the assignment, before any forward
        placements_ok = all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
        trained = _train_pair(model, ref, mlp_batch, _mlp_loss, 3)
        return {"forward": _forward_diff(model, ref), "placements_ok": placements_ok, **trained}
    forward = _forward_diff(model, ref)
    placements_ok = all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    trained = _train_pair(model, ref, mlp_batch, _mlp_loss, 3)
    return {"forward": forward, "placements_ok": placements_ok, **trained}


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(
    "how",
    ["load_state_dict_assign", "load_state_dict_assign_on_meta", "attribute_dtensor", "attribute_full_tensor",
     "broadcast_from_rank0_on_meta"],
)
def test_assigned_parameters_take_effect_at_the_next_forward(ranks, world_size, how):
    for r in ranks(world_size).run(_assign, how):
        print(f"{how}: forward diff {r['forward']:.1e}, after 3 steps {r['param_diff']:.1e}")
        assert r["forward"] <= TOL64 and r["placements_ok"], r
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(
    "how", ["load_state_dict_assign", "load_state_dict_assign_full", "attribute_dtensor", "attribute_full_tensor"]
)
def test_assigned_parameters_are_sharded_before_the_optimizer_is_built(ranks, world_size, how):
    """Issue #23: an assignment (``load_state_dict(sd, assign=True)``, ``block.w = nn.Parameter(t)``)
    is taken over as it happens, so an optimizer built right after holds the sharded parameters
    (it trained nothing before: the takeover waited for the next forward)."""
    for r in ranks(world_size).run(_assign, how, True):
        assert r["placements_ok"], r
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64 and r["forward"] <= TOL64, r


def _deterministic_init(model: nn.Module) -> None:
    """An in-place init that draws no random numbers (DTensor random init differs from a single
    process), so the sharded and the reference model start equal."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            nn.init.constant_(p, 0.05 * (i + 1) * (-1) ** i)


def _to_empty_then_init() -> dict:
    from fully_shard import fully_shard

    with torch.device("meta"):
        model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    model.to_empty(device="cpu")
    _deterministic_init(model)
    ref = make_mlp()
    _deterministic_init(ref)
    where = sorted({f"{p.to_local().device.type}:{p.to_local().dtype}" for p in model.parameters()})
    return {"where": where, "forward": _forward_diff(model, ref), **_train_pair(model, ref, mlp_batch, _mlp_loss, 3)}


@pytest.mark.parametrize("world_size", WORLDS)
def test_to_empty_then_in_place_init_takes_effect(ranks, world_size):
    for r in ranks(world_size).run(_to_empty_then_init):
        assert r["where"] == ["cpu:torch.float64"], r
        assert r["forward"] <= TOL64 and r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _bad_assignment(kind: str) -> str:
    from torch.distributed.tensor import Replicate

    from fully_shard import fully_shard

    model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    target = model[0][0]
    before = target.weight
    try:  # refused as it is assigned: the module keeps its sharded parameter
        if kind == "shape":
            target.weight = nn.Parameter(torch.zeros(5, 7, dtype=torch.float64))
        else:
            bad = distribute_tensor(torch.zeros(13, 7, dtype=torch.float64), cpu_mesh(), [Replicate()])
            target.weight = nn.Parameter(bad)
    except ValueError as e:
        assert target.weight is before
        model(mlp_batch(0)[0])  # still trains
        return str(e)
    return "no error"


def _tie_after_fully_shard() -> str:
    from fully_shard import fully_shard

    model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    model(mlp_batch(0)[0])  # after the first forward, names are from the root
    model.reshard()
    before = model[3].bias
    try:  # both (3,): the root's bias tied to block 2's, after sharding
        model[3].bias = model[2][2].bias
    except ValueError as e:
        assert model[3].bias is before
        return str(e)
    return "no error"


def test_tying_weights_of_two_groups_after_fully_shard_is_refused(ranks):
    for message in ranks(2).run(_tie_after_fully_shard):
        assert "parameter '3.bias' was assigned the parameter '2.2.bias'" in message and "Fix: tie" in message, message


@pytest.mark.parametrize("kind", ["shape", "placement"])
def test_a_replacement_of_the_wrong_shape_or_placement_is_refused(ranks, kind):
    for message in ranks(2).run(_bad_assignment, kind):
        # Named by its path from the outermost fully_shard call, also before the first forward.
        assert "parameter '0.0.weight'" in message and "replaced after fully_shard" in message and "Fix:" in message, message
        assert "(13, 7)" in message, message


# -- module.to(dtype) --------------------------------------------------------------------------


def _to_dtype(how: str) -> dict:
    from fully_shard import fully_shard

    model = make_mlp(torch.float32)
    ref = copy.deepcopy(model).double()
    shard_mlp(model, "nested", True, fully_shard)
    model(mlp_batch(0, torch.float32)[0])  # ran in float32 first
    getattr(model, how)() if how != "to" else model.to(torch.float64)
    dtypes = sorted({str(p.to_local().dtype) for p in model.parameters()})
    return {"dtypes": dtypes, **_train_pair(model, ref, mlp_batch, _mlp_loss, 3)}


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("how", ["to", "double"])
def test_module_to_dtype_after_fully_shard(ranks, world_size, how):
    for r in ranks(world_size).run(_to_dtype, how):
        assert r["dtypes"] == ["torch.float64"], r
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _carried_gradient() -> dict:
    """A micro-batch without sync accumulates float32 gradients on the unsharded parameters; then
    ``module.double()`` with a float32 ``param_dtype`` drops those parameters and carries their
    gradients to the next unshard. Meanwhile the memory tools (`live_buffers`) still count them."""
    from functools import partial

    from fully_shard import MixedPrecisionPolicy, fully_shard

    rank, w = world()
    model = make_mlp(torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.float32)
    shard_mlp(model, "nested", True, partial(fully_shard, mp_policy=mp))
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]

    def gradient_bytes() -> int:
        seen = {}
        for s in states:
            for category, t in s.live_buffers():
                if category == "gradients" and t is not None:
                    t = t.to_local() if isinstance(t, DTensor) else t
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    x, y = mlp_batch(0, torch.float32)
    model.set_requires_gradient_sync(False)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    before = gradient_bytes()
    model.double()
    after = gradient_bytes()
    model.set_requires_gradient_sync(True)
    x, y = mlp_batch(1)
    _mlp_loss(model, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
    return {"expected": 4 * numel, "before": before, "after": after,
            "sharded_grads": sorted({str(p.grad.to_local().dtype) for p in model.parameters()})}


@pytest.mark.parametrize("world_size", WORLDS)
def test_a_gradient_carried_over_a_dtype_change_is_still_counted(ranks, world_size):
    for r in ranks(world_size).run(_carried_gradient):
        assert r["before"] == r["after"] == r["expected"], r  # the unsharded float32 gradients
        assert r["sharded_grads"] == ["torch.float64"], r


def _half() -> dict:
    from fully_shard import fully_shard

    model = make_mlp(torch.float32)
    shard_mlp(model, "nested", True, fully_shard)
    model.half()
    dtypes = sorted({str(p.to_local().dtype) for p in model.parameters()})
    out = model(mlp_batch(0, torch.float16)[0])
    return {"dtypes": dtypes, "out": str(out.dtype)}


def test_module_half_after_fully_shard(ranks):
    for r in ranks(2).run(_half):
        assert r["dtypes"] == ["torch.float16"] and r["out"] == "torch.float16", r


# -- module classes ----------------------------------------------------------------------------


def _slice() -> dict:
    from fully_shard import FSDPModule, fully_shard

    model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    head = model[:2]
    return {
        "type": type(head).__name__,
        "sharded": isinstance(head, FSDPModule),
        "children_same": all(a is b for a, b in zip(head, list(model)[:2])),
        "len": len(head),
    }


def test_slicing_a_sharded_sequential_gives_a_plain_sequential(ranks):
    for r in ranks(2).run(_slice):
        assert r == {"type": "Sequential", "sharded": False, "children_same": True, "len": 2}, r


class _Defaults(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _OwnParameter(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _constructed_without_arguments() -> dict:
    import inspect

    from fully_shard import FSDPModule, fully_shard

    model = nn.Sequential(_Defaults(), _OwnParameter())
    for block in model:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    made = {"block": type(model[0])(), "wide": type(model[0])(width=6), "container": type(model)(),
            "own": type(model[1])()}  # (its class: the one with a property per parameter name, below the sharded one)
    copied, shallow = copy.deepcopy(model[0]), copy.copy(model[1])
    return {
        **{k: (type(m).__name__, isinstance(m, FSDPModule)) for k, m in made.items()},
        "own_out": tuple(made["own"](torch.ones(2, 4)).shape),
        "signature": str(inspect.signature(type(model[0]).__init__)),
        "shallow": (type(shallow) is type(model[1]), shallow._get_fsdp_state() is model[1]._get_fsdp_state()),
        "block_out": tuple(made["block"](torch.ones(2, 4)).shape),
        "compiled_out": tuple(torch.compile(made["block"], backend="eager")(torch.ones(2, 4)).shape),
        "wide_out": tuple(made["wide"](torch.ones(2, 6)).shape),
        "container_len": len(made["container"]),
        "copy": (type(copied).__name__, isinstance(copied, FSDPModule)),
    }


def test_a_sharded_class_constructed_without_arguments_is_its_original_class(ranks):
    """``type(block)()`` (as some libraries build a fresh module of a model's class): an object of
    the original class, initialised by it, as with arguments (was: a sharded-class module without
    state, whose ``FSDPModule`` methods raised ``KeyError: '_fsdp_state'``), also for a module
    holding its own parameter (its class the traced one below the sharded class); copies (deep and
    shallow) keep the sharded class; the class's ``__init__`` shows the original's signature."""
    for r in ranks(2).run(_constructed_without_arguments):
        assert r == {"block": ("_Defaults", False), "wide": ("_Defaults", False), "container": ("Sequential", False),
                     "own": ("_OwnParameter", False), "own_out": (2, 4), "signature": "(self, width: 'int' = 4) -> 'None'",
                     "shallow": (True, True), "block_out": (2, 4), "compiled_out": (2, 4), "wide_out": (2, 6),
                     "container_len": 0, "copy": ("FSDP_Defaults", True)}, r


def test_fully_shard_refuses_a_module_without_forward():
    from fake_world import fake_world
    from fully_shard import fully_shard

    for container in (nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)]), nn.ModuleDict({"a": nn.Linear(3, 3)})):
        with fake_world(2) as mesh:
            with pytest.raises(ValueError, match="has no forward of its own") as info:
                fully_shard(container, mesh=mesh)
        assert "fully_shard(list(" in str(info.value) and type(container).__name__ in str(info.value)
        assert type(container) in (nn.ModuleList, nn.ModuleDict)  # untouched
        assert all(not isinstance(p, DTensor) for p in container.parameters())


def _meta_forward() -> str:
    from fully_shard import fully_shard

    with torch.device("meta"):
        model = make_mlp()
    shard_mlp(model, "nested", True, fully_shard)
    messages = []
    for _ in range(2):  # refused again on the next try, not gathered from meta
        try:
            model(mlp_batch(0)[0])
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def test_meta_parameters_at_the_first_forward_are_named(ranks):
    for messages in ranks(2).run(_meta_forward):
        assert len(messages) == 2 and messages[0] == messages[1], messages
        message = messages[0]
        # The root's forward runs first: its parameters are the first ones named.
        assert "meta device" in message and "to_empty" in message and "['3.weight', '3.bias']" in message, message


# -- PyTorch's own policy objects ------------------------------------------------------------------


def _torch_policies() -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from _parity import max_abs_diff
    from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    rank, w = world()
    bf16 = torch.bfloat16
    policies = {
        "torch_objects": (TorchMP(param_dtype=bf16, reduce_dtype=torch.float32), TorchOffload(pin_memory=False)),
        "ours": (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32), CPUOffloadPolicy(pin_memory=False)),
    }
    models = {name: make_mlp(torch.float32) for name in (*policies, "torch_fully_shard")}
    for name, (mp, offload) in policies.items():
        shard_mlp(models[name], "nested", True, lambda m, **kw: fully_shard(m, mp_policy=mp, offload_policy=offload, **kw))
    mp, offload = policies["torch_objects"]
    shard_mlp(models["torch_fully_shard"], "nested", True, lambda m, **kw: torch_fully_shard(m, mp_policy=mp, offload_policy=offload, **kw))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    for step in range(3):
        x, y = mlp_batch(step, torch.float32)
        for name, m in models.items():
            _mlp_loss(m, x.chunk(w)[rank], y.chunk(w)[rank]).backward()
            opts[name].step()
            opts[name].zero_grad()
    group = models["torch_objects"][0].__dict__["_fsdp_state"].group
    return {
        "param_dtype": str(group.params[0].param_dtype),
        "offload": group.params[0].offload,
        "vs_ours": max_abs_diff(models["torch_objects"], models["ours"]),
        "vs_torch": max_abs_diff(models["torch_objects"], models["torch_fully_shard"]),
    }


@pytest.mark.parametrize("world_size", WORLDS)
def test_pytorch_policy_objects_are_converted(ranks, world_size):
    for r in ranks(world_size).run(_torch_policies):
        assert r == {"param_dtype": "torch.bfloat16", "offload": True, "vs_ours": 0.0, "vs_torch": 0.0}, r


# -- copy.deepcopy -------------------------------------------------------------------------------


def _deepcopy_ema() -> dict:
    from fully_shard import FSDPModule, fully_shard

    rank, w = world()
    model = make_mlp()
    ref = copy.deepcopy(model)
    shard_mlp(model, "nested", True, fully_shard)
    _train_pair(model, ref, mlp_batch, _mlp_loss, 2)  # the original has trained: it has grads and state
    ema, ref_ema = copy.deepcopy(model), copy.deepcopy(ref)
    x, _ = mlp_batch(7)
    with torch.no_grad():
        same_output = torch.equal(ema(x.chunk(w)[rank]), model(x.chunk(w)[rank]))
    distinct = all(
        a is not b and a.to_local().untyped_storage().data_ptr() != b.to_local().untyped_storage().data_ptr()
        for a, b in zip(ema.parameters(), model.parameters())
    )
    structure = isinstance(ema[0], FSDPModule) and ema[0]._get_fsdp_state() is not model[0]._get_fsdp_state()
    # Train the original on; the copy follows as an exponential moving average, like the reference's.
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        xb, yb = mlp_batch(10 + step)
        _mlp_loss(model, xb.chunk(w)[rank], yb.chunk(w)[rank]).backward()
        _mlp_loss(ref, xb, yb).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 0.25)
            for pe, p in zip(ref_ema.parameters(), ref.parameters()):
                pe.lerp_(p, 0.25)
    from rank_utils import max_param_diff

    ema_diff = max_param_diff(ema, ref_ema)
    # And the copy trains on its own, like a copy of the reference.
    trained = _train_pair(ema, ref_ema, mlp_batch, _mlp_loss, 3)
    return {"same_output": same_output, "distinct": distinct, "structure": structure, "ema_diff": ema_diff,
            "original_diff": max_param_diff(model, ref), **trained}


@pytest.mark.parametrize("world_size", WORLDS)
def test_deepcopy_gives_an_independent_sharded_model_for_ema(ranks, world_size):
    for r in ranks(world_size).run(_deepcopy_ema):
        print(r)
        assert r["same_output"] and r["distinct"] and r["structure"], r
        assert r["ema_diff"] <= TOL64 and r["original_diff"] <= TOL64, r
        assert r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r


def _deepcopy_mid_iteration() -> str:
    from fully_shard import fully_shard

    model = make_mlp()
    shard_mlp(model, "nested", False, fully_shard)
    loss = _mlp_loss(model, *mlp_batch(0))
    try:
        copy.deepcopy(model)
    except RuntimeError as e:
        message = str(e)
    else:
        message = "no error"
    loss.backward()  # the original is unharmed
    return message


def test_deepcopy_mid_iteration_is_refused(ranks):
    for message in ranks(2).run(_deepcopy_mid_iteration):
        assert "copy.deepcopy of a sharded model" in message and "Fix:" in message, message


def _deepcopy_registered_method() -> dict:
    """A method registered with register_fsdp_forward_method runs the copy's parameters on the copy."""
    from _parity import sharded_generate_model

    model, ref = sharded_generate_model()
    ema = copy.deepcopy(model)
    with torch.no_grad():  # change the original only
        for p in model.parameters():
            p.add_(1.0)
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return {"copy": (ema.generate(x) - ref.generate(x)).abs().max().item(),
                "original_moved": (model.generate(x) - ref.generate(x)).abs().max().item()}


def test_deepcopy_rebinds_registered_forward_methods(ranks):
    for r in ranks(2).run(_deepcopy_registered_method):
        assert r["copy"] <= TOL64 and r["original_moved"] > 0.01, r


def _deepcopy_tied() -> dict:
    """Weights tied across two fully_shard calls stay tied in the copy, which trains like a copy of
    the reference."""
    from _parity import LLAMA_LR, _llama_loss, llama64, llama_batch
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = llama64()
    ref = copy.deepcopy(model)
    mesh = cpu_mesh()
    fully_shard(model.tok_embeddings, mesh=mesh)
    fully_shard(model.output, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_pair(model, ref, llama_batch, _llama_loss, 1, LLAMA_LR)
    twin, ref_twin = copy.deepcopy(model), copy.deepcopy(ref)
    out = _train_pair(twin, ref_twin, llama_batch, _llama_loss, 3, LLAMA_LR)
    return {"tied": twin.output.weight is twin.tok_embeddings.weight, **out}


@pytest.mark.parametrize("world_size", WORLDS)
def test_deepcopy_keeps_weights_tied_across_calls(ranks, world_size):
    for r in ranks(world_size).run(_deepcopy_tied):
        assert r["tied"] and r["loss_diff"] <= TOL64 and r["param_diff"] <= TOL64, r
