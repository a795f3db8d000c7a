#!/usr/bin/env bash
# Hot-path benches of two checkouts side by side, alternating, ROUNDS rounds each:
#   bench/before_after.sh BEFORE_DIR [AFTER_DIR] [OUT_DIR]
# BEFORE_DIR/AFTER_DIR: checkouts with their own .venv (git worktree add ...; AFTER_DIR
# defaults to this checkout). Brokers: the ones `scripts/brokers up rabbitmq kafka sqs` of
# this checkout started. Output: OUT_DIR/<bench>-<before|after>-<round>.txt, one line per run
# on stdout. BENCHES and ROUNDS (default 3) may be set in the environment.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
before=$(cd "$1" && pwd); after=$(cd "${2:-$here}" && pwd); out=${3:-$PWD/before-after}
mkdir -p "$out"
eval "$("$here/scripts/brokers" env rabbitmq kafka sqs)"
declare -A ARGS=(
  [bench_memory]="--cycles 100000 --deep 200000"
  [bench_sqlite]="--n 20000"
  [bench_rabbitmq]="--url $MQ_TEST_RABBITMQ_URL --n 10000 --single 1000"
  [bench_kafka]="--url $MQ_TEST_KAFKA_URL --n 20000 --rounds 1 --single 1000"
  [bench_sqs]="--url $MQ_TEST_SQS_URL -n 200 --rounds 2"
)
for b in ${BENCHES:-bench_memory bench_sqlite bench_rabbitmq bench_kafka bench_sqs}; do
  for r in $(seq "${ROUNDS:-3}"); do
    for side in before after; do
      dir=$before; [ "$side" = after ] && dir=$after
      t0=$SECONDS
      (cd "$dir" && .venv/bin/python "bench/$b.py" ${ARGS[$b]}) > "$out/$b-$side-$r.txt" 2>&1
      echo "$b $side $r rc=$? $((SECONDS-t0))s"
    done
  done
done
