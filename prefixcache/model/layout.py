"""A batch laid out for one forward pass over a shared prefix: the prefilled prefix (`Prefix`),
and each row's own tokens then its candidates' trie, packed and as padded rows (`Layout`,
`layout`). What `engine.py` runs and `branches.py` extends with fed trie nodes; it runs no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .rows import Row, Trie, trie


@dataclass(frozen=True)
class Prefix:
    """The prefilled static prefix. `kv[layer] = (keys, values)`, each [1, kv_heads, P, head_dim]."""

    ids: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    last_logits: torch.Tensor  # [V], float32: scores what follows the prefix
    prefill_ms: float


@dataclass(frozen=True)
class Layout:
    """A batch laid out both packed ([T] tokens, no padding) and as right-aligned padded rows."""

    ids: torch.Tensor  # [T] packed token ids: per row its own tokens, then its trie nodes
    pos: torch.Tensor  # [T] position ids (continuing after the shared prefix)
    keep: torch.Tensor  # [R] packed indices whose logits are scored
    gather: torch.Tensor  # [B, W] packed index of each padded slot; T marks padding
    slots: torch.Tensor  # [T] flat padded index (b * W + w) of each packed token
    allowed: torch.Tensor  # [B, W, P + W] bool: may this slot attend to that prefix/own column
    term_rows: torch.Tensor  # [C] which kept logit row scores each candidate token
    term_toks: torch.Tensor  # [C] the candidate token scored there
    sizes: list[list[int]]  # per row, per candidate: its token count
    firsts: list[list[int]]  # per row, per candidate: the kept row its first scored token is read from
    owns: Sequence[tuple[int, int]] = ()  # per row, the packed span [start, end) of its own tokens (the item's)


def layout(prefix_len: int, rows: Sequence[Row]) -> Layout:
    """Lay a batch out for one forward pass over the shared prefix (P = `prefix_len` tokens).

    Each row contributes a segment: its own n tokens (the item after the prefix), then the m nodes
    of its candidates' trie (every proper prefix of a candidate, shared by the candidates that
    start with it; a candidate's last token is scored, never fed). Packed, the batch is the
    segments one after another, T tokens, no padding: that is what the linear layers see. Padded,
    each segment sits at the right end of a row of W slots (W: the longest segment), which is how
    attention reads it: `gather` maps slots to packed tokens, `slots` maps back.

    Example: P = 3, one row whose item tokens are [a, b] and whose candidates are (x, y) and (x, z).
    The trie has one node, x; the segment is a b x at positions 3 4 5. In the own part of the mask
    a sees a, b sees a b, x sees a b x (an item is causal; a node sees the item and its ancestors,
    never a sibling). Logits are kept at b (they score every candidate's first token, x) and at x
    (they score y and z), so `term_rows`/`term_toks` are (b, x), (x, y) for the first candidate
    and (b, x), (x, z) for the second; a candidate's log-prob is the sum over its terms. Only
    positions whose logits score some token are kept: a typed question's text is read, not scored,
    so no logits are computed over it (a row without candidates keeps its last token's).
    """
    tries = [trie(r.candidates) for r in rows]
    suffixes = [list(r.ids[r.prefix_len:]) for r in rows]
    lengths = [len(s) + len(t) for s, t in zip(suffixes, tries)]
    B, W, T = len(rows), max(lengths), sum(lengths)
    ids: list[int] = []
    pos: list[int] = []
    keep: list[int] = []
    term_rows: list[int] = []
    term_toks: list[int] = []
    sizes: list[list[int]] = []
    firsts: list[list[int]] = []
    owns: list[tuple[int, int]] = []
    gather = torch.full((B, W), T, dtype=torch.long)  # [B, W]; T marks padding
    allowed = torch.zeros(B, W, prefix_len + W, dtype=torch.bool)  # [B, W, P + W]
    for b, (row, suffix, t) in enumerate(zip(rows, suffixes, tries)):
        n, m, start = len(suffix), len(t), len(ids)
        off = W - n - m  # left padding of this row
        ids += suffix + t.tokens
        pos += list(range(row.prefix_len, row.prefix_len + n)) + [row.prefix_len + n + d - 1 for d in t.depths]
        gather[b, off:] = torch.arange(start, start + n + m)
        owns.append((start, start + n))
        allowed[b, :, :row.prefix_len] = True  # only the prefix ids this item shares
        _own_mask(allowed[b, :, prefix_len:], off, n, t)
        firsts.append(_terms(row, t, start + n, keep, term_rows, term_toks))
        sizes.append([len(c) - row.skip(i) for i, c in enumerate(row.candidates)])
    slots = torch.zeros(T, dtype=torch.long)  # [T]
    real = gather < T
    slots[gather[real]] = torch.arange(B * W).view(B, W)[real]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Layout(as_long(ids), as_long(pos), as_long(keep), gather, slots, allowed,
                  as_long(term_rows), as_long(term_toks), sizes, firsts, owns)


def _terms(row: Row, t: Trie, end: int, keep: list[int], term_rows: list[int], term_toks: list[int]) -> list[int]:
    """One row's scored tokens: each is read from the logits at the item's end (packed index
    `end - 1`) or at its trie node's, and only those positions are kept (a typed question's text
    is read, not scored: no logits there; a row without candidates keeps its end's). Returns,
    per candidate, the kept row its first scored token is read from (its answer position)."""
    kept: dict[int, int] = {}  # packed index -> kept row
    wanted = [end - 1] if not row.candidates else []  # a bare item (model/branches.py): the logits at its end
    starts = []  # per candidate, its first scored token's index in `wanted`
    for i, cand in enumerate(row.candidates):
        skip = row.skip(i)  # context ids before the scored ones: read (trie nodes), not scored
        starts.append(len(wanted))
        wanted += [end - 1 if k == 0 else end + t.paths[i][k - 1] for k in range(skip, len(cand))]
        term_toks += cand[skip:]
    rows = []
    for at in wanted:
        if at not in kept:
            kept[at] = len(keep)
            keep.append(at)
        rows.append(kept[at])
    if row.candidates:
        term_rows += rows
    return [rows[k] for k in starts]


def _own_mask(own: torch.Tensor, off: int, n: int, t: Trie) -> None:
    """Fill one row's [W, W] mask over its own slots: padding slots see themselves (never an
    all-masked row), the item's n tokens are causal, each trie node sees the whole item, itself
    and its ancestors (a node's row is its parent's plus itself: parents come first)."""
    own[range(off), range(off)] = True
    own[off: off + n, off: off + n] = torch.ones(n, n, dtype=torch.bool).tril()
    m = len(t)
    if not m:
        return
    own[off + n:, off: off + n] = True
    nodes = own[off + n:, off + n:]  # [m, m], the row's last m slots
    for k, parent in enumerate(t.parents):
        if parent >= 0:
            nodes[k] = nodes[parent]
        nodes[k, k] = True
