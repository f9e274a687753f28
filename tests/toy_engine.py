"""A third engine, for the tests: the slow, obviously correct forward behind the engine protocol
(model/protocol.py). Every candidate is scored by re-encoding the whole prompt and candidate; its
"prefix" is only the ids. Registered with one line (`register_toy`), it runs a spec end to end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from prefixcache.model.engines import Backend, register
from prefixcache.model.reference import score_naive
from prefixcache.model.rows import Probe, Row

NAME = "toy"


@dataclass(frozen=True)
class ToyPrefix:
    ids: tuple[int, ...]
    prefill_ms: float = 0.0


class ToyEngine:
    name = NAME
    branches = True
    layers = 0

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.label_tokens = 0

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def prefill(self, ids: Sequence[int]) -> ToyPrefix:
        return ToyPrefix(tuple(int(i) for i in ids))

    def export_prefix(self, prefix: ToyPrefix) -> tuple[dict[str, Any], dict[str, str]]:
        return {"ids": np.asarray(prefix.ids, dtype=np.int64)}, {}

    def restore_prefix(self, ids: Sequence[int], tensors: dict[str, Any], meta: dict[str, str],
                       load_ms: float) -> ToyPrefix:
        if list(np.asarray(tensors["ids"])) != list(ids):
            raise ValueError("not this prefix")
        return ToyPrefix(tuple(ids), load_ms)

    def score(self, prefix: ToyPrefix, rows: Sequence[Row]) -> list[list[float]]:
        out = []
        for row in rows:
            self.label_tokens += sum(len(c) for c in row.candidates)
            out.append([score_naive(self.model, list(row.ids) + list(c[:row.skip(i)]), [c[row.skip(i):]])[0]
                        for i, c in enumerate(row.candidates)])
        return out

    def open_items(self, prefix: ToyPrefix, rows: Sequence[Row]) -> Iterator["ToyOpenItems"]:
        yield ToyOpenItems(self, rows)

    @torch.inference_mode()
    def score_with_states(self, prefix: ToyPrefix, rows: Sequence[Row], wanted: Sequence[Sequence[int]],
                          probe: Probe | None = None) -> tuple[list[list[float]], list[np.ndarray]]:
        if probe is not None and not probe.plain:
            raise ValueError("the toy engine reads the final state only")
        states = []
        for row, want in zip(rows, wanted, strict=True):
            found = []
            for i in want:
                ids = list(row.ids) + list(row.candidates[i][:row.skip(i)]) if row.candidates else list(row.ids)
                hidden = self.model.base_model(input_ids=torch.tensor([ids], device=self.device)).last_hidden_state
                found.append(hidden[0, -1].float().cpu().numpy())
            states.append(np.stack(found) if found else np.zeros((0, self.hidden_size), np.float32))
        return self.score(prefix, rows), states


class ToyOpenItems:
    """A race's items, the obvious way: each node's children scored by re-encoding everything."""

    def __init__(self, engine: ToyEngine, rows: Sequence[Row]):
        self.engine, self.rows = engine, list(rows)

    def _children(self, b: int, node: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        row, n = self.rows[b], len(node)
        nexts = sorted({tuple(c[n:n + 1]) for c in row.candidates if tuple(c[:n]) == node and len(c) > n})
        context = list(row.ids) + list(node)
        self.engine.label_tokens += len(node) > 0
        return {node + nxt: score_naive(self.engine.model, context, [nxt])[0] for nxt in nexts}

    def firsts(self, b: int) -> dict[tuple[int, ...], float]:
        return self._children(b, ())

    def feed(self, nodes: dict[int, Sequence[tuple[int, ...]]]) -> dict[int, dict[tuple[int, ...], float]]:
        out: dict[int, dict[tuple[int, ...], float]] = {}
        for b, wanted in nodes.items():
            chain = {tuple(node)[:k] for node in wanted for k in range(1, len(node) + 1)}  # with its ancestors
            for node in sorted(chain, key=len):
                out.setdefault(b, {}).update(self._children(b, node))
        return out


def _make(load: Any) -> ToyEngine:
    from prefixcache.model.load import load_model

    return ToyEngine(load_model(load.source, load.tokenizer, load.cache_dir, "cpu", torch.float32))


def register_toy(max_leaves: int | None = None, reads_states: bool = True) -> Backend:
    """The registry line."""
    return register(Backend(NAME, "torch", _make, max_leaves=max_leaves, reads_states=reads_states))
