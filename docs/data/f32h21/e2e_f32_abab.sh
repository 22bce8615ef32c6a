#!/bin/bash
# ABAB: `treeattn generate` SmolLM2, 4,084-token prompt (random_ids_4084.json beside this script: intel50's, seed 0),
# ${TOKENS:-32} greedy tokens, packed weights, float16 KV, float32 activations (the exact path), 1 and 2 ranks, ROUNDS rounds.
# A = main 3e3694a (git archive into /tmp/f32h21/base/src), B = branch f32h21 (/work/wt/f32h21/src). Both numba caches
# warmed first (a 3-token generate each). Prints ms a token (mean and steady median) and the tokens, per run.
M=$(PYTHONPATH=/work/wt/f32h21/src treeattn models --path smollm2)
for nproc in 1 2; do
  for round in $(seq 1 ${ROUNDS:-2}); do
    for ab in A B; do
      if [ $ab = A ]; then S=/tmp/f32h21/base/src; else S=/work/wt/f32h21/src; fi
      L=$(cut -d' ' -f1 /proc/loadavg)
      PYTHONPATH=$S python3 -m treeattn.cli generate $M --prompt-ids /work/wt/f32h21/docs/data/f32h21/random_ids_4084.json --max-new-tokens ${TOKENS:-32} --ignore-eos \
        --nproc $nproc --weight-format packed --kv-cache-dtype float16 --activation-format float32 --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin); t = r['timings']; st = sorted(t['step_times_s'][1:])
print(json.dumps({'ab': '$ab', 'nproc': $nproc, 'round': $round, 'load_before': $L, 'ms_per_token': round(1e3 * t['time_per_token_s'], 2),
                  'ms_steady': round(1e3 * st[len(st) // 2], 2), 'tokens': r['generated_ids']}))"
    done
  done
done
