"""Items first, branches later: scoring only some of an item's candidates, after seeing its
first-token scores, without running the item through the model again. Used by pruned scoring
(scoring/pruning.py).

`open_items` runs a batch's items (their own tokens after the shared prefix) through the model
once, keeping every layer's keys and values of those tokens and the log-probabilities of the next
token at each item's end. `OpenItems.feed` then runs chosen trie nodes of chosen items (candidate
prefixes) through the model, attending to the prefix, to the kept keys of their item and to their
own ancestors, exactly the attention of a full scoring pass; their keys and values are kept in
turn, so a race that goes one token deeper per pass runs every node once, never an ancestor
again. Needs the shared-prefix kernel ("shared" backend) and full attention (no sliding window);
`Engine.branches` says whether an engine has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .layout import Layout, Prefix, layout
from .rows import Node, Row


@dataclass
class OpenItems:
    """A batch's items, run once, then trie nodes fed as a race asks. `first[b]`: log-probabilities
    [V] of the token after item b. `kept`: per layer, the keys and values of every token run so
    far (the items' own, then each fed node), [1, Hkv, T, D]; `fed[b]`: item b's fed nodes and
    their index in `kept`, so that no node ever goes through the model twice."""

    engine: Any  # the model/engine.py Engine that opened them (its forward runs the fed nodes)
    prefix: Prefix
    rows: Sequence[Row]
    starts: list[int]  # packed index of each item's first own token
    kept: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    first: torch.Tensor  # [B, V] float32 log-probabilities
    fed: list[dict[Node, int]] = field(default_factory=list)
    nexts: list[dict[Node, set[int]]] = field(default_factory=list)  # per item: node -> its children's tokens

    def __post_init__(self) -> None:
        self.fed = [{} for _ in self.rows]
        self.nexts = []
        for row in self.rows:
            nexts: dict[Node, set[int]] = {}
            previous: Node = ()
            for cand in map(tuple, row.candidates):
                # the prefixes shared with the previous candidate (a question's text) are in already
                shared = next((k for k, (x, y) in enumerate(zip(cand, previous)) if x != y), min(len(cand), len(previous)))
                for k in range(min(shared, len(cand) - 1), len(cand)):
                    nexts.setdefault(cand[:k], set()).add(cand[k])
                previous = cand
            self.nexts.append(nexts)

    def firsts(self, b: int) -> dict[Node, float]:
        """Item b's candidates' first tokens (the nodes right after the item) and their log-probs."""
        return {(tok,): float(self.first[b, tok]) for tok in self.nexts[b].get((), ())}

    @torch.inference_mode()
    def feed(self, nodes: dict[int, Sequence[Node]]) -> dict[int, dict[Node, float]]:
        """Run the named nodes of the named items (with their ancestors not fed yet) through the
        model in one forward pass, each attending to the prefix, its item and its ancestors:
        exactly its attention in a full scoring pass. Returns, per item, every child of a fed node
        (a candidate prefix one token longer) and the log-probability of its last token there."""
        todo: dict[int, list[Node]] = {}
        for b, wanted in nodes.items():
            new: dict[Node, None] = {}
            for node in wanted:  # the node and its ancestors up to the first one fed (whose are fed too)
                node = tuple(node)
                while node and node not in self.fed[b] and node not in new:
                    new[node] = None
                    node = node[:-1]
            if new:
                todo[b] = sorted(new, key=len)  # parents before children
        if not todo:
            return {}
        lay, key_gather = self._layout(todo)
        capture: dict = {}
        logits = self.engine.forward_shared(self.prefix, lay, capture=capture, carried=self.kept,
                                            key_gather=key_gather.to(self.engine.device))
        self.engine.label_tokens += len(lay.ids)
        T1 = self.kept[0][0].shape[2]
        self.kept = tuple((torch.cat([k, capture[i][0]], dim=2), torch.cat([v, capture[i][1]], dim=2))
                          for i, (k, v) in enumerate(self.kept))
        rows_, toks, children, at = [], [], [], 0
        for b, fresh in todo.items():
            for node in fresh:
                self.fed[b][node] = T1 + at
                for tok in sorted(self.nexts[b].get(node, ())):
                    rows_.append(at)
                    toks.append(tok)
                    children.append((b, node + (tok,)))
                at += 1
        lse = torch.logsumexp(logits.float(), dim=-1)
        rows_t, toks_t = torch.tensor(rows_, dtype=torch.long), torch.tensor(toks, dtype=torch.long)
        picked = (logits[rows_t.to(logits.device), toks_t.to(logits.device)].float() - lse[rows_t.to(lse.device)]).tolist()
        out: dict[int, dict[Node, float]] = {b: {} for b in todo}
        for (b, child), value in zip(children, picked):
            out[b][child] = value
        return out

    def _fed_ancestors(self, b: int, new: Sequence[Node]) -> list[Node]:
        """The nodes already fed that the new nodes descend from, parents first."""
        found: dict[Node, None] = {}
        for node in new:
            node = node[:-1]
            while node and node in self.fed[b] and node not in found:
                found[node] = None
                node = node[:-1]
        return sorted(found, key=len)

    def _layout(self, todo: dict[int, list[Node]]) -> tuple[Layout, torch.Tensor]:
        """The new nodes laid out as `engine.layout` lays out rows, queries being the new nodes
        only, keys the row's kept item tokens, its kept ancestors, then its new nodes (indices
        into kept + new: T1 + packed index). Returns the layout and the key gather [B, Wk]."""
        P, order, T1 = len(self.prefix.ids), list(todo), self.kept[0][0].shape[2]
        own = [len(self.rows[b].ids) - self.rows[b].prefix_len for b in order]
        olds = [self._fed_ancestors(b, todo[b]) for b in order]
        Wq = max(len(todo[b]) for b in order)
        Wk = max(n + len(old) + len(todo[b]) for b, n, old in zip(order, own, olds))
        B, T2 = len(order), sum(len(todo[b]) for b in order)
        ids: list[int] = []
        pos: list[int] = []
        gather = torch.full((B, Wq), T2, dtype=torch.long)
        key_gather = torch.zeros(B, Wk, dtype=torch.long)
        allowed = torch.zeros(B, Wq, P + Wk, dtype=torch.bool)
        for r, (b, n, old) in enumerate(zip(order, own, olds)):
            row, new, start = self.rows[b], todo[b], len(ids)
            m = len(new)
            offq, offk = Wq - m, Wk - n - len(old) - m
            ids += [node[-1] for node in new]
            pos += [row.prefix_len + n + len(node) - 1 for node in new]
            gather[r, offq:] = torch.arange(start, start + m)
            key_gather[r, offk: offk + n] = torch.arange(self.starts[b], self.starts[b] + n)
            key_gather[r, offk + n: offk + n + len(old)] = torch.tensor([self.fed[b][node] for node in old], dtype=torch.long)
            key_gather[r, offk + n + len(old):] = torch.arange(T1 + start, T1 + start + m)
            seen: dict[Node, list[int]] = {(): []}  # node -> the key columns of its ancestors and itself
            for j, node in enumerate(old + new):  # parents come first
                seen[node] = seen[node[:-1]] + [P + offk + n + j]
            allowed[r, :, :row.prefix_len] = True
            allowed[r, :offq, P + offk] = True  # padding queries see one key (never an all-masked row)
            allowed[r, offq:, P + offk: P + offk + n] = True  # the whole item
            for j, node in enumerate(new):
                allowed[r, offq + j, seen[node]] = True
        slots = torch.zeros(T2, dtype=torch.long)
        real = gather < T2
        slots[gather[real]] = torch.arange(B * Wq).view(B, Wq)[real]
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        empty = as_long([])
        return Layout(as_long(ids), as_long(pos), torch.arange(T2), gather, slots, allowed, empty, empty, [], []), key_gather


@torch.inference_mode()
def open_items(engine: Any, prefix: Prefix, rows: Sequence[Row]) -> OpenItems:
    """Run the rows' own tokens once (their candidates are ignored), keeping their keys and
    values and the next-token log-probabilities at each item's end."""
    bare = [Row(r.ids, r.prefix_len, ()) for r in rows]
    lay = layout(len(prefix.ids), bare)
    capture: dict = {}
    logits = engine.forward_shared(prefix, lay, capture=capture)  # [B, V]: each item's last token
    kept = tuple(capture[layer] for layer in range(len(capture)))
    starts, at = [], 0
    for r in rows:
        starts.append(at)
        at += len(r.ids) - r.prefix_len
    return OpenItems(engine, prefix, rows, starts, kept, torch.log_softmax(logits.float(), dim=-1))
