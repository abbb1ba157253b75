#!/bin/bash
# The CUDA paths bench/gpu_validate.py does not take, one after the other, each with the
# end of its output unfiltered: checkpoints (sync, then async with pinned staging),
# continued to more steps; the non-finite guard's CUDA path (a NaN at step 6 skipped on the
# device, its verdict copied to pinned memory and read a step later: run/engine/guard.py)
# and what that saves against a host read (bench/optimizer_step.py --device cuda); the
# fine-tune example on one GPU (Hugging Face load, packing, export); the doctor's smoke and
# memory checks. About 3 minutes on one H200.
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
echo "== the non-finite guard on CUDA: NaN at step 6, train.nonfinite=skip, 10 steps"
TRAINWISE_FAULTS="nan@step=6" timeout 200 python3 -m trainwise train --steps 10 "${G[@]}" \
  --set 'train.nonfinite="skip"' --run-dir guard 2>&1 | tail -4; echo "  exit ${PIPESTATUS[0]}"
python3 -c "import json, math, sys
run = sys.argv[1]
skipped = [e['step'] for e in map(json.loads, open(run + '/events.jsonl')) if e['kind'] == 'nonfinite']
loss = {r['step']: r['loss'] for r in map(json.loads, open(run + '/metrics.jsonl')) if 'loss' in r}
bad = sorted(s for s, v in loss.items() if not math.isfinite(v))
ok = skipped == [6] and bad == [6] and sorted(loss) == list(range(1, 11))
print('  guard', 'OK' if ok else 'WRONG', {'skipped': skipped, 'non-finite losses': bad, 'steps': len(loss)})" guard
echo "== AdamW's step and the guard's two ways on CUDA (bench/optimizer_step.py)"
timeout 200 python3 "$ROOT/bench/optimizer_step.py" --device cuda --models small,gpt2-124m --rounds 5 2>&1 | tail -9
echo "== the fine-tune example on one GPU (60 steps)"
timeout 240 python3 "$ROOT/examples/finetune/run.py" --out "$WORK/ft" --nproc 1 --steps 60 2>&1 | tail -5
echo "== doctor: smoke and memory"
timeout 150 python3 -m trainwise doctor --only smoke,memory --set 'cluster.device="cuda"' 2>&1 | tail -8
