"""Items first, branches later, on llama.cpp: what model/branches.py does for the transformers
engine, built from llama.cpp's sequences. Used by pruned scoring (scoring/pruning.py) through
`LlamaEngine.open_items`.

A group of rows is decoded once, each row's own tokens in a sequence of its own (the prefix cells
it shares tagged with it), and kept in the context's cells. Trie nodes are fed later, parents
first, each at the position full scoring gives it, each attending through its own sequence:
- a node's first child fed continues its parent's sequence (the chain already sees the prefix,
  the row and every ancestor; the child comes after them);
- any other child gets a new sequence, with which the prefix, the row's own tokens and its
  ancestors are tagged (`seq_cp` on the kept cells, no copy; an ancestor fed in the same decode
  carries it instead).
llama.cpp's mask reads a token's first sequence: a node carries its own first, then those of its
descendants fed in the same decode. So a node sees the prefix, its row and its ancestors, never a
sibling or another row: the attention of the full scoring decode. A race then holds about one
sequence per candidate it scores beyond the first token, not one per leaf of every trie, so a
decode holds many rows. Where the 255 sequences of a context run short, rows the feed does not
ask for are let go first, then rows of the feed; a row let go is decoded again (its own tokens
and the nodes fed before) when it is next fed.

Knows nothing of specs or races; llama_cpp is reached through the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .llamatoken import Token
from .rows import Node, Row, Trie


@dataclass
class _Kept:
    """A row's cells in the context: its own tokens' sequence, each fed node's sequence, and the
    nodes (() the row's end) whose sequence a child has continued."""

    base: int
    seq: dict[Node, int] = field(default_factory=dict)
    continued: set[Node] = field(default_factory=set)


class LlamaOpenItems:
    """A group of rows decoded once and kept (see the module's doc). `rows`: the group's rows;
    `most`: the most sequences one row has held at once (what the engine sizes its next group by)."""

    def __init__(self, engine: Any, rows: Sequence[Row], tries: Sequence[Trie], sequences: int):
        self.engine, self.rows = engine, list(rows)
        self._free = list(range(sequences - 1, 0, -1))  # sequence ids not in use (0 is the prefix's)
        self._kept: list[_Kept | None] = []
        self._fed: list[set[Node]] = [set() for _ in rows]  # every node fed, kept or let go
        keys = [_node_keys(t) for t in tries]
        self._valid = [set(k) for k in keys]
        self._nexts = [_children(row, t, k) for row, t, k in zip(rows, tries, keys)]
        self._own = [[int(i) for i in row.ids[row.prefix_len:]] for row in rows]
        self.most = 1
        tokens: list[Token] = []
        ends: list[int] = []
        for b, row in enumerate(self.rows):
            base = self._take(row.prefix_len)
            self._kept.append(_Kept(base))
            tokens += [Token(tok, row.prefix_len + k, [base], k == len(self._own[b]) - 1)
                       for k, tok in enumerate(self._own[b])]
            ends.append(len(tokens) - 1)
        engine.decode(tokens)
        self._first = [self._scored(at, self._nexts[b].get((), ()), ()) for b, at in enumerate(ends)]

    def firsts(self, b: int) -> dict[Node, float]:
        """Row b's candidates' first tokens (the nodes right after the row) and their log-probs."""
        return dict(self._first[b])

    def feed(self, nodes: dict[int, Sequence[Node]]) -> dict[int, dict[Node, float]]:
        """Decode the named nodes of the named rows (with their ancestors not fed yet, parents
        first), in as few decodes as the context's sequences allow (one, unless they run short);
        per row, every child of a fed node and the log-probability of its last token there."""
        new = {b: found for b, found in ((b, self._new(b, wanted)) for b, wanted in nodes.items()) if found}
        out: dict[int, dict[Node, float]] = {}
        todo = list(new)
        while todo:
            batch: list[int] = []
            need = 0
            for b in todo:
                n = self._need(b, new[b])
                if not self._make_room(need + n, protect={*batch, b}, todo=todo):
                    break
                batch.append(b)
                need += n
            if not batch:
                raise RuntimeError("a row's candidates need more llama.cpp sequences than a context holds")
            out.update(self._decode_nodes({b: new[b] for b in batch}))
            todo = todo[len(batch):]
        return out

    def _new(self, b: int, wanted: Sequence[Node]) -> list[Node]:
        """The nodes of `wanted` and their ancestors not fed yet, parents first."""
        new: dict[Node, None] = {}
        for node in wanted:
            node = tuple(node)
            while node and node not in self._fed[b] and node not in new:
                if node not in self._valid[b]:
                    raise ValueError(f"{node} is not a node of row {b}'s candidates (a proper prefix of one)")
                new[node] = None
                node = node[:-1]
        return sorted(new, key=len)

    def _need(self, b: int, new: list[Node]) -> int:
        """The sequences feeding `new` takes: one per node that is not the first child of its
        parent to be fed; a row let go also its own tokens' and those of its nodes fed before."""
        kept = self._kept[b]
        if kept is None:
            return 1 + _branching(sorted(self._fed[b] | set(new), key=len), set())
        return _branching(new, kept.continued)

    def _make_room(self, count: int, protect: set[int], todo: list[int]) -> bool:
        """At least `count` sequences free: rows let go, those the feed does not ask for first,
        then the feed's last ones (never one in `protect`). False when that cannot be done."""
        asked = set(todo)
        order = [b for b in range(len(self.rows)) if b not in asked] + todo[::-1]
        for b in order:
            if len(self._free) >= count:
                break
            if b not in protect and self._kept[b] is not None:
                self._let_go(b)
        return len(self._free) >= count

    def _let_go(self, b: int) -> None:
        kept = self._kept[b]
        if kept is None:
            return
        seqs = {kept.base, *kept.seq.values()}
        self.engine.free_sequences(sorted(seqs))
        self._free += sorted(seqs, reverse=True)
        self._kept[b] = None

    def _take(self, shared: int) -> int:
        """A free sequence, given the prefix's first `shared` cells."""
        s = self._free.pop()
        self.engine.take_sequence(s, shared)
        return s

    def _decode_nodes(self, new: dict[int, list[Node]]) -> dict[int, dict[Node, float]]:
        """One decode of the rows' new nodes (a row let go: its own tokens and every node fed
        before too); per row, the children of the new nodes and their log-probs."""
        tokens: list[Token] = []
        asked: list[tuple[int, Node, int]] = []  # (row, node, batch index of its logits)
        for b, nodes in new.items():
            row, own = self.rows[b], self._own[b]
            end = row.prefix_len + len(own)
            kept = self._kept[b]
            again: list[Node] = []
            if kept is None:  # a row let go: decoded again from its own tokens
                kept = self._kept[b] = _Kept(self._take(row.prefix_len))
                again = sorted(self._fed[b], key=len)
            run = sorted([*again, *nodes], key=len)
            seqs = self._assign(b, kept, run, end, fresh=bool(again))
            self.most = max(self.most, len({kept.base, *kept.seq.values()}))
            if again:  # the row's own tokens carry every sequence of the decode, theirs first
                carried = list(dict.fromkeys([kept.base, *(seqs[n] for n in run)]))
                tokens += [Token(tok, row.prefix_len + k, carried, False) for k, tok in enumerate(own)]
            below = _carried(run, seqs)
            wanted = set(nodes)
            for node in run:
                scores = node in wanted and bool(self._nexts[b].get(node))
                if scores:
                    asked.append((b, node, len(tokens)))
                tokens.append(Token(node[-1], end + len(node) - 1, below[node], scores))
                self._fed[b].add(node)
            self.engine.label_tokens += len(run)
        self.engine.decode(tokens)
        out: dict[int, dict[Node, float]] = {}
        for b, node, at in asked:
            out.setdefault(b, {}).update(self._scored(at, self._nexts[b][node], node))
        return out

    def _assign(self, b: int, kept: _Kept, run: list[Node], end: int, fresh: bool) -> dict[Node, int]:
        """Each node of `run` (parents first) its sequence: its parent's, continued, when no child
        has continued it yet, else a new one tagged on the prefix, the row's own tokens and the
        ancestors kept before this decode (those in it carry it). `fresh`: the row's own tokens
        are in this decode too (they carry every sequence, see `_decode_nodes`)."""
        row = self.rows[b]
        inside = set(run)
        for node in run:
            parent = node[:-1]
            if parent not in kept.continued:
                kept.continued.add(parent)
                kept.seq[node] = kept.base if not parent else kept.seq[parent]
                continue
            s = self._take(row.prefix_len)
            if not fresh:
                self.engine.tag_cells(kept.base, s, row.prefix_len, end)
            for k in range(1, len(node)):
                ancestor = node[:k]
                if ancestor not in inside:
                    at = end + k - 1
                    self.engine.tag_cells(kept.seq[ancestor], s, at, at + 1)
            kept.seq[node] = s
        return {node: kept.seq[node] for node in run}

    def _scored(self, at: int, tokens: Sequence[int], node: Node) -> dict[Node, float]:
        """The log-probability of each of `tokens` after `node`, from the last decode's logits at `at`."""
        if not tokens:
            return {}
        logits, total = self.engine.logits_at(at), self.engine.logsumexp_at(at)
        return {node + (tok,): float(logits[tok]) - total for tok in tokens}



def _branching(run: list[Node], continued: set[Node]) -> int:
    """New sequences `_assign` takes for `run` (parents first) given the nodes continued already."""
    continued, count = set(continued), 0
    for node in run:
        if node[:-1] in continued:
            count += 1
        else:
            continued.add(node[:-1])
    return count


def _carried(run: list[Node], seqs: dict[Node, int]) -> dict[Node, list[int]]:
    """Per node of the decode, the sequences its token carries: its own first (llama.cpp's mask
    reads a token's first one), then those of its descendants in the decode."""
    below = {node: [seqs[node]] for node in run}
    for node in run:
        s = seqs[node]
        for k in range(1, len(node)):
            ancestor = node[:k]
            if ancestor in below and s not in below[ancestor]:
                below[ancestor].append(s)
    return below


def _node_keys(t: Trie) -> list[Node]:
    """Each trie node as the candidate prefix it ends (parents come before children)."""
    keys: list[Node] = []
    for tok, parent in zip(t.tokens, t.parents):
        keys.append((keys[parent] if parent >= 0 else ()) + (tok,))
    return keys


def _children(row: Row, t: Trie, keys: list[Node]) -> dict[Node, list[int]]:
    """Per node (() for the row's end), the tokens that follow it in some candidate (`keys`: the
    trie's nodes, `_node_keys`)."""
    nexts: dict[Node, dict[int, None]] = {}
    for tok, parent in zip(t.tokens, t.parents):
        nexts.setdefault(keys[parent] if parent >= 0 else (), {})[tok] = None
    for i, cand in enumerate(row.candidates):  # each candidate's last token, after its last node
        last = keys[t.paths[i][-1]] if t.paths[i] else ()
        nexts.setdefault(last, {})[int(cand[-1])] = None
    return {node: list(toks) for node, toks in nexts.items()}
