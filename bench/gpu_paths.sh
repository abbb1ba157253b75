#!/bin/bash
# The CUDA paths bench/gpu_validate.py does not take, one after the other, each with the
# end of its output unfiltered: checkpoints (sync, then async with pinned staging),
# continued to more steps; the fine-tune example on one GPU (Hugging Face load, packing,
# export); the doctor's smoke and memory checks. About 2 minutes on one H200.
#   bash bench/gpu_paths.sh            (from the repository root, trainwise importable)
# Known open finding (first run, torch 2.11, one H200): the async run committed its
# saves of steps 5 and 10 and then ended without its summary; cause not yet seen.
set -u
ROOT=$PWD
WORK=$(mktemp -d -t gpu-paths-XXXX)
G=(--set 'model.name="gpt2-124m"' --set data.micro_batch=8 --set data.seq_len=1024
   --set 'precision.dtype="bf16"' --set 'cluster.device="cuda"' --set 'logging.progress="none"'
   --set train.eval_every=0 --set checkpoint.interval=5)
saves() {  # the checkpoint events of a run: step, stall, whole save, size, async
  python3 -c "import json,sys
for e in map(json.loads, open(sys.argv[1] + '/events.jsonl')):
    if e['kind'] in ('checkpoint', 'checkpoint_failed', 'failure', 'finish'):
        print(' ', {k: e[k] for k in e if k in ('kind', 'step', 'stall_s', 'save_s', 'async_save', 'message')})" "$1"
}
cd "$WORK" || exit 1
for mode in false true; do
  echo "== gpt2-124m, 15 steps, checkpoint.async=$mode, then continued to 20"
  timeout 200 python3 -m trainwise train --steps 15 "${G[@]}" --set checkpoint.async=$mode \
    --run-dir "ck-$mode" 2>&1 | tail -12; echo "  exit ${PIPESTATUS[0]}"
  timeout 200 python3 -m trainwise train --steps 20 "${G[@]}" --set checkpoint.async=$mode \
    --run-dir "ck-$mode" 2>&1 | tail -6; echo "  exit ${PIPESTATUS[0]}"
  saves "ck-$mode"
done
echo "== the fine-tune example on one GPU (60 steps)"
timeout 240 python3 "$ROOT/examples/finetune/run.py" --out "$WORK/ft" --nproc 1 --steps 60 2>&1 | tail -5
echo "== doctor: smoke and memory"
timeout 150 python3 -m trainwise doctor --only smoke,memory --set 'cluster.device="cuda"' 2>&1 | tail -8
