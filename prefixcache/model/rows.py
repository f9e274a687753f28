"""What the engine scores: rows of prompt ids, each with candidate continuations, and the token
trie the candidates share. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Candidate = tuple[int, ...]
Node = tuple[int, ...]  # a candidate prefix: the trie node of its last token (pruned scoring feeds nodes)


@dataclass(frozen=True)
class Row:
    """One item to score: its prompt ids, how many lead ids are the cached prefix, its candidates,
    and per candidate how many of its leading ids are context, read but not scored (a typed
    question's text before its option: empty, every id is scored)."""

    ids: Sequence[int]
    prefix_len: int
    candidates: Sequence[Candidate]
    skips: Sequence[int] = ()

    def skip(self, i: int) -> int:
        return self.skips[i] if self.skips else 0


@dataclass(frozen=True)
class Probe:
    """What a forward reads besides scores: per layer in `layers` (None: the final state, after the
    last norm, what the lm_head reads; i >= 1: the residual stream after decoder layer i), the
    state at each wanted answer position and, with `mean`, the mean over the row's own tokens (its
    ids after the shared prefix: the item's prompt, never a candidate)."""

    layers: tuple[int | None, ...] = (None,)
    mean: bool = False

    @property
    def plain(self) -> bool:
        """Only the final state at answer positions: what every engine reads."""
        return self.layers == (None,) and not self.mean


@dataclass(frozen=True)
class Trie:
    """Nodes for every proper prefix (length >= 1) of some candidates, parents before children.
    A candidate's last token needs no node: it is scored, never attended to."""

    tokens: list[int]  # the node's token
    parents: list[int]  # parent node, or -1 for a node right after the item
    depths: list[int]  # 1 for a candidate's first token
    paths: list[list[int]]  # per candidate, the nodes of its proper prefixes (cand[:1], cand[:2], ...)

    def __len__(self) -> int:
        return len(self.tokens)


def trie(candidates: Sequence[Candidate]) -> Trie:
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    paths: list[list[int]] = []
    previous: Sequence[int] = ()
    for cand in candidates:
        # A candidate's nodes up to what it shares with the one before are that one's (candidates
        # after one long question stem share thousands of tokens: walked once, not once each).
        shared = _common_length(previous, cand, min(len(cand), len(previous)) - 1)
        path, node = paths[-1][:shared] if shared else [], paths[-1][shared - 1] if shared else -1
        previous = cand
        for depth, tok in enumerate(cand[shared:-1], start=shared + 1):
            key = (node, tok)
            if key not in child:
                child[key] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depths.append(depth)
            node = child[key]
            path.append(node)
        paths.append(path)
    return Trie(tokens, parents, depths, paths)


def _common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading ids `a` and `b` share, at most `limit` (compared by slices: in C)."""
    low, high = 0, max(0, min(len(a), len(b), limit))
    if high and a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low], a[:high + 1] != b[:high + 1]
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
