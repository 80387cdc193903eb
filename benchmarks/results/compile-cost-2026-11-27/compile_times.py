import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import os, sys, time, statistics
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import test_traced as T
from _parity import llama64
from llama_model import LlamaConfig, loss_fn, synthetic_batch
from torch._dynamo.utils import compile_times
res = {}
for rep in range(6):
    T._fresh_compiler()
    torch.manual_seed(0)
    m = llama64(LlamaConfig(n_layers=4))
    if len(sys.argv) < 3: T._shard(m, True)
    m.compile(backend="aot_eager", fullgraph=True)
    x, y = synthetic_batch(0, 4, 16, 101)
    t = time.time(); loss = loss_fn(m(x), y); loss.backward(); dt = time.time() - t
    d = {}
    for line in compile_times(repr="str", aggregate=True).splitlines()[2:]:
        k, v = line.split(", "); d[k] = float(v)
    if rep:
        for k in ("step", "bytecode_tracing", "build_guards", "create_aot_dispatcher_function"):
            res.setdefault(k, []).append(dt if k == "step" else d.get(k, 0))
print({k: (round(statistics.median(v), 3), round(min(v), 3), round(max(v), 3)) for k, v in res.items()})
