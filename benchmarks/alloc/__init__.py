"""Peak live CPU tensor bytes counted at the allocator: the referee for memory claims.

``install()`` (right after ``import torch``, before the model is built) wraps c10's CPU allocator
with a counting one (``counting_allocator.cpp``, compiled with g++ on first use into ``.build/``),
so every storage allocated afterwards is counted, whoever allocates it and on whatever thread:
what PyTorch's ``MemTracker`` misses (tensors the collective backend allocates on its own threads,
storages resized under a tensor) included. On CUDA use ``torch.cuda.max_memory_allocated``.

    counter = alloc.install()
    counter.reset_peak(); step(); counter.peak() - baseline
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import subprocess

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "counting_allocator.cpp")


class Counter:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.counting_live.restype = ctypes.c_int64
        lib.counting_peak.restype = ctypes.c_int64
        rc = lib.counting_install()
        if rc != 1:
            raise RuntimeError(f"could not install the counting CPU allocator (rc={rc})")

    def live(self) -> int:
        """Bytes of CPU storages alive now."""
        return self._lib.counting_live()

    def peak(self) -> int:
        """Most bytes alive at once since the last ``reset_peak()``."""
        return self._lib.counting_peak()

    def reset_peak(self) -> None:
        self._lib.counting_reset_peak()


def _build() -> str:
    tag = torch.__version__.replace("+", "_")
    so = os.path.join(_HERE, ".build", f"counting-{tag}.so")
    os.makedirs(os.path.dirname(so), exist_ok=True)
    with open(so + ".lock", "w") as lock:  # ranks start together: one builds, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(so) and os.path.getmtime(so) >= os.path.getmtime(_SOURCE):
            return so
        torch_dir = os.path.dirname(torch.__file__)
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(torch_dir, "include"), _SOURCE,
               "-L", os.path.join(torch_dir, "lib"), "-lc10", f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}",
               "-o", so + ".tmp"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise RuntimeError("the allocator referee needs a C++ compiler: apt install g++ (or set CXX)") from e
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"building {_SOURCE} failed:\n{e.stderr}") from e
        os.replace(so + ".tmp", so)
    return so


_COUNTER: Counter | None = None


def install() -> Counter:
    """Install the counting allocator (once per process) and return its counter."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = Counter(ctypes.CDLL(_build()))
    return _COUNTER
