"""Patches applied at interpreter start-up (through ``sitecustomize``) in the process that runs
PyTorch's FSDP1 tests and in every process those tests spawn.

Environment (set by ``run.py``):

* ``UPSTREAM_FSDP1_IMPL``: ``ours`` swaps PyTorch's FSDP1 public names for ``fully_shard.fsdp1``'s;
  ``torch`` leaves PyTorch's FSDP1 in place (the reference). Unset: nothing is patched at all.
* ``UPSTREAM_FSDP1_WORLD``: world size for test classes that do not fix their own (default 2;
  on a CPU-only machine ``common_fsdp`` would otherwise use 1).

Two groups of patches:

1. The swap (``ours`` only), done before ``torch.testing._internal.common_fsdp`` is imported,
   because it binds ``FullyShardedDataParallel`` & co. at its own import time: the public FSDP1
   names that ``fully_shard.fsdp1`` (and ``fully_shard.fsdp1.wrap``) provide replace PyTorch's on
   ``torch.distributed.fsdp``, ``torch.distributed.fsdp.fully_sharded_data_parallel`` and
   ``torch.distributed.fsdp.wrap``. PyTorch's private FSDP1 modules (``_traversal_utils``,
   ``_flat_param``, ``_common_utils`` ...) and FSDP2's ``fully_shard`` are left alone.
2. Running on CPU (both modes): the tests are written for >= 2 accelerators. On a CPU-only
   machine ``skip_if_lt_x_gpu`` runs the test (its own ``allow_cpu`` path), ``FSDPTest._run`` /
   ``FSDPTestContinuous._init_pg`` skip the accelerator-count check (``FSDPTestMixin._run``
   already does so for CPU), ``instantiate_device_type_tests`` also instantiates the ``cpu``
   variant of classes restricted to ``only_for=("cuda", "hpu", ...)`` / ``except_for=("cpu",)``,
   and ``DistributedDataParallel(cpu_module, device_ids=[cpu device])`` drops the
   ``device_ids`` (DDP accepts none for CPU modules; the tests pass ``[device_type]``).
"""

from __future__ import annotations

import functools
import os

SWAPPED: list[str] = []  # "module.name" of each patched FSDP1 name (for run.py's banner)


def _swap_fsdp1() -> None:
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.fully_sharded_data_parallel as tfsdp_mod
    import torch.distributed.fsdp.wrap as twrap

    # Modules that bind names from torch.distributed.fsdp.wrap for PyTorch's own use: import them
    # first so that they keep PyTorch's objects.
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401

    import fully_shard.fsdp1 as ours
    import fully_shard.fsdp1.wrap as ours_wrap

    for name in ours.__all__:
        if name == "wrap":
            continue
        obj = getattr(ours, name)
        for mod in (tfsdp, tfsdp_mod):
            if hasattr(mod, name):
                setattr(mod, name, obj)
                SWAPPED.append(f"{mod.__name__}.{name}")
    for name in ours_wrap.__all__:
        if hasattr(twrap, name):
            setattr(twrap, name, getattr(ours_wrap, name))
            SWAPPED.append(f"{twrap.__name__}.{name}")


def _enable_cpu(world: int) -> None:
    import torch
    import torch.testing._internal.common_device_type as cdt
    import torch.testing._internal.common_distributed as cdist

    if torch.accelerator.is_available():
        return  # a real accelerator: run the tests as PyTorch's CI does

    # skip_if_lt_x_gpu(x) -> skip_if_lt_x_gpu(x, allow_cpu=True)
    orig_skip = cdist.skip_if_lt_x_gpu

    @functools.wraps(orig_skip)
    def skip_if_lt_x_gpu(x, *, allow_cpu=True):
        return orig_skip(x, allow_cpu=True)

    cdist.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    # instantiate_device_type_tests(..., only_for=("cuda", "hpu")) -> also "cpu"
    orig_inst = cdt.instantiate_device_type_tests

    @functools.wraps(orig_inst)
    def instantiate_device_type_tests(generic_test_class, scope, except_for=None, only_for=None, **kw):
        if isinstance(only_for, str):
            only_for = (only_for,)
        if isinstance(except_for, str):
            except_for = (except_for,)
        if only_for is not None and "cpu" not in only_for:
            only_for = (*only_for, "cpu")
        if except_for is not None:
            except_for = tuple(d for d in except_for if d != "cpu") or None
        return orig_inst(generic_test_class, scope, except_for=except_for, only_for=only_for, **kw)

    cdt.instantiate_device_type_tests = instantiate_device_type_tests

    # DDP(cpu_module, device_ids=[torch.device("cpu")]) -> device_ids=None
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_ddp_init = DDP.__init__

    @functools.wraps(orig_ddp_init)
    def ddp_init(self, module, device_ids=None, *args, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids if not isinstance(d, int)):
            if all(p.device.type == "cpu" for p in module.parameters()):
                device_ids = None
        return orig_ddp_init(self, module, device_ids, *args, **kwargs)

    DDP.__init__ = ddp_init

    # PyTorch's FSDP1 (the reference run only): with no accelerator it refuses a module that has no
    # device_id ("FSDP needs a non-CPU accelerator device"); most tests pass none, so default it
    # to the CPU, which FSDP1 supports when asked explicitly.
    import torch.distributed.fsdp.fully_sharded_data_parallel as tfsdp_mod

    tfsdp = tfsdp_mod.FullyShardedDataParallel
    if tfsdp.__module__ == tfsdp_mod.__name__:
        orig_fsdp_init = tfsdp.__init__

        @functools.wraps(orig_fsdp_init)
        def fsdp_init(self, *args, **kwargs):
            if kwargs.get("device_id") is None:
                kwargs["device_id"] = torch.device("cpu")
            return orig_fsdp_init(self, *args, **kwargs)

        tfsdp.__init__ = fsdp_init

    import torch.testing._internal.common_fsdp as cf

    cf.DEVICE_COUNT = world  # FSDPTest.world_size reads it at call time
    cf.FSDPTestContinuous.world_size = world
    # FSDPTest._run differs from FSDPTestMixin._run only by not exempting CPU from the
    # accelerator-count check.
    cf.FSDPTest._run = cf.FSDPTestMixin.__dict__["_run"]

    base_init_pg = cdist.MultiProcContinuousTest.__dict__["_init_pg"].__func__

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        os.environ["TORCH_NCCL_DESYNC_DEBUG"] = "0"
        base_init_pg(cls, rank, world_size, rdvz_file)

    cf.FSDPTestContinuous._init_pg = _init_pg


def install() -> None:
    impl = os.environ.get("UPSTREAM_FSDP1_IMPL")
    if impl not in ("ours", "torch"):
        return
    if impl == "ours":
        _swap_fsdp1()
    _enable_cpu(int(os.environ.get("UPSTREAM_FSDP1_WORLD", "2")))
