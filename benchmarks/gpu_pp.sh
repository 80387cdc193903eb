#!/bin/bash
# Issue #28's GPU section in one command, for a lent GPU machine (device tool: `bash
# benchmarks/gpu_pp.sh`, a few minutes). Written without a GPU at hand (2026-11-26): not run yet.
# 1. tests/test_gpu.py;
# 2. the PP x FSDP example at world 1 with 2 virtual stages (ScheduleInterleaved1F1B) on the GPU
#    (NCCL) in float64, against the same run on CPU (gloo; on torch 2.11 gloo refuses the
#    stage-to-stage send of one rank, so the CPU side runs 2 ranks, 2 stages: the same math, the
#    losses printed in nats must agree to ~1e-12); then in fp32 for the step time and
#    max_memory_allocated.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/examples PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
t info; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
t test_gpu; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.log 2>&1; tail -2 $OUT/test_gpu.log
PP="examples/train_pp_fsdp.py --schedule interleaved --steps 6 --microbatches 4"
t pp gpu fp64; timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $PP --pp 1 --device cuda --fp64 --count > $OUT/pp_gpu_fp64.log 2>&1; grep -E "^step|median|Error" $OUT/pp_gpu_fp64.log
t pp cpu fp64; timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $PP --pp 2 --device cpu --schedule 1f1b --fp64 > $OUT/pp_cpu_fp64.log 2>&1; grep -E "^step|Error" $OUT/pp_cpu_fp64.log
t pp gpu fp32 bigger; timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $PP --pp 1 --device cuda --dim 1024 --layers 8 --seq-len 512 --batch 32 > $OUT/pp_gpu_fp32.log 2>&1; grep -E "^step|median|Error" $OUT/pp_gpu_fp32.log | tail -3
t done
