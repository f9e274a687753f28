"""Items first, branches later, on llama.cpp: what model/branches.py does for the transformers
engine, built from llama.cpp's sequences. Used by pruned scoring (scoring/pruning.py) through
`LlamaEngine.open_items`.

A group of rows is decoded once: each row's own tokens carry one sequence per leaf of its
candidates' token trie (the prefix cells it shares tagged with them, as `LlamaEngine.score` does)
and are kept in the context's cells. A trie node fed later carries the sequences of the leaves
below it, so it attends to the prefix, its row and its ancestors (fed before it, or earlier in the
same decode), never to a sibling or another row: the attention of the full scoring decode, the
node at the position it has there. The group's sequences are removed when the race is done with
it (`close`), which frees every cell but the prefix's.

Knows nothing of specs or races; llama_cpp is reached through the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .rows import Node, Row, Trie

if TYPE_CHECKING:
    from .llamacpp import LlamaEngine


class LlamaOpenItems:
    """A group of rows decoded once and kept (see the module's doc). `rows`: the group's rows;
    `seqs`: every sequence id it holds (1..), freed by `close`."""

    def __init__(self, engine: "LlamaEngine", rows: Sequence[Row], tries: Sequence[Trie]):
        from .llamacpp import _Token, _leaf_nodes, _node_sequences

        self.engine, self.rows, self.seqs = engine, list(rows), []
        self._nodes: list[dict[Node, list[int]]] = []  # per row: trie node -> the sequences it carries
        self._nexts: list[dict[Node, list[int]]] = []  # per row: node (() the row's end) -> its children's tokens
        self._fed: list[set[Node]] = [set() for _ in rows]
        self._base: list[int] = []  # per row: the position of its first trie node
        tokens: list[_Token] = []
        ends: list[int] = []
        for row, t in zip(rows, tries):
            leaves = _leaf_nodes(t)
            seqs = list(range(len(self.seqs) + 1, len(self.seqs) + 1 + max(1, len(leaves))))
            self.seqs += seqs
            engine.take_sequences(seqs, row.prefix_len)
            own = [int(i) for i in row.ids[row.prefix_len:]]
            tokens += [_Token(tok, row.prefix_len + k, seqs, k == len(own) - 1) for k, tok in enumerate(own)]
            ends.append(len(tokens) - 1)
            self._base.append(row.prefix_len + len(own))
            self._nodes.append(dict(zip(_node_keys(t), _node_sequences(t, leaves, seqs))))
            self._nexts.append(_children(row, t))
        engine._decode(tokens)
        self._first = [self._scored(at, self._nexts[b].get((), ()), ()) for b, at in enumerate(ends)]

    def firsts(self, b: int) -> dict[Node, float]:
        """Row b's candidates' first tokens (the nodes right after the row) and their log-probs."""
        return dict(self._first[b])

    def feed(self, nodes: dict[int, Sequence[Node]]) -> dict[int, dict[Node, float]]:
        """Decode the named nodes of the named rows (with their ancestors not fed yet, parents
        first) in one decode; per row, every child of a fed node and the log-probability of its
        last token there."""
        from .llamacpp import _Token

        tokens: list[_Token] = []
        asked: list[tuple[int, Node, int]] = []  # (row, node, batch index of its logits)
        for b, wanted in nodes.items():
            new: dict[Node, None] = {}
            for node in wanted:
                node = tuple(node)
                while node and node not in self._fed[b] and node not in new:
                    new[node] = None
                    node = node[:-1]
            for node in sorted(new, key=len):
                if node not in self._nodes[b]:
                    raise ValueError(f"{node} is not a node of row {b}'s candidates (a proper prefix of one)")
                if self._nexts[b].get(node):
                    asked.append((b, node, len(tokens)))
                tokens.append(_Token(node[-1], self._base[b] + len(node) - 1, self._nodes[b][node], bool(self._nexts[b].get(node))))
                self._fed[b].add(node)
        if not tokens:
            return {}
        self.engine._decode(tokens)
        self.engine.label_tokens += len(tokens)
        out: dict[int, dict[Node, float]] = {b: {} for b in nodes if any(a[0] == b for a in asked)}
        for b, node, at in asked:
            out[b].update(self._scored(at, self._nexts[b][node], node))
        return out

    def _scored(self, at: int, tokens: Sequence[int], node: Node) -> dict[Node, float]:
        """The log-probability of each of `tokens` after `node`, from the last decode's logits at `at`."""
        if not tokens:
            return {}
        logits, total = self.engine._logits(at), self.engine._logsumexp(at)
        return {node + (tok,): float(logits[tok]) - total for tok in tokens}

    def close(self) -> None:
        """The group's sequences removed: every cell but the prefix's is free again."""
        self.engine.free_sequences(self.seqs)
        self.seqs = []


def _node_keys(t: Trie) -> list[Node]:
    """Each trie node as the candidate prefix it ends (parents come before children)."""
    keys: list[Node] = []
    for tok, parent in zip(t.tokens, t.parents):
        keys.append((keys[parent] if parent >= 0 else ()) + (tok,))
    return keys


def _children(row: Row, t: Trie) -> dict[Node, list[int]]:
    """Per node (() for the row's end), the tokens that follow it in some candidate."""
    keys = _node_keys(t)
    nexts: dict[Node, dict[int, None]] = {}
    for k, (tok, parent) in enumerate(zip(t.tokens, t.parents)):
        nexts.setdefault(keys[parent] if parent >= 0 else (), {})[tok] = None
    for i, cand in enumerate(row.candidates):  # each candidate's last token, after its last node
        last = keys[t.paths[i][-1]] if t.paths[i] else ()
        nexts.setdefault(last, {})[int(cand[-1])] = None
    return {node: list(toks) for node, toks in nexts.items()}
