"""Ad-hoc: the steady forward call (ms) of the compiled sharded 4-block model, one-row batch, 350 calls."""
import os, sys, time, statistics
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import test_traced as T
from _parity import llama64
from llama_model import LlamaConfig, loss_fn, synthetic_batch
T._fresh_compiler()
torch.manual_seed(0)
m = llama64(LlamaConfig(n_layers=4))
T._shard(m, True)
m.compile(backend="aot_eager", fullgraph=True)
x, y = synthetic_batch(0, 1, 4, 101)
loss_fn(m(x), y).backward()
ts = []
for _ in range(400):
    t0 = time.perf_counter(); m(x); ts.append(time.perf_counter() - t0)
ts = ts[50:]
import torch._dynamo
print(sys.argv[2], "fwd ms median", round(statistics.median(ts)*1e3, 3), "p10", round(sorted(ts)[len(ts)//10]*1e3, 3))
