#!/usr/bin/env bash
# Kafka (confluent-kafka) throughput of two checkouts, alternating, ROUNDS runs a side:
#   bench/before_after_kafka.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR
# Each checkout needs its own .venv (scripts/setup there). Output: OUT_DIR/bench_kafka-
# {before,after}-N.txt, each starting with the load average; compare medians of the rows.
set -euo pipefail
before=$1 after=$2 out=$3
mkdir -p "$out"
for i in $(seq 1 "${ROUNDS:-3}"); do
  for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$after
    file="$out/bench_kafka-$side-$i.txt"
    echo "load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)" >"$file"
    (cd "$dir" && .venv/bin/python bench/bench_kafka.py --n 50000 --rounds 3 \
        --only publish --only columns --only consume --only many --clients confluent \
        2>&1 | grep -v '^%' >>"$file")
  done
done
