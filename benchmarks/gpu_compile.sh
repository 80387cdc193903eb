#!/bin/bash
# Issue #27's GPU section in one command, for a lent GPU machine (device tool: `bash
# benchmarks/gpu_compile.sh`, under 10 minutes on an H100).
# 1. bench_step.py --compile on the GPU, world 1, NCCL, a ~0.5B Llama in bf16 (every row is alive
#    at once: 5 models of ~9 GB with AdamW state fit 78 GiB): ours eager, per block, whole model
#    (default "bucket"), whole model with Inductor's overlap scheduler ("overlap", GPU only),
#    PyTorch's fully_shard per block; tokens/s and torch.cuda.max_memory_allocated;
# 2. profile_overlap.py: one profiled step each, the communication kernels' time and the part of it
#    under compute kernels, the traces kept;
# 3. tests/test_traced.py's whole-model tests on this machine (CPU/gloo: the lent machine's torch,
#    2.11, against our traced path).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/examples PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
t info; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
MODEL="--model llama --dim 2048 --layers 8 --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16"
t compile bench 0.5B bf16; timeout 250 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_step.py --device cuda $MODEL --compile --compile-collectives overlap --rounds 3 --steps-per-round 2 --warmup 1 --memory-repeats 1 --out $OUT/gpu-compile-world1.md > $OUT/compile_bench.log 2>&1; tail -14 $OUT/compile_bench.log
t profile; timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/profile_overlap.py --device cuda $MODEL --out-dir $OUT/profile --impl ours+model --impl torch_fsdp2+blocks --impl ours+model:overlap --impl ours > $OUT/profile.log 2>&1; grep -E "comm kernels|^\|" $OUT/profile.log; tail -3 $OUT/profile.log
t test_traced; timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_traced.py -k "world_size or bucketing or accumulation" > $OUT/test_traced.log 2>&1; tail -3 $OUT/test_traced.log
t done
