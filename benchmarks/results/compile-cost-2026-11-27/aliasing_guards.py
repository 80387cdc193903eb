"""Ad-hoc: the object-aliasing guards dynamo builds for the sharded 4-block model (world 1,
aot_eager): how many, and their kinds (paths abstracted: M the model, STATE a hook's FSDP state)."""
import collections
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch  # noqa: E402
import torch._dynamo.guards as G  # noqa: E402
import torch.distributed as dist  # noqa: E402

_build = G.build_guard_function


def counted(code_parts, args):
    kinds = collections.Counter()
    for c in code_parts:
        s = re.sub(r"L\['fn'\]\.__self__", "M", c)
        s = re.sub(r"\._forward_pre_hooks\[list\(dict\.keys\([^)]*\)\)\[0\]\]\.hook\.__self__", ".STATE", s)
        s = re.sub(r"_modules\['(\d+)'\]", "_modules[N]", s)
        kinds[re.sub(r"\[\d+\]", "[i]", s)] += 1
    print(f"{len(code_parts)} guards in the Python lambda, {sum(map(len, code_parts))} characters")
    for k, v in kinds.most_common():
        print(v, k)
    return _build(code_parts, args)


G.build_guard_function = counted
torch.set_num_threads(1)
dist.init_process_group("gloo")
import test_traced as T  # noqa: E402
from _parity import llama64  # noqa: E402
from llama_model import LlamaConfig, loss_fn, synthetic_batch  # noqa: E402

T._fresh_compiler()
torch.manual_seed(0)
m = llama64(LlamaConfig(n_layers=4))
T._shard(m, True)
m.compile(backend="aot_eager", fullgraph=True)
x, y = synthetic_batch(0, 4, 16, 101)
loss_fn(m(x), y).backward()
