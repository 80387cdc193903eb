#!/bin/bash
# torchao float8 on a lent GPU (issue #27), in one command (device tool: `bash
# benchmarks/gpu_float8.sh` with carry [".gpu_deps"], under 9 minutes on an H100). The lent machine
# has no network: torchao comes from .gpu_deps (`pip install --no-deps --target .gpu_deps
# torchao==0.18.0`; its float8 training is pure Python over torch._scaled_mm).
# 1. tests/test_gpu.py whole (the float8 tests: ours vs PyTorch's fully_shard with real float8
#    matmuls; the whole model compiled with the float8 all-gather in the graph);
# 2. bench_step.py --float8 --compile: a ~0.5B Llama, bf16 params, float8 Linears, world 1, NCCL:
#    ours eager, ours whole model compiled, PyTorch's fully_shard per block compiled; tokens/s and
#    torch.cuda.max_memory_allocated.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/examples:$PWD/.gpu_deps PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
t info; nvidia-smi -L; python3 -c "import torch, torchao; print(torch.__version__, torchao.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1
t test_gpu; timeout 240 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py > $OUT/test_gpu.log 2>&1; grep -E "^(reshard|aot_eager|inductor)" $OUT/test_gpu.log | cut -c1-400; tail -3 $OUT/test_gpu.log
MODEL="--model llama --dim 2048 --layers 8 --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16"
t float8 bench; timeout 250 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_step.py --device cuda $MODEL --float8 --compile --only ours --only ours+model --only torch_fsdp2+blocks --rounds 3 --steps-per-round 2 --warmup 1 --memory-repeats 1 --out $OUT/gpu-float8-world1.md > $OUT/float8_bench.log 2>&1; tail -9 $OUT/float8_bench.log
t done
