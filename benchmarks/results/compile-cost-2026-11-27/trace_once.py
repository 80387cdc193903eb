import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import os, sys, time, copy
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613", RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import test_traced as T
from _parity import llama64
from llama_model import LlamaConfig, loss_fn, synthetic_batch
T._fresh_compiler()
torch.manual_seed(0)
m = llama64(LlamaConfig(n_layers=2))
T._shard(m, True)
m.compile(backend="aot_eager", fullgraph=True)
x, y = synthetic_batch(0, 4, 16, 101)
loss = loss_fn(m(x), y); loss.backward()
