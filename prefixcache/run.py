"""The classification pipeline: spec + model -> batches scored against one cached prefix ->
records in input order. The CLI drives it; it never prints (progress goes through a callback).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .errors import ItemError, ModelError
from .io import Item
from .load import ModelSource, load_model, load_tokenizer, pick_device, pick_dtype, resolve_model
from .prompt import EncodedItem, PromptBuilder
from .spec import TaskSpec


@dataclass
class RunStats:
    items: int = 0
    seconds: float = 0.0  # scoring time, prefill excluded
    scored: int = 0  # distinct prompts run through the model (duplicates reuse their scores)
    item_tokens: int = 0  # tokens of the scored items' own (not cached) part
    load_seconds: float = 0.0
    prefill_ms: float = 0.0
    prefix_tokens: int = 0
    device: str = ""
    dtype: str = ""

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.items if self.items else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0


def normalise(logprobs: list[float], lengths: list[int], how: str) -> list[float]:
    """Scores used for the decision: `sum` keeps the total log-prob, `mean` divides by tokens."""
    if how == "mean":
        return [lp / n for lp, n in zip(logprobs, lengths)]
    return list(logprobs)


def softmax(scores: list[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


@dataclass
class Classifier:
    """A loaded task: tokenizer, prompt builder and (after `load_model`) the engine and prefix.

    Example:
        clf = Classifier.from_spec(spec)      # tokenizer only: enough for `render`
        clf.load_model()                      # model + prefill
        for record in clf.classify(items): ...
    """

    spec: TaskSpec
    source: ModelSource
    tokenizer: Any
    builder: PromptBuilder
    engine: Any = None
    prefix: Any = None
    stats: RunStats = field(default_factory=RunStats)
    _scores: "ScoreCache" = field(default_factory=lambda: ScoreCache())

    @classmethod
    def from_spec(cls, spec: TaskSpec) -> "Classifier":
        source = resolve_model(spec.model, Path(spec.path).parent, spec.trust_remote_code)
        start = time.perf_counter()
        tokenizer = load_tokenizer(source)
        builder = PromptBuilder(spec, tokenizer)
        clf = cls(spec, source, tokenizer, builder)
        clf.stats.load_seconds = time.perf_counter() - start
        return clf

    def load_model(self, device: str = "auto", dtype: str = "auto") -> None:
        from .engine import Engine  # torch is imported only on this path

        start = time.perf_counter()
        dev = pick_device(device)
        torch_dtype = pick_dtype(dtype, dev)
        model = load_model(self.source, self.tokenizer, dev, torch_dtype)
        self.engine = Engine(model)
        self.stats.load_seconds += time.perf_counter() - start
        self.stats.device, self.stats.dtype = dev, str(torch_dtype).removeprefix("torch.")
        limit = self.engine.max_positions
        if limit and len(self.builder.prefix_ids) >= limit:
            raise ModelError(
                f"the static prompt prefix has {len(self.builder.prefix_ids)} tokens, more than the "
                f"model's context of {limit}; shorten the system text or the examples"
            )
        self.prefix = self.engine.prefill(self.builder.prefix_ids)
        self.stats.prefill_ms = self.prefix.prefill_ms
        self.stats.prefix_tokens = len(self.prefix.ids)

    def encode(self, item: Item) -> EncodedItem:
        enc = self.builder.encode_item(item.record, item.id)
        limit = self.engine.max_positions if self.engine else None
        longest = max(len(c) for c in self.builder.candidates.values())
        if limit and len(enc.ids) + longest - 1 > limit:
            raise ItemError(item.id, f"{len(enc.ids)} prompt tokens do not fit the model's context of {limit}")
        return enc

    def render(self, item: Item) -> dict[str, Any]:
        enc = self.encode(item)
        return {
            "id": item.id,
            "prompt": enc.text,
            "prompt_ids": list(enc.ids),
            "prefix_len": enc.prefix_len,
            "candidates": {k: list(v) for k, v in self.builder.candidates.items()},
        }

    def _record(self, item: Item, enc: EncodedItem, logprobs: list[float], ms: float) -> dict[str, Any]:
        names = list(self.builder.candidates)
        lengths = [len(c) for c in self.builder.candidates.values()]
        probs = softmax(normalise(logprobs, lengths, self.spec.normalize))
        best = max(range(len(names)), key=probs.__getitem__)
        return {
            "id": item.id,
            "label": names[best],
            "prob": round(probs[best], 6),
            "probs": {n: round(p, 6) for n, p in zip(names, probs)},
            "logprobs": {n: round(lp, 6) for n, lp in zip(names, logprobs)},
            "normalize": self.spec.normalize,
            "prefix_tokens": enc.prefix_len,
            "item_tokens": len(enc.ids) - enc.prefix_len,
            "ms": round(ms, 3),
        }

    def _batches(
        self, items: Iterable[Item], batch_size: int, batch_tokens: int, known: Callable[[tuple], bool] = lambda k: False
    ) -> Iterator[list[tuple[Item, EncodedItem]]]:
        """Consecutive items, at most `batch_size` of them and about `batch_tokens` tokens through
        the model per batch (an item costs its own tokens plus the label tokens after it; an item
        whose prompt is `known` or already in the batch costs nothing)."""
        from .engine import _trie

        label_tokens = len(_trie(list(self.builder.candidates.values()))[0])
        batch: list[tuple[Item, EncodedItem]] = []
        keys: set[tuple] = set()
        tokens = 0
        for item in items:
            try:
                enc = self.encode(item)
            except ItemError:
                if batch:  # score what came before the bad item first
                    yield batch
                raise
            key = _prompt_key(enc)
            cost = 0 if key in keys or known(key) else len(enc.ids) - enc.prefix_len + label_tokens
            if batch and (len(batch) >= batch_size or tokens + cost > batch_tokens):
                yield batch
                batch, keys, tokens = [], set(), 0
                cost = 0 if known(key) else len(enc.ids) - enc.prefix_len + label_tokens
            batch.append((item, enc))
            keys.add(key)
            tokens += cost
        if batch:
            yield batch

    def classify(
        self,
        items: Iterable[Item],
        batch_size: int = 64,
        on_batch: Callable[[int], None] | None = None,
        batch_tokens: int = 768,
    ) -> Iterator[dict[str, Any]]:
        """Score items in batches against the cached prefix; yield records in input order.
        Items whose prompt was scored recently (same token ids) reuse those scores."""
        from .engine import Row

        if self.engine is None:
            raise RuntimeError("call load_model() before classify()")
        candidates = list(self.builder.candidates.values())
        for batch in self._batches(items, batch_size, batch_tokens, self._scores.__contains__):
            start = time.perf_counter()
            todo = {_prompt_key(e): e for _, e in batch if _prompt_key(e) not in self._scores}
            rows = [Row(e.ids, e.prefix_len, candidates) for e in todo.values()]
            for key, scores in zip(todo, self.engine.score(self.prefix, rows) if rows else ()):
                self._scores.put(key, scores)
            elapsed = time.perf_counter() - start
            self.stats.seconds += elapsed
            self.stats.items += len(batch)
            self.stats.scored += len(todo)
            self.stats.item_tokens += sum(len(e.ids) - e.prefix_len for e in todo.values())
            for item, enc in batch:
                yield self._record(item, enc, self._scores.get(_prompt_key(enc)), 1000 * elapsed / len(batch))
            if on_batch:
                on_batch(len(batch))


def _prompt_key(enc: EncodedItem) -> tuple:
    """The item's part of the prompt (the prefix is the same for every item of a run)."""
    return (enc.prefix_len, *enc.ids[enc.prefix_len:])


class ScoreCache:
    """The most recently used prompts' scores, so duplicate items are scored once."""

    def __init__(self, size: int = 65536):
        self.size, self._data = size, OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        return key in self._data

    def get(self, key: tuple) -> list[float]:
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key: tuple, scores: list[float]) -> None:
        self._data[key] = scores
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


def output_columns(spec: TaskSpec) -> list[str]:
    """CSV columns: the record's scalar fields plus one prob_/logprob_ column per label."""
    names = list(spec.label_names)
    return (
        ["id", "label", "prob"]
        + [f"prob_{n}" for n in names]
        + [f"logprob_{n}" for n in names]
        + ["normalize", "prefix_tokens", "item_tokens", "ms"]
    )


def flatten_for_csv(record: dict[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in record.items() if k not in ("probs", "logprobs")}
    flat.update({f"prob_{k}": v for k, v in record["probs"].items()})
    flat.update({f"logprob_{k}": v for k, v in record["logprobs"].items()})
    return flat
