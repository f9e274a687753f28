"""What `fit` checks and says of the labelled rows themselves: what cannot be fitted (refused)
and what will be rough, copies of one text kept in one fold and counted once, the rows the
figures stand on when `suggest` picked some, and labelled items the held-out head confidently
reads otherwise (likely label errors). No torch here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UsageError
from .data import Labelled


SUSPECTS_SHOWN = 5
CONFIDENT = 0.5  # a suspect's other answer is at least this probable (a weak head flags nothing it is unsure of)


def likely_errors(data: Labelled, probs: np.ndarray) -> list[dict[str, Any]]:
    """Labelled items the held-out head confidently answers otherwise (confident learning's
    idea): an item labelled i is suspect when another option j has a held-out probability at
    least j's own threshold (the mean held-out probability of j over the items labelled j), at
    least CONFIDENT, and above that of i. Most confident first, as {"id", "gold", "read_as", "probability"}."""
    k = probs.shape[1]
    thresholds = np.array([probs[data.gold == j, j].mean() if (data.gold == j).any() else 1.0 for j in range(k)])
    out = []
    for i in range(data.n):
        g = data.gold[i]
        over = [j for j in range(k)
                if j != g and probs[i, j] >= max(thresholds[j], CONFIDENT) and probs[i, j] > probs[i, g]]
        if over:
            j = max(over, key=lambda o: probs[i, o])
            out.append({"id": data.ids[i] if data.ids else str(i), "gold": data.options[g],
                        "read_as": data.options[j], "probability": round(float(probs[i, j]), 4)})
    return sorted(out, key=lambda s: -s["probability"])


def suspects_note(suspects: list[dict[str, Any]]) -> str:
    shown = "; ".join(f"{s['id']!r} labelled {s['gold']!r}, read as {s['read_as']!r} ({s['probability']:.2f})"
                      for s in suspects[:SUSPECTS_SHOWN])
    more = f" and {len(suspects) - SUSPECTS_SHOWN} more (the JSON's likely_errors)" if len(suspects) > SUSPECTS_SHOWN else ""
    return (f"{len(suspects)} labelled item{'s' if len(suspects) != 1 else ''} the held-out head confidently answers "
            f"otherwise, likely label errors to check: {shown}{more}")


MIN_RANDOM = 10  # rows drawn at random from which the figures stand on them alone


def representative(data: Labelled, rows: np.ndarray, notes: list[str]) -> np.ndarray:
    """Of `rows`, those the figures and the cut stand on: the rows drawn at random when some were
    picked by `suggest` (the least sure: estimates on them describe them, not the items the head
    will answer) and at least MIN_RANDOM were drawn at random; said in a note either way."""
    if data.picked is None or not data.picked[rows].any():
        return rows
    drawn = rows[~data.picked[rows]]
    picked = len(rows) - len(drawn)
    if len(drawn) >= MIN_RANDOM:
        notes.append(f"every held-out figure and cut stands on the {len(drawn)} rows drawn at random; the {picked} "
                     f"rows suggest picked (picked_by) train the head but are left out of them, since they are the "
                     f"hardest by construction")
        return drawn
    notes.append(f"{picked} of the {len(rows)} rows were picked by suggest (the hardest by construction) and only "
                 f"{len(drawn)} drawn at random: the figures stand on all of them and describe those rows, not the "
                 f"items the head will answer; label rows of `suggest --random` (at least {MIN_RANDOM})")
    return rows


def once_a_text(data: Labelled) -> np.ndarray:
    """One item of each text, in order (every item when no two share one): the first whose
    options were scored, else the first."""
    if data.groups is None:
        return np.arange(data.n)
    scored = np.ones(data.n, dtype=bool) if data.prompted is None else data.prompted
    order = np.lexsort((~scored, data.groups))  # by text, the scored first (a stable sort: then in order)
    _, first = np.unique(data.groups[order], return_index=True)
    return np.sort(order[first])


def fold_copies_together(data: Labelled, folds: int, notes: list[str]) -> int:
    """The folds to use when some items are copies of another's text (they share a fold), noted."""
    if data.groups is None or len(set(data.groups)) == data.n:
        return folds
    copies = data.n - len(set(data.groups))
    notes.append(f"{copies} labelled item{'s are copies' if copies != 1 else ' is a copy'} of another's text: each "
                 f"kept in one fold with it, so that no item is judged by a head fitted on its copy, and every "
                 f"held-out figure and cut counts each text once")
    return min(folds, len(set(data.groups)))


def check_counts(data: Labelled, folds: int) -> list[str]:
    """Refuse what cannot be fitted; say, in a line each, what will be rough."""
    counts = data.counts()
    if data.binary:
        if not any(counts.values()):
            raise UsageError(f"{data.qid}: no labelled item has any label on: a head needs items of each kind")
        return [f"label {o!r} is on for {n} of {data.n} labelled items: its head answers it "
                f"{'never' if n == 0 else 'always' if n == data.n else 'from very little'}"
                for o, n in counts.items() if n < 2 or n > data.n - 2]
    present = [o for o, n in counts.items() if n]
    if len(present) < 2:
        raise UsageError(f"{data.qid}: every labelled item has the gold {present[0]!r}: a head needs items of two "
                         f"options or more")
    notes = [f"{', '.join(repr(o) for o, n in counts.items() if not n)}: no labelled item, the head never answers "
             f"{'it' if sum(not n for n in counts.values()) == 1 else 'them'}"] if len(present) < len(counts) else []
    rare = [f"{o!r} ({n})" for o, n in counts.items() if 0 < n < folds]
    if rare:
        notes.append(f"fewer labelled items than folds ({folds}) for {', '.join(rare[:5])}"
                     f"{' and more' if len(rare) > 5 else ''}: those folds are fitted without them, so the "
                     f"held-out figures understate the head")
    return notes
