#!/usr/bin/env bash
# A/B of the tests whose engine gives up its ranks after a rank failed: before (HEAD~1's src, extracted to
# .scratch/before/src by `git archive b23fc32~1 src | tar -x -C .scratch/before`) against after (this branch's src),
# alternated ABAB after one unmeasured pass of each (numba compiles the before tree's kernels into its own cache).
# Run from the worktree root: bash docs/data/ci21/abandon_ab.sh > docs/data/ci21/abandon_ab.txt 2>&1
cd "$(dirname "$0")/../../.."
TESTS=(
  "tests/test_serve_controls.py::test_an_idle_rank_killed_is_503_naming_the_rank_its_pid_and_signal"
  "tests/test_serve_controls.py::test_a_rank_killed_under_a_step_is_a_503_and_the_ranks_restart"
  "tests/test_engine_hostile.py::test_a_step_that_raises_on_the_ranks_fails_its_requests_and_the_ranks_restart"
  "tests/test_serve.py::test_a_dead_rank_turns_health_to_503_and_the_server_exits_nonzero"
)
lscpu | grep "Model name"
for arm in before after before after before after; do
    src=$PWD/src; [ $arm = before ] && src=$PWD/.scratch/before/src
    echo "--- $arm start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$src python3 -m pytest -q -p no:cacheprovider --durations=0 "${TESTS[@]}" 2>&1 | grep -E "s (call|setup|teardown) |passed|failed"
done
