"""Items first, branches later: scoring only some of an item's candidates, after seeing its
first-token scores, without running the item through the model again. Used by pruned label
scoring (scoring/pruning.py).

`open_items` runs a batch's items (their own tokens after the shared prefix) through the model
once, keeping every layer's keys and values of those tokens and the log-probabilities of the next
token at each item's end. `OpenItems.branches` then scores chosen candidates of chosen items: only
their trie nodes go through the model, attending to the prefix, to the kept keys of their item and
to their own ancestors, exactly the attention of a full scoring pass. Needs the shared-prefix
kernel ("shared" backend) and full attention (no sliding window); `usable` says whether an engine
has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .engine import Engine, Layout, Prefix, layout
from .rows import Candidate, Row, trie


def usable(engine: Engine) -> bool:
    """Whether this engine can score branches after kept items (else score in full)."""
    return engine.backend == "shared" and engine.window is None and not engine.unchecked


@dataclass
class OpenItems:
    """A batch's items, run once. `first[b]`: log-probabilities [V] of the token after item b."""

    engine: Engine
    prefix: Prefix
    rows: Sequence[Row]
    starts: list[int]  # packed index of each item's first own token
    kept: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer, the items' keys and values [1, Hkv, T1, D]
    first: torch.Tensor  # [B, V] float32 log-probabilities

    @torch.inference_mode()
    def branches(self, chosen: dict[int, Sequence[Candidate]]) -> dict[int, list[float]]:
        """Summed log-probabilities of the chosen candidates of the chosen items (row index ->
        candidates), in the order given."""
        out = {b: [0.0] * len(cands) for b, cands in chosen.items()}
        deep = {b: cands for b, cands in chosen.items() if any(len(c) > 1 for c in cands)}
        rest: dict[int, list[float]] = {}
        if deep:
            rest = self._rest(deep)
        for b, cands in chosen.items():
            for i, cand in enumerate(cands):
                out[b][i] = float(self.first[b, cand[0]]) + (rest[b][i] if b in rest else 0.0)
        return out

    def _rest(self, chosen: dict[int, Sequence[Candidate]]) -> dict[int, list[float]]:
        """Each candidate's log-probability after its first token: its trie nodes through the model."""
        lay, key_gather, sizes = self._layout(chosen)
        dev = self.engine.device
        logits = self.engine.forward_shared(self.prefix, lay, carried=self.kept, key_gather=key_gather.to(dev))
        self.engine.label_tokens += len(lay.ids)
        lse = torch.logsumexp(logits.float(), dim=-1)
        rows_, toks = lay.term_rows.to(logits.device), lay.term_toks.to(logits.device)
        picked = (logits[rows_, toks].float() - lse[rows_]).tolist()
        result: dict[int, list[float]] = {b: [] for b in chosen}
        at, sized = 0, iter(sizes)
        for b in chosen:
            for _ in chosen[b]:
                n = next(sized)
                result[b].append(float(sum(picked[at: at + n])))
                at += n
        return result

    def _layout(self, chosen: dict[int, Sequence[Candidate]]) -> tuple[Layout, torch.Tensor, list[int]]:
        """The chosen candidates' trie nodes laid out as `engine.layout` lays out rows, queries being
        the nodes only and keys the row's kept item tokens (in `kept`, index < T1) then its nodes
        (T1 + packed index): the layout, the key gather [B, Wk], and each candidate's term count."""
        P, order = len(self.prefix.ids), list(chosen)
        tries = [trie(list(chosen[b])) for b in order]
        own = [len(self.rows[b].ids) - self.rows[b].prefix_len for b in order]
        Wq, Wk, T1 = max(len(t) for t in tries), max(n + len(t) for n, t in zip(own, tries)), self.kept[0][0].shape[2]
        B, T2 = len(order), sum(len(t) for t in tries)
        ids, pos, term_rows, term_toks, sizes = [], [], [], [], []
        gather = torch.full((B, Wq), T2, dtype=torch.long)
        key_gather = torch.zeros(B, Wk, dtype=torch.long)
        allowed = torch.zeros(B, Wq, P + Wk, dtype=torch.bool)
        for r, (b, t, n) in enumerate(zip(order, tries, own)):
            row, start, m = self.rows[b], len(ids), len(t)
            offq, offk = Wq - m, Wk - n - m
            ids += t.tokens
            pos += [row.prefix_len + n + d - 1 for d in t.depths]
            gather[r, offq:] = torch.arange(start, start + m)
            key_gather[r, offk: offk + n] = torch.arange(self.starts[b], self.starts[b] + n)
            key_gather[r, offk + n:] = torch.arange(T1 + start, T1 + start + m)
            allowed[r, :, :row.prefix_len] = True
            allowed[r, :offq, P + offk] = True  # padding queries see one key (never an all-masked row)
            for k in range(m):
                allowed[r, offq + k, P + offk: P + offk + n] = True  # the whole item
                node = k
                while node >= 0:
                    allowed[r, offq + k, P + offk + n + node] = True
                    node = t.parents[node]
            for cand in chosen[b]:
                term_rows += [start + t.index[cand[:k]] for k in range(1, len(cand))]
                term_toks += cand[1:]
                sizes.append(len(cand) - 1)
        slots = torch.zeros(T2, dtype=torch.long)
        real = gather < T2
        slots[gather[real]] = torch.arange(B * Wq).view(B, Wq)[real]
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        lay = Layout(as_long(ids), as_long(pos), torch.arange(T2), gather, slots, allowed, as_long(term_rows),
                     as_long(term_toks), [])
        return lay, key_gather, sizes


@torch.inference_mode()
def open_items(engine: Engine, prefix: Prefix, rows: Sequence[Row]) -> OpenItems:
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
