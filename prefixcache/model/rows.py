"""What the engine scores: rows of prompt ids, each with candidate continuations, and the token
trie the candidates share. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Candidate = tuple[int, ...]


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
class Trie:
    """Nodes for every proper prefix (length >= 1) of some candidates, parents before children.
    A candidate's last token needs no node: it is scored, never attended to."""

    tokens: list[int]  # the node's token
    parents: list[int]  # parent node, or -1 for a node right after the item
    depths: list[int]  # 1 for a candidate's first token
    index: dict[Candidate, int]  # candidate prefix -> its node

    def __len__(self) -> int:
        return len(self.tokens)


def trie(candidates: Sequence[Candidate]) -> Trie:
    index: dict[Candidate, int] = {}
    tokens, parents, depths = [], [], []
    for cand in candidates:
        for k in range(1, len(cand)):
            key = cand[:k]
            if key in index:
                continue
            index[key] = len(tokens)
            tokens.append(key[-1])
            parents.append(index[key[:-1]] if k > 1 else -1)
            depths.append(k)
    return Trie(tokens, parents, depths, index)
