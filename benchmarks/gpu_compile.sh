#!/bin/bash
# Issue #27's GPU section in one command, for a lent GPU machine (device tool: `bash
# benchmarks/gpu_compile.sh`). Written without a GPU at hand (2026-11-26): not run yet.
# 1. tests/test_traced.py's whole-model tests on this machine (they run on CPU/gloo: the torch of
#    the lent machine, 2.11, against our traced path);
# 2. bench_step.py --compile on the GPU, world 1, NCCL, a ~0.5B Llama in bf16 (every row is alive
#    at once: 5-6 models of ~9 GB with AdamW state fit 78 GiB): ours eager, per block, whole model
#    (default "bucket"), whole model with Inductor's overlap scheduler ("overlap", GPU only) and
#    as traced, PyTorch's fully_shard per block; tokens/s and torch.cuda.max_memory_allocated.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/examples PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
t info; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
t test_traced; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_traced.py -k "world_size or bucketing or accumulation" > $OUT/test_traced.log 2>&1; tail -3 $OUT/test_traced.log
t compile bench 0.5B bf16; timeout 330 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_step.py --device cuda --model llama --dim 2048 --layers 8 --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16 --compile --compile-collectives overlap --compile-collectives as_traced --rounds 3 --steps-per-round 2 --warmup 1 --memory-repeats 1 --out $OUT/gpu-compile-world1.md > $OUT/compile_bench.log 2>&1; tail -12 $OUT/compile_bench.log
t done
