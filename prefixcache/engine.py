"""Prefill the static prefix once; score batches of items and their candidates against it.

One forward pass per batch scores every candidate of every item. Each row holds the item's own
tokens followed by a token trie of its candidates: candidate tokens attend to the cached prefix,
the item's tokens and their own ancestors in the trie, never to a sibling. So a label costs only
its tokens after the first (the first is scored from the item's last logits), and labels sharing
leading tokens share them in the trie. Rows are right-aligned (padding sits between the prefix
and the item), so the scored positions are the last few columns and the lm_head runs only there.

The shared prefix cache is never written to: each batch gets a fresh cache that starts from a
broadcast view of it.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DynamicCache

Candidate = tuple[int, ...]


@dataclass(frozen=True)
class Prefix:
    """The prefilled static prefix. `kv[layer] = (keys, values)`, each [1, kv_heads, P, head_dim]."""

    ids: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    last_logits: torch.Tensor  # [V], float32: scores what follows the prefix
    prefill_ms: float


@dataclass(frozen=True)
class Row:
    """One item to score: its prompt ids, how many lead ids are the cached prefix, its candidates."""

    ids: Sequence[int]
    prefix_len: int
    candidates: Sequence[Candidate]


def _trie(candidates: Sequence[Candidate]) -> tuple[list[int], list[int], list[int], dict[Candidate, int]]:
    """Nodes for every proper prefix (length >= 1) of the candidates, parents before children.
    Returns (tokens, parent node or -1, depth from 1, prefix -> node index)."""
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
    return tokens, parents, depths, index


class Engine:
    """Scores candidates after prompts that start with one cached prefix.

    Example:
        engine = Engine(model)
        prefix = engine.prefill(prefix_ids)
        logprobs = engine.score(prefix, [Row(ids, len(prefix_ids), [(12, 7), (40, 7)])])
        # logprobs[0][i] = sum of log p(candidate i's tokens | ids), float
    """

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> Prefix:
        start = time.perf_counter()
        if not ids:
            raise ValueError("the prefix is empty")
        input_ids = torch.tensor([list(ids)], device=self.device)  # [1, P]
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        kv = tuple((layer.keys, layer.values) for layer in cache.layers)
        last = out.logits[0, -1].float()  # [V]
        return Prefix(tuple(ids), kv, last, (time.perf_counter() - start) * 1000)

    def _layout(self, prefix_len: int, rows: Sequence[Row]):
        """Build input ids, positions, the additive mask and per-candidate score indices."""
        tries = [_trie(r.candidates) for r in rows]
        suffixes = [list(r.ids[r.prefix_len:]) for r in rows]
        width = max(len(s) + len(t[0]) for s, t in zip(suffixes, tries))  # W
        keep = max(len(t[0]) for t in tries) + 1  # K: scored columns at the right edge
        B, P = len(rows), prefix_len
        ids = torch.zeros(B, width, dtype=torch.long)  # [B, W]
        pos = torch.zeros(B, width, dtype=torch.long)  # [B, W]
        allowed = torch.zeros(B, width, P + width, dtype=torch.bool)  # [B, W, P + W]
        allowed[:, :, 0] = True  # padding queries look at the first prefix token: never all-masked
        terms: list[list[tuple[int, int]]] = []  # per row: (kept column, token) for each candidate
        for b, (row, suffix, (tokens, parents, depths, index)) in enumerate(zip(rows, suffixes, tries)):
            n, m = len(suffix), len(tokens)
            off = width - n - m  # left padding of this row
            ids[b, off: off + n] = torch.tensor(suffix)
            pos[b, off: off + n] = torch.arange(row.prefix_len, row.prefix_len + n)
            allowed[b, off:, :row.prefix_len] = True  # only the prefix ids this item shares
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[b, off: off + n, P + off: P + off + n] = causal
            for k in range(m):
                col = off + n + k
                ids[b, col] = tokens[k]
                pos[b, col] = row.prefix_len + n + depths[k] - 1
                allowed[b, col, P + off: P + off + n] = True  # the whole item
                node = k
                while node >= 0:  # itself and its ancestors
                    allowed[b, col, P + off + n + node] = True
                    node = parents[node]
            last = keep - m - 1  # kept column of the item's last token
            terms.append([])
            for cand in row.candidates:
                cols = [last] + [last + 1 + index[cand[:k]] for k in range(1, len(cand))]
                terms[-1].extend(zip(cols, cand))
        return ids, pos, allowed, keep, terms

    def _batch_cache(self, prefix: Prefix, batch: int) -> DynamicCache:
        """A fresh cache whose first P positions are the prefix, shared by every row."""
        return DynamicCache([(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in prefix.kv])

    @torch.inference_mode()
    def score(self, prefix: Prefix, rows: Sequence[Row]) -> list[list[float]]:
        """Summed log-probabilities, one list per row, one float per candidate (in order)."""
        P = len(prefix.ids)
        for r in rows:
            if not 0 <= r.prefix_len <= P or r.prefix_len >= len(r.ids) or any(not c for c in r.candidates):
                raise ValueError("each row needs a prefix_len <= the prefix, own ids, and non-empty candidates")
        ids, pos, allowed, keep, terms = self._layout(P, rows)
        mask = torch.zeros(allowed.shape, dtype=self.dtype)  # [B, W, P + W], additive
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        kwargs = {self._cache_kw: self._batch_cache(prefix, len(rows))} if P else {}
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=pos.to(self.device),
            attention_mask=mask[:, None].to(self.device),  # [B, 1, W, P + W]
            use_cache=bool(P),
            logits_to_keep=keep,
            **kwargs,
        )
        logprobs = torch.log_softmax(out.logits.float(), dim=-1).cpu()  # [B, K, V]
        results = []
        for b, (row, row_terms) in enumerate(zip(rows, terms)):
            cols = torch.tensor([c for c, _ in row_terms])
            toks = torch.tensor([t for _, t in row_terms])
            picked = logprobs[b, cols, toks].tolist()
            scores, at = [], 0
            for cand in row.candidates:
                scores.append(float(sum(picked[at: at + len(cand)])))
                at += len(cand)
            results.append(scores)
        return results
