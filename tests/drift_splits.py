"""The figures of docs/unattended.md's drift section, measured again from outputs of `run`.

Given one output of a task (its records) and the input it was scored from, it splits the records
at random into a reference half and a current half, again and again, and counts how often
`prefixcache drift` (the library's `runs_tests`, at its default alpha) raises the alarm: for the
held-out half as it is (no drift: it should rarely fire), for the held-out half without the items of
its most common gold label (a label gone from the input mix), and for another task's items scored
by the same spec (`--other`). Prints a Markdown table.

    python tests/drift_splits.py runs/banking.jsonl data/samples/banking_intents.jsonl --gold intent \\
        --other runs/irony-as-banking.jsonl --splits 20

Nothing here is shipped with the package.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from prefixcache.data.output import read_records
from prefixcache.reports.drift import ALPHA, Drift, runs_tests


def alarm(before: list, after: list, alpha: float = ALPHA) -> tuple[bool, float]:
    drift = Drift("reference", "current", len(before), len(after), runs_tests(before, after), alpha=alpha)
    return drift.alarm, min(t.p for t in drift.tests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records")
    parser.add_argument("items")
    parser.add_argument("--gold", required=True, help="the items' field with the gold label")
    parser.add_argument("--other", help="another task's items scored by the same spec")
    parser.add_argument("--drop", type=int, nargs="+", default=[1],
                        help="take the items of this many most common gold labels out of the current half")
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = read_records(args.records, strict=True).records
    with open(args.items, encoding="utf-8") as stream:
        items = [json.loads(line) for line in stream if line.strip()]
    gold = {str(item["id"]): item[args.gold] for item in items}
    ranked = [label for label, _ in Counter(gold.values()).most_common()]
    dropped = {f"held-out half without its {k} most common gold label{'s' if k > 1 else ''} "
               f"({100 * sum(g in ranked[:k] for g in gold.values()) / len(gold):.0f}% of the items)": set(ranked[:k])
               for k in args.drop}
    other = read_records(args.other, strict=True).records if args.other else None
    rng = np.random.default_rng(args.seed)
    rows: dict[str, list] = {"held-out half": [], **{name: [] for name in dropped}, "another task's items": []}
    for _ in range(args.splits):
        order = rng.permutation(len(records))
        half = len(records) // 2
        reference, current = [records[i] for i in order[:half]], [records[i] for i in order[half:]]
        rows["held-out half"].append(alarm(reference, current))
        for name, labels in dropped.items():
            rows[name].append(alarm(reference, [r for r in current if gold.get(str(r["id"])) not in labels]))
        if other is not None:
            rows["another task's items"].append(alarm(reference, other))
    print(f"| current run ({len(records)} records, reference: a random half; {args.splits} splits) | alarms | "
          f"median least p |")
    print("|---|---|---|")
    for name, got in rows.items():
        if got:
            print(f"| {name} | {sum(a for a, _ in got)}/{len(got)} | {np.median([p for _, p in got]):.2g} |")


if __name__ == "__main__":
    main()
