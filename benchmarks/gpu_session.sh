#!/bin/bash
# Every GPU check of this project in one command, for a lent GPU machine (device tool: `bash
# benchmarks/gpu_session.sh`, about 5 minutes on an H200). Writes its logs under $OUT (or ./gpu-out).
# What each part checks: docs/reliability.md ("On a GPU"), docs/benchmarks.md ("On a GPU").
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/examples PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
t info; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
t test_gpu; timeout 120 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py > $OUT/test_gpu.log 2>&1
grep -E "^(FAILED|E  )|passed|failed" $OUT/test_gpu.log | head -30
t test_gpu under CSAN; TORCH_CUDA_SANITIZER=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "not plan" > $OUT/test_gpu_csan.log 2>&1; tail -3 $OUT/test_gpu_csan.log
t loops under CSAN; TORCH_CUDA_SANITIZER=1 timeout 90 python3 benchmarks/gpu_checks.py loops > $OUT/loops_csan.log 2>&1; grep -E " ok|WRONG|RAISED|clean" $OUT/loops_csan.log
t injected bug under CSAN, must be reported; TORCH_CUDA_SANITIZER=1 timeout 60 python3 benchmarks/gpu_checks.py loops --inject > $OUT/inject_csan.log 2>&1; grep -c "CSAN detected" $OUT/inject_csan.log
t snapshot; timeout 60 python3 benchmarks/gpu_checks.py snapshot $OUT/snapshot.pickle 2>&1 | tail -4
t phases; timeout 150 python3 benchmarks/gpu_checks.py phases 2>&1 | tail -3
t bench 1B bf16; timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_step.py --device cuda --model llama --dim 2048 --layers 22 --heads 16 --vocab 32000 --seq-len 2048 --batch 4 --param-dtype bf16 --rounds 4 --steps-per-round 2 --warmup 1 --memory-repeats 3 --out $OUT/gpu-world1.md > $OUT/bench.log 2>&1; tail -4 $OUT/bench.log
t done
