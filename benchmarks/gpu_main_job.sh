#!/bin/bash
# The GPU sections of issues #26 and #25 in one command, for a lent GPU machine (device tool:
# `bash benchmarks/gpu_main_job.sh`, about 8 minutes on an H200). Logs and the main job's outputs
# go under $OUT (or ./gpu-out); DRILL_ONLY=1: only the restart drill (about 2 minutes). What each
# part shows: docs/fault_tolerance.md, docs/training.md.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/examples PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "=== [$(( $(date +%s) - S ))s] $*"; }
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 1"
R=/tmp/gpu-main-job; rm -rf $R; mkdir -p $R
D="--steps 30 --ckpt-every 10 --eval-every 30 --eval-batches 2 --samples 0 --log-every 10 --max-bytes 4000000"
{
t info; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
t "#26: uninterrupted run, NCCL, world 1, deterministic kernels"
timeout 120 $TR examples/train.py --out $R/whole $D --deterministic 2>&1 | grep -v "^W1\|^\*\*" | tail -4
t "#26: the same, its only worker SIGKILLed in step 25's backward, torchrun --max-restarts 1"
timeout 150 $TR --max-restarts 1 --monitor-interval 0.1 examples/train.py --out $R/hurt $D --deterministic \
  --kill-at-step 25 --kill-rank 0 2>&1 | grep -E "fault:|resumed|restart|Error|error" | head -8
t "#26: two uninterrupted runs with the default (nondeterministic) kernels"
for i in 1 2; do timeout 120 $TR examples/train.py --out $R/nd$i $D 2>&1 | grep -E "Error|error" | head -3; done
python3 - $R <<'PY'
import json, sys
def losses(name):
    try:
        return [c["loss"] for c in json.load(open(f"{sys.argv[1]}/{name}/metrics.json"))["curve"]]
    except OSError as e:
        return str(e)
def same(a, b):
    x, y = losses(a), losses(b)
    if isinstance(x, str) or isinstance(y, str):
        return f"MISSING ({x if isinstance(x, str) else y})"
    first = next((i + 1 for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
    return (f"{len(x)} and {len(y)} steps, " + ("bit-identical" if first is None and len(x) == len(y) else
            f"DIFFER from step {first}: {x[first - 1]!r} vs {y[first - 1]!r}" if first else "lengths differ"))
print("deterministic, uninterrupted vs killed+restarted:", same("whole", "hurt"))
print("default kernels, run 1 vs run 2:", same("nd1", "nd2"))
print("deterministic vs default kernels:", same("whole", "nd1"))
PY
if [ -z "$DRILL_ONLY" ]; then
t "#26: checkpoint save/load of the 1.1B Llama in bf16"
timeout 240 $TR benchmarks/ckpt_time.py --device cuda --rounds 3 --dir $R/ckpt1b 2>&1 | grep -v "^W1\|^\*\*"
fi
} > $OUT/session.log 2>&1
[ -n "$DRILL_ONLY" ] && { cat $OUT/session.log; exit 0; }
LEFT=$(( 470 - ($(date +%s) - S) )); MT=${MAIN_TIMEOUT:-$(( LEFT < 300 ? LEFT : 300 ))}
t "#25: the main job, gpu preset (timeout $MT s: SIGTERM -> checkpoint + metrics)" >> $OUT/session.log
timeout $MT $TR examples/train.py --out $OUT/main --ckpt $R/mainckpt > $OUT/main.log 2>&1
echo "main job exit $?" >> $OUT/session.log; t done >> $OUT/session.log
cat $OUT/session.log; grep -v "^W1" $OUT/main.log | tail -40
