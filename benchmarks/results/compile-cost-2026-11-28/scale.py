"""Ad-hoc: the first compiled step's time against the number of parameters and groups (world 1,
gloo, CPU, aot_eager, `model.compile(fullgraph=True)`), dynamo's `compile_times` per part.
Usage: python scale.py PORT MODE N...   MODE: plain (not sharded), root (one `fully_shard` on the
root: one group of 2N parameters), blocks (each of the N blocks and the root: N groups of 2).
RESHARD=0 in the environment: the blocks with reshard_after_forward=False."""
import os
import sys
import time

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch._dynamo.utils import compile_times  # noqa: E402

from fully_shard import fully_shard  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
mode = sys.argv[2]
RESHARD = os.environ.get("RESHARD", "1") == "1"


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.b = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b)


class Seq(nn.Module):  # (not nn.Sequential: torch 2.13 compiles no frame of a Sequential of builtins)
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([Lin() for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


for n in [int(a) for a in sys.argv[3:]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Seq(n)
    if mode == "root":
        fully_shard(m)
    elif mode == "blocks":
        for b in m.layers:
            fully_shard(b, reshard_after_forward=RESHARD)
        fully_shard(m)
    m.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    t = time.time()
    m(x).sum().backward()
    dt = time.time() - t
    d = {}
    for line in compile_times(repr="str", aggregate=True).splitlines()[2:]:
        k, v = line.split(", ")
        d[k] = float(v)
    parts = ("bytecode_tracing", "build_guards", "create_aot_dispatcher_function")
    print(mode, "reshard" if RESHARD else "keep", n, "params", 2 * n, "first step %.2f s" % dt,
          {k: d.get(k) for k in parts}, flush=True)
