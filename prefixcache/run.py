"""The classification pipeline: spec + model -> batches scored against one cached prefix ->
records in input order. The CLI drives it; it never prints (progress goes through a callback).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from .errors import ItemError, ModelError
from .io import Item
from .load import ModelSource, load_model, load_tokenizer, pick_device, pick_dtype, resolve_model
from .prompt import EncodedItem, PromptBuilder
from .scoring import calibrate, decide, mean_distribution, normalise, softmax
from .spec import TaskSpec, choice_list, gold_value


@dataclass
class RunStats:
    items: int = 0
    seconds: float = 0.0  # scoring time, prefill excluded
    scored: int = 0  # distinct prompts run through the model (duplicates reuse their scores)
    errors: int = 0  # items written as error records (on_error="skip")
    item_tokens: int = 0  # tokens of the scored items' own (not cached) part
    load_seconds: float = 0.0
    prefill_ms: float = 0.0  # prefilling the prefix, or loading it from the prefix store
    prefix_source: str = ""  # "computed" or "loaded"
    prefix_tokens: int = 0
    device: str = ""
    dtype: str = ""

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.items if self.items else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class Prepared:
    """An item ready to score: its prompt ids and its candidates (labels, or its own options)."""

    item: Item
    enc: EncodedItem
    candidates: dict[str, tuple[int, ...]]  # text -> ids, in output order

    @property
    def key(self) -> tuple:
        """What determines the scores (the prefix is the same for every item of a run)."""
        return (self.enc.prefix_len, tuple(self.enc.ids[self.enc.prefix_len:]), tuple(self.candidates.values()))


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
    prior: list[float] | None = None  # calibration: label distribution on content-free inputs
    _scores: "ScoreCache" = field(default_factory=lambda: ScoreCache())
    _unconditional: "ScoreCache" = field(default_factory=lambda: ScoreCache())

    @classmethod
    def from_spec(cls, spec: TaskSpec) -> "Classifier":
        source = resolve_model(spec.model, Path(spec.path).parent, spec.trust_remote_code)
        start = time.perf_counter()
        tokenizer = load_tokenizer(source)
        builder = PromptBuilder(spec, tokenizer)
        clf = cls(spec, source, tokenizer, builder)
        clf.stats.load_seconds = time.perf_counter() - start
        return clf

    def load_model(self, device: str = "auto", dtype: str = "auto", store: Any = None) -> None:
        """Load the model and get the prefilled prefix: from `store` (a PrefixStore) when it has
        it, else by prefilling (and then keeping it there)."""
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
        self.prefix = self._prefix(store)
        self.stats.prefill_ms = self.prefix.prefill_ms
        self.stats.prefix_tokens = len(self.prefix.ids)
        if self.spec.normalize == "pmi" and not self.spec.choices:
            self._score_unconditional(list(self.builder.candidates.values()))
        if self.spec.content_free:
            self.prior = self._calibration_prior()

    def _prefix(self, store: Any):
        if store is None:
            self.stats.prefix_source = "computed"
            return self.engine.prefill(self.builder.prefix_ids)
        from .load import model_identity
        from .store import prefix_key

        identity = model_identity(self.source)
        if self.source.kind == "hub":  # the revision actually loaded, so a new upload misses
            identity += "@" + str(getattr(self.engine.model.config, "_commit_hash", None))
        key = prefix_key(identity, self.engine.dtype, self.engine.device.type, self.builder.prefix_ids)
        prefix = store.load(key, self.engine.device)
        if prefix is not None and prefix.ids == tuple(self.builder.prefix_ids):
            self.stats.prefix_source = "loaded"
            return prefix
        self.stats.prefix_source = "computed"
        return store.save(key, self.engine.prefill(self.builder.prefix_ids), self.source.ref)

    # -- preparing items -----------------------------------------------------------------------
    def prepare(self, item: Item) -> Prepared:
        """Tokens and candidates of one item. Raises ItemError for anything wrong with it."""
        try:
            self.spec.check_record(item.record)
        except ValueError as exc:
            raise ItemError(item.id, str(exc))
        enc = self.builder.encode_item(item.record, item.id)
        if self.spec.choices:
            candidates = self.builder.options(choice_list(item.record, self.spec.choices), item.id)
        else:
            candidates = self.builder.candidates
        limit = self.engine.max_positions if self.engine else None
        longest = max(len(c) for c in candidates.values())
        if limit and len(enc.ids) + longest - 1 > limit:
            raise ItemError(item.id, f"{len(enc.ids)} prompt tokens do not fit the model's context of {limit}")
        return Prepared(item, enc, candidates)

    def content_free(self, text: str) -> EncodedItem:
        """The prompt with every template field set to `text` (e.g. "" or "N/A")."""
        return self.builder.encode_item({f: text for f in self.spec.template.fields})

    def render(self, item: Item) -> dict[str, Any]:
        prep = self.prepare(item)
        return {
            "id": item.id,
            "prompt": prep.enc.text,
            "prompt_ids": list(prep.enc.ids),
            "prefix_len": prep.enc.prefix_len,
            "candidates": {k: list(v) for k, v in prep.candidates.items()},
        }

    # -- unconditional scores and calibration -------------------------------------------------
    def _score_unconditional(self, candidates: list[tuple[int, ...]]) -> None:
        """Score the candidates not seen yet after the content-free prompt (every template field
        empty), in a forward pass of their own, so the values never depend on a batch."""
        from .engine import Row

        todo = list(dict.fromkeys(c for c in candidates if c not in self._unconditional))
        if todo:
            cf = self.content_free("")
            for cand, lp in zip(todo, self.engine.score(self.prefix, [Row(cf.ids, cf.prefix_len, todo)])[0]):
                self._unconditional.put(cand, lp)

    def _calibration_prior(self) -> list[float]:
        """Mean label distribution over the content-free inputs, scored like any item."""
        from .engine import Row

        cands = list(self.builder.candidates.values())
        rows = [Row(e.ids, e.prefix_len, cands) for e in map(self.content_free, self.spec.content_free)]
        dists = [self._distribution(self.builder.candidates, lps) for lps in self.engine.score(self.prefix, rows)]
        return mean_distribution(dists)

    def _distribution(self, candidates: dict[str, tuple[int, ...]], logprobs: list[float]) -> list[float]:
        ids = list(candidates.values())
        uncond = [self._unconditional.peek(c) for c in ids] if self.spec.normalize == "pmi" else ()
        scores = normalise(logprobs, self.spec.normalize, [len(c) for c in ids], list(candidates), uncond)
        return softmax(scores)

    # -- records ------------------------------------------------------------------------------
    def _record(self, prep: Prepared, logprobs: list[float], ms: float) -> dict[str, Any]:
        names = list(prep.candidates)
        raw = self._distribution(prep.candidates, logprobs)
        probs = calibrate(raw, self.prior) if self.prior else raw
        best, margin = decide(probs, self.spec.threshold)
        r6 = lambda x: round(x, 6)  # noqa: E731
        record: dict[str, Any] = {"id": prep.item.id, "label": None if best is None else names[best]}
        if self.spec.choices:
            record["index"] = best
        record.update(prob=None if best is None else r6(probs[best]), margin=r6(margin))
        if self.spec.choices:
            record.update(probs=[r6(p) for p in probs], logprobs=list(logprobs))
        else:
            record.update(probs={n: r6(p) for n, p in zip(names, probs)},
                          logprobs=dict(zip(names, logprobs)))
            if self.prior:
                record["raw_probs"] = {n: r6(p) for n, p in zip(names, raw)}
        if self.spec.gold:
            gold = gold_value(prep.item.record, self.spec.gold)
            record.update(gold=gold, correct=record["label"] == gold)
        record.update(
            normalize=self.spec.normalize + ("+calibrated" if self.prior else ""),
            prefix_tokens=prep.enc.prefix_len,
            item_tokens=len(prep.enc.ids) - prep.enc.prefix_len,
            ms=round(ms, 3),
        )
        return record

    def _batches(
        self, items: Iterable[Item], batch_size: int, batch_tokens: int, on_error: str = "fail"
    ) -> Iterator[list[Prepared | Failed]]:
        """Consecutive items, at most `batch_size` of them and about `batch_tokens` tokens through
        the model per batch (an item costs its own tokens plus its candidates' trie; a prompt
        already in the batch costs nothing). The batches depend only on the items from where
        batching starts, never on timing or on what was scored before, so a resumed run or a
        shard starting at a batch boundary forms exactly the batches of an uninterrupted run.
        An item that cannot be scored is a `Failed` entry (on_error="skip") or ends the batches
        after the ones before it (on_error="fail")."""
        from .engine import _trie

        batch: list[Prepared | Failed] = []
        keys: set[tuple] = set()
        tokens = 0
        for item in items:
            try:
                prep = self.prepare(item)
            except ItemError as exc:
                if on_error == "skip":
                    batch.append(Failed(item, str(exc)))
                    continue
                if batch:  # score what came before the bad item first
                    yield batch
                raise
            own = len(prep.enc.ids) - prep.enc.prefix_len + len(_trie(list(prep.candidates.values()))[0])
            cost = 0 if prep.key in keys else own
            if batch and (len(batch) >= batch_size or tokens + cost > batch_tokens):
                yield batch
                batch, keys, tokens, cost = [], set(), 0, own
            batch.append(prep)
            keys.add(prep.key)
            tokens += cost
        if batch:
            yield batch

    def batch_starts(self, items: Iterable[Item], batch_size: int, batch_tokens: int, on_error: str = "fail") -> list[int]:
        """Where each batch of `classify` starts (item positions), found by tokenising only."""
        starts, at = [], 0
        for batch in self._batches(items, batch_size, batch_tokens, on_error):
            starts.append(at)
            at += len(batch)
        return starts

    def _score_batch(self, preps: list[Prepared], done: Mapping[str, dict]) -> list[Prepared]:
        """Score the batch's prompts not seen before, in one forward pass, and cache them. When
        a previous run already wrote every item of the batch, the scores are read back from its
        records instead: exactly what this run would have computed, since the batch is the same."""
        from .engine import Row

        todo: dict[tuple, Prepared] = {p.key: p for p in preps if p.key not in self._scores}
        if todo and all(str(p.item.id) in done for p in preps):
            for key, p in todo.items():
                self._scores.put(key, _logprobs_of(done[str(p.item.id)], p))
            return []
        if todo:
            rows = [Row(p.enc.ids, p.enc.prefix_len, list(p.candidates.values())) for p in todo.values()]
            for key, scores in zip(todo, self.engine.score(self.prefix, rows)):
                self._scores.put(key, scores)
        return list(todo.values())

    def classify(
        self,
        items: Iterable[Item],
        batch_size: int = 64,
        on_batch: Callable[[int], None] | None = None,
        batch_tokens: int = 768,
        on_error: str = "fail",
        done: Mapping[str, dict] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Score items in batches against the cached prefix; yield records in input order.

        Items whose prompt and candidates were scored recently reuse those scores. Items whose id
        is in `done` (records a previous run wrote, by str(id)) are not yielded again; their
        batches are replayed so that every other record is the same as in an uninterrupted run.
        `on_error="skip"` yields `{"id", "error"}` for an item that cannot be scored."""
        if self.engine is None:
            raise RuntimeError("call load_model() before classify()")
        done = done or {}
        for batch in self._batches(items, batch_size, batch_tokens, on_error):
            start = time.perf_counter()
            preps = [p for p in batch if isinstance(p, Prepared)]
            if self.spec.normalize == "pmi" and self.spec.choices:
                self._score_unconditional([c for p in preps for c in p.candidates.values()])
            scored = self._score_batch(preps, done)
            for p in preps:
                self._scores.get(p.key)  # recency: the same in every run, written or replayed
            pending = [p for p in batch if str(p.item.id) not in done]
            if not pending:
                continue
            elapsed = time.perf_counter() - start
            self.stats.seconds += elapsed
            self.stats.items += len(pending)
            self.stats.scored += len(scored)
            self.stats.item_tokens += sum(len(p.enc.ids) - p.enc.prefix_len for p in scored)
            for entry in pending:
                if isinstance(entry, Failed):
                    self.stats.errors += 1
                    yield {"id": entry.item.id, "error": entry.message}
                else:
                    yield self._record(entry, self._scores.peek(entry.key), 1000 * elapsed / len(pending))
            if on_batch:
                on_batch(len(pending))


@dataclass(frozen=True)
class Failed:
    """An item that cannot be scored, and why."""

    item: Item
    message: str


def _logprobs_of(record: Mapping[str, Any], prep: Prepared) -> list[float]:
    """The raw log-probs a written record holds, in candidate order (JSONL or CSV record)."""
    value = record.get("logprobs")
    if isinstance(value, str):  # CSV, multiple choice
        value = json.loads(value)
    if isinstance(value, list):
        return [float(v) for v in value]
    if isinstance(value, dict):
        return [float(value[name]) for name in prep.candidates]
    return [float(record[f"logprob_{name}"]) for name in prep.candidates]


class ScoreCache:
    """The most recently used prompts' scores, so duplicate items are scored once."""

    def __init__(self, size: int = 65536):
        self.size, self._data = size, OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        return key in self._data

    def get(self, key: tuple) -> list[float]:
        self._data.move_to_end(key)
        return self._data[key]

    def peek(self, key: tuple) -> list[float]:
        return self._data[key]

    def put(self, key: tuple, scores: list[float]) -> None:
        self._data[key] = scores
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


def output_columns(spec: TaskSpec) -> list[str]:
    """CSV columns: the record's scalar fields plus one prob_/logprob_ column per label (for
    multiple choice, `probs` and `logprobs` are JSON lists in one cell each)."""
    head = ["id", "label"] + (["index"] if spec.choices else []) + ["prob", "margin"]
    if spec.choices:
        per_label = ["probs", "logprobs"]
    else:
        names = list(spec.label_names)
        per_label = [f"prob_{n}" for n in names] + [f"logprob_{n}" for n in names]
        per_label += [f"raw_prob_{n}" for n in names] if spec.content_free else []
    gold = ["gold", "correct"] if spec.gold else []
    return head + per_label + gold + ["normalize", "prefix_tokens", "item_tokens", "ms", "error"]


def flatten_for_csv(record: dict[str, Any]) -> dict[str, Any]:
    if "error" in record or isinstance(record["probs"], list):  # error records; multiple choice lists
        return record
    flat = {k: v for k, v in record.items() if k not in ("probs", "logprobs", "raw_probs")}
    for field_name, prefix in (("probs", "prob_"), ("logprobs", "logprob_"), ("raw_probs", "raw_prob_")):
        flat.update({f"{prefix}{k}": v for k, v in record.get(field_name, {}).items()})
    return flat
