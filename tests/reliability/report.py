"""Render the reliability table of ``docs/reliability.md`` from the suite's JSON lines.

    MQ_RELIABILITY_REPORT=rel.jsonl pytest tests/reliability
    python -m tests.reliability.report rel.jsonl      # prints the markdown table

One row per (scenario, backend); repeated runs of a scenario are summed.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

ORDER = ("memory", "sqlite", "rabbitmq", "kafka", "kafka-python", "sqs")
COLUMNS = ("kills", "confirmed", "in_flight", "delivered", "duplicates", "dead_lettered",
           "lost", "ack_in_doubt", "lost_by_dev_broker", "problems")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table summing the numeric columns per (scenario, backend)."""
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        key = (row["scenario"], row["backend"])
        cell = sums[key]
        cell["runs"] += 1
        for col in (*COLUMNS, "messages", "examples", "inputs", "accepted", "rejected",
                    "poison"):
            if isinstance(row.get(col), int):
                cell[col] += row[col]
        if "lost" not in row and "lost" in row.get("skipped_rules", ()):
            cell.setdefault("lost_unjudged", 1)
    lines = [
        "| scenario | backend | injected | messages | delivered | duplicates | dead-lettered "
        "| lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (scenario, backend), c in sorted(
        sums.items(), key=lambda kv: (kv[0][0], ORDER.index(kv[0][1]) if kv[0][1] in ORDER
                                      else 99)
    ):
        if "inputs" in c:
            injected = f"{c['inputs']} fuzzed inputs ({c['rejected']} rejected)"
            messages = str(c["accepted"])
        elif "examples" in c:
            injected = f"{c['examples']} generated sequences"
            messages = str(c["messages"])
        else:
            injected = f"{c['kills']} x {scenario}"
            if c.get("poison"):
                injected = f"{c['poison']} poison messages"
                if c.get("kills"):
                    injected += f", {c['kills']} consumer crashes"
            messages = str(c["confirmed"])
            if c.get("in_flight"):
                messages += f" (+{c['in_flight']} in flight)"
        lost = str(c.get("lost", 0))
        if c.get("lost_unjudged") and "lost" not in c:  # every run skipped the rule
            lost = "not judged (the scenario says why)"
        if c.get("ack_in_doubt"):
            lost += (f" ({c['ack_in_doubt']} acked by a consumer killed inside ack(): "
                     "not redelivered, in doubt)")
        if c.get("lost_by_dev_broker"):
            lost += f" (+{c['lost_by_dev_broker']} wiped by the non-durable dev broker)"
        if c.get("problems"):
            lost += f" — **{c['problems']} invariant violation(s)**"
        lines.append(
            f"| {scenario} | {backend} | {injected} | {messages} | {c.get('delivered', '—')} "
            f"| {c.get('duplicates', '—')} | {c.get('dead_lettered', c.get('dead', '—'))} "
            f"| {lost} |"
        )
    return "\n".join(lines)


def freeze_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the SIGSTOP scenario: when a frozen holder's messages came back."""
    lines = ["| backend | lease (s) | came back after (s) | declared margin (s) | runs |",
             "|---|---|---|---|---|"]
    took: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if "took" in row:
            took[row["backend"]].append(row)
    for backend in sorted(took, key=lambda b: ORDER.index(b) if b in ORDER else 99):
        runs = took[backend]
        worst = max(r["took"] for r in runs)
        lines.append(f"| {backend} | {runs[0]['lease']} | {worst} (worst) | "
                     f"{runs[0]['margin']} | {len(runs)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print(table(rows))
    if any("took" in row for row in rows):
        print()
        print(freeze_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
