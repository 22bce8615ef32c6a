#!/bin/bash
# ABAB: `treeattn generate` SmolLM2, 4,084-token prompt (4,084 random ids, seed 0: random_ids_4084.json beside this script),
# ${TOKENS:-16} greedy tokens (ROUNDS, TOKENS from the environment), packed weights, float16 KV, float32 activations (the exact path), 1 and 2 ranks.
# A = main 3c412ea (/tmp/intel50_base/src), B = branch intel50. Prints ms a token (mean and steady median), tokens.
M=$(PYTHONPATH=/work/wt/intel50/src treeattn models --path smollm2)
for nproc in 1 2; do
  for round in $(seq 1 ${ROUNDS:-2}); do
    for ab in A B; do
      if [ $ab = A ]; then S=/tmp/intel50_base/src; else S=/work/wt/intel50/src; fi
      L=$(cut -d' ' -f1 /proc/loadavg)
      PYTHONPATH=$S python3 -m treeattn.cli generate $M --prompt-ids /work/wt/intel50/docs/data/intel50/random_ids_4084.json --max-new-tokens ${TOKENS:-16} --ignore-eos \
        --nproc $nproc --weight-format packed --kv-cache-dtype float16 --activation-format float32 --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin); t = r['timings']; st = sorted(t['step_times_s'][1:])
print(json.dumps({'ab': '$ab', 'nproc': $nproc, 'round': $round, 'load_before': $L, 'ms_per_token': round(1e3 * t['time_per_token_s'], 2),
                  'ms_steady': round(1e3 * st[len(st) // 2], 2), 'tokens': r['generated_ids']}))"
    done
  done
done
