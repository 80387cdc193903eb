"""Ad-hoc: compile_times.py plus the steady forward call (ms, guards included); `nolambda`: with
torch._dynamo.config.use_lamba_guard_for_object_aliasing = False (aliasing guards in C++)."""
import os, sys, time, statistics
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import torch._dynamo.config as dc
if "nolambda" in sys.argv: dc.use_lamba_guard_for_object_aliasing = False
import test_traced as T
from _parity import llama64
from llama_model import LlamaConfig, loss_fn, synthetic_batch
from torch._dynamo.utils import compile_times
res = {}
for rep in range(5):
    T._fresh_compiler()
    torch.manual_seed(0)
    m = llama64(LlamaConfig(n_layers=4))
    if "plain" not in sys.argv: T._shard(m, True)
    m.compile(backend="aot_eager", fullgraph=True)
    x, y = synthetic_batch(0, 4, 16, 101)
    t = time.time(); loss = loss_fn(m(x), y); loss.backward(); dt = time.time() - t
    # steady-state call cost
    ts = []
    for _ in range(30):
        t0 = time.perf_counter(); m(x); ts.append(time.perf_counter() - t0)
    d = {}
    for line in compile_times(repr="str", aggregate=True).splitlines()[2:]:
        k, v = line.split(", "); d[k] = float(v)
    if rep:
        for k in ("step", "bytecode_tracing", "build_guards", "create_aot_dispatcher_function", "fwd_ms"):
            res.setdefault(k, []).append(dt if k == "step" else statistics.median(ts)*1e3 if k == "fwd_ms" else d.get(k, 0))
print(sys.argv[2:], {k: (round(statistics.median(v), 3), round(min(v), 3), round(max(v), 3)) for k, v in res.items()})
