"""A task: the spec with its model's tokenizer. Turns items into token ids and candidates, and
groups them into batches. Loads no model and imports no torch.

Example:
    task = Task.from_spec(load_spec("spec.yaml"), cache_dir)
    for batch in task.batches(read_items("items.jsonl"), Batching(size=64, tokens=768)):
        ...  # list of Prepared (or Failed, with on_error="skip")
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from ..errors import ItemError, PrefixTooLong, SpecError, TooLong
from ..data.items import Item
from ..model.choice import engines
from ..model.load import ModelSource, load_tokenizer, model_content_identity, model_context, resolve_model
from ..task.decision import Groups
from ..task.head import fingerprint
from ..task.kind import Question, shown
from ..task.questions import label_kind
from ..task.prompt import EncodedItem, PromptBuilder
from ..model.rows import Candidate, Row, trie
from .options import BATCH_SIZE, BATCH_TOKENS
from ..task.spec import LETTERS, TaskSpec, choice_list, field_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# No tokenizer makes tokens this long on average: an item longer than this many characters per
# position of the model's context cannot fit it, whatever its text.
MAX_CHARS_PER_TOKEN = 64
UNKNOWN_CONTEXT = 131072  # positions assumed when the model's are not known yet (render, --dry-run)


def check_backend(spec: TaskSpec) -> None:
    """The spec's `backend` checked against the engines there are (model/engines.py), before any
    model loads: SpecError naming them."""
    if spec.backend is not None and spec.backend not in engines():
        raise SpecError(f"{spec.path}: backend must be one of {', '.join(engines())}, not {spec.backend!r}")


def spec_model(spec: TaskSpec) -> ModelSource:
    """The model a task spec names (relative paths: the current folder, then the spec's folder);
    the spec's `backend` checked first (`check_backend`)."""
    check_backend(spec)
    return resolve_model(spec.model, Path(spec.path).parent, spec.trust_remote_code, spec.revision)


@dataclass(frozen=True)
class Prepared:
    """An item ready to score: its prompt ids and its candidates (labels, or its own options)."""

    item: Item
    enc: EncodedItem
    candidates: dict[str, Candidate]  # text scored -> ids
    groups: Groups  # which candidates make each option's score (a label's, or a question's option's)
    spans: tuple[tuple[int, int], ...]  # per question, its candidates (start, end)
    parts: tuple[tuple[int, int], ...]  # per question, its options in the item's scores (start, end)
    skips: tuple[int, ...] = ()  # typed questions: per candidate, its question's ids before the answer (not scored)

    @property
    def texts(self) -> list[str]:
        """The options its scores are for, in order (labels, the item's options, or each
        question's options as `question id \x1f option`)."""
        return list(self.groups.names)

    @property
    def key(self) -> tuple:
        """What determines the scores (the prefix is the same for every item of a run)."""
        return (self.enc.prefix_len, tuple(self.enc.ids[self.enc.prefix_len:]), tuple(self.candidates.values()))

    @property
    def own_tokens(self) -> int:
        """The item's tokens after the cached prefix."""
        return len(self.enc.ids) - self.enc.prefix_len

    @property
    def row(self) -> Row:
        return Row(self.enc.ids, self.enc.prefix_len, list(self.candidates.values()), self.skips)


@dataclass(frozen=True)
class Failed:
    """An item that cannot be scored, and why."""

    item: Item
    message: str


def all_prepared(batch: Sequence[Prepared | Failed]) -> list[Prepared]:
    """A batch made with `on_error` "fail", which holds no failed item (ItemError for one)."""
    for p in batch:
        if isinstance(p, Failed):
            raise ItemError(p.item.id, p.message)
    return [p for p in batch if isinstance(p, Prepared)]


@dataclass(frozen=True)
class Batching:
    """How items are grouped into forward passes, and what an item that cannot be scored does:
    "fail" ends the batches after the ones before it, "skip" makes it a `Failed` entry."""

    size: int = BATCH_SIZE  # at most this many items
    tokens: int = BATCH_TOKENS  # about this many tokens through the model
    on_error: str = "fail"
    pruned: bool = False  # labels scored pruned: an item's labels cost about PRUNED_LABEL_TOKENS, not its whole trie
    head_alone: bool = False  # a fitted head answers alone: no option scored, one token (and a question's text) an answer
    judged: tuple[bool, ...] = ()  # with head_alone, per question: its options each judged yes/no (tags), read one by one

    def answering(self, spec: TaskSpec, alone: bool) -> "Batching":
        """This batching for `spec`'s items, its fitted head answering alone or not: what a row
        costs follows (`cost`)."""
        return replace(self, head_alone=alone, judged=judged_of(spec))

    def cost(self, prep: "Prepared") -> int:
        """What an item costs of `tokens`: its own tokens and its label tokens (a head answering
        alone: per answer position it reads, a question's text and one token: one position a
        question, one an option where each option is judged on its own)."""
        if self.head_alone:
            reads = [bool(self.judged[j]) if j < len(self.judged) else False for j in range(len(prep.spans))]
            return prep.own_tokens + sum((prep.skips[i] if prep.skips else 0) + 1
                                         for i in answer_positions(prep, reads))
        labels = len(trie(list(prep.candidates.values())))
        return prep.own_tokens + (min(labels, PRUNED_LABEL_TOKENS) if self.pruned else labels)


def answer_positions(prep: "Prepared", reads: Sequence[bool | None]) -> list[int]:
    """The candidates whose first scored token marks an answer position the questions read by
    `reads` need (None: not read), in question order: a question's first candidate, or (True: its
    options each judged yes/no) each option's first."""
    out = []
    for (at, _), (a, b), read in zip(prep.spans, prep.parts, reads):
        if read is not None:
            out += [prep.groups.members[k][0] for k in range(a, b)] if read else [at]
    return out


def judged_of(spec: TaskSpec) -> tuple[bool, ...]:
    """Per question the spec asks, whether each of its options is judged on its own (tags): what a
    head answering alone reads one position an option of (`Batching.judged`)."""
    return tuple(bool(q.kind.judged_each) for q in spec.questions) if spec.questions else \
        (bool(label_kind(spec).judged_each),)


PRUNED_LABEL_TOKENS = 32  # label tokens an item costs when pruned (measured: 18-24 with 60-106 labels)


class Task:
    """A spec, its model's tokenizer and prompt builder: everything but the model.

    Attributes:
        spec, source (which model), tokenizer, builder (prompts and candidates),
        load_seconds: time spent loading the tokenizer.
    """

    def __init__(self, spec: TaskSpec, source: ModelSource, tokenizer: PreTrainedTokenizerBase, load_seconds: float = 0.0,
                 cache_dir: Path | None = None):
        self.spec, self.source, self.tokenizer = spec, source, tokenizer
        self.builder = PromptBuilder(spec, tokenizer)
        self.load_seconds = load_seconds
        self.cache_dir = cache_dir  # where converted GGUF models are looked for (None: unknown)
        if spec.head is not None:
            spec.head.check(self.head_fingerprint())

    @classmethod
    def from_spec(cls, spec: TaskSpec, cache_dir: Path) -> "Task":
        """Resolve the spec's model and load its tokenizer (converted GGUF models are looked for
        under `cache_dir`)."""
        source = spec_model(spec)
        start = time.perf_counter()
        tokenizer = load_tokenizer(source, cache_dir)
        return cls(spec, source, tokenizer, time.perf_counter() - start, cache_dir)

    def with_spec(self, spec: TaskSpec) -> "Task":
        """The same model and tokenizer for another spec (its prompt is built anew)."""
        return Task(spec, self.source, self.tokenizer, cache_dir=self.cache_dir)

    @functools.cached_property
    def context(self) -> int | None:
        """The model's limit on positions as its config says (None: not known), read on first use
        only: a run passes the loaded model's own limit and never needs it."""
        return model_context(self.source, self.cache_dir) if self.cache_dir is not None else None

    def check_context(self, items: Iterable[Item]) -> None:
        """Before the model loads, when its config or file says its context: the prefix fits it
        (else PrefixTooLong) and so does every item (else its ItemError), known from the tokenizer."""
        if self.context is None:
            return
        check_prefix(len(self.builder.prefix_ids), self.context)
        for item in items:
            self.prepare(item)

    def prepare(self, item: Item, context: int | None = None) -> Prepared:
        """Tokens and candidates of one item; `context` is the model's limit on positions, when
        known. Raises ItemError for anything wrong with it."""
        try:
            self.spec.check_record(item.record)
        except ValueError as exc:
            raise ItemError(item.id, str(exc))
        context = context or self.context
        bound = MAX_CHARS_PER_TOKEN * (context or UNKNOWN_CONTEXT)  # refused before tokenising it costs gigabytes
        chars = sum(len(field_text(item.record[f])) for f in self.spec.item_fields())
        if self.spec.choices:
            chars += sum(len(option) for option in choice_list(item.record, self.spec.choices))
        if chars > bound:
            what = f"the model's context of {context} tokens" if context else f"any model's context ({UNKNOWN_CONTEXT} tokens)"
            raise TooLong(item.id, f"its fields hold {chars} characters, far more than {what}")
        enc = self.builder.encode_item(item.record, item.id)
        if self.spec.choices:
            options = choice_list(item.record, self.spec.choices)
            if self.spec.score_by == "letter":  # MMLU style: the letters are scored, the options reported
                candidates = self.builder.options(LETTERS[: len(options)], item.id)
            else:
                candidates = self.builder.options(options, item.id)
            groups = Groups(tuple(options), tuple((i,) for i in range(len(options))), "forms")
            spans: tuple[tuple[int, int], ...] = ((0, len(options)),)
            parts = spans
        else:
            candidates, groups = self.builder.candidates, self.builder.groups
            spans, parts = self.builder.spans, self.builder.parts
        longest = max(len(c) for c in candidates.values())
        if context and len(enc.ids) + longest - 1 > context:
            raise TooLong(item.id, f"{len(enc.ids)} prompt tokens do not fit the model's context of {context}")
        return Prepared(item, enc, candidates, groups, spans, parts, self.builder.skips)

    def asked(self, prep: Prepared) -> tuple[Question, ...]:
        """The questions an item's scores answer, as this task's spec asks them: its pack's, its
        label set as one question, or its own options as one (multiple choice)."""
        return self.builder.asked or (label_kind(self.spec).question(self.spec, prep.texts),)

    @property
    def questions(self) -> tuple[Question, ...]:
        """The questions every item is asked (a pack's, or a label spec's one; not multiple choice)."""
        return self.builder.asked or (label_kind(self.spec).question(self.spec, self.spec.label_names),)

    def head_fingerprint(self, model: str | None = None) -> dict[str, str]:
        """What a head fitted on this task is fitted on (task/head.py `fingerprint`); `model`: the
        model's `model_content_identity` when the caller has it already."""
        free = self.content_free("")
        questions = [(q.id, q.type, q.instructions, [*q.options, *(t for said in q.said for t in said),
                                                     *(shown(d) for d in q.descriptions)])
                     for q in self.questions]  # descriptions: a typed question's text the model reads
        return fingerprint(model or model_content_identity(self.source, self.cache_dir), self.builder.prefix_ids,
                           free.ids[free.prefix_len:], self.spec.template.text, questions)

    def answer_positions(self, prep: Prepared, reads: Sequence[bool | None]) -> list[int]:
        """`answer_positions` of an item of this task."""
        return answer_positions(prep, reads)

    def content_free(self, text: str) -> EncodedItem:
        """The prompt with every template field set to `text` (e.g. "" or "N/A")."""
        return self.builder.encode_item({f: text for f in self.spec.template.fields})

    def renders(self, item: Item) -> list[dict[str, Any]]:
        """Exactly the tokens the scorer uses for this item: one entry, or for typed questions one
        per question, whose `prompt_ids` run on through the question to where its answers start."""
        if not self.spec.questions:
            return [self.render(item)]
        prep = self.prepare(item)
        out, keys, ids = [], list(prep.candidates), list(prep.candidates.values())
        for q, (at, end) in zip(self.spec.questions, self.builder.spans):
            skip = prep.skips[at]
            stem = list(ids[at][:skip])
            scored = {key.split("\x1f", 1)[1]: list(cand[skip:]) for key, cand in zip(keys[at:end], ids[at:end])}
            entry: dict[str, Any] = {"id": item.id, "question": q.id, "type": q.type,
                                     "prompt": prep.enc.text + self.builder.stem_text(q.branch()),
                                     "prompt_ids": list(prep.enc.ids) + stem, "prefix_len": prep.enc.prefix_len,
                                     "candidates": scored}
            if any(said != (option,) for option, said in zip(q.options, q.said)):  # words or letters
                entry["options"] = {option: list(said) for option, said in zip(q.options, q.said)}
            out.append(entry)
        return out

    def render(self, item: Item) -> dict[str, Any]:
        """Exactly the tokens the scorer uses for this item (a task of one question)."""
        prep = self.prepare(item)
        return {
            "id": item.id,
            "prompt": prep.enc.text,
            "prompt_ids": list(prep.enc.ids),
            "prefix_len": prep.enc.prefix_len,
            "candidates": {k: list(v) for k, v in prep.candidates.items()},
            **({} if prep.groups.plain else {"labels": self.label_forms(prep)}),
        }

    @staticmethod
    def label_forms(prep: Prepared) -> dict[str, list[str]]:
        """Per label, the candidates that make its score: its forms, or its yes and no branches."""
        texts = list(prep.candidates)
        return {name: [texts[i] for i in members] for name, members in zip(prep.groups.names, prep.groups.members)}

    def batches(self, items: Iterable[Item], batching: Batching, context: int | None = None
                ) -> Iterator[list[Prepared | Failed]]:
        """Consecutive items, at most `batching.size` of them and about `batching.tokens` tokens
        through the model per batch (an item costs its own tokens plus its candidates' trie; a
        prompt already in the batch costs nothing). The batches depend only on the items from
        where batching starts, never on timing or on what was scored before, so a resumed run or
        a shard starting at a batch boundary forms exactly the batches of an uninterrupted run."""
        batch: list[Prepared | Failed] = []
        keys: set[tuple] = set()
        tokens = 0
        for item in items:
            try:
                prep = self.prepare(item, context)
            except ItemError as exc:
                if batching.on_error == "skip":
                    batch.append(Failed(item, str(exc)))
                    continue
                if batch:  # score what came before the bad item first
                    yield batch
                raise
            own = batching.cost(prep)
            cost = 0 if prep.key in keys else own
            if batch and (len(batch) >= batching.size or tokens + cost > batching.tokens):
                yield batch
                batch, keys, tokens, cost = [], set(), 0, own
            batch.append(prep)
            keys.add(prep.key)
            tokens += cost
        if batch:
            yield batch

    def batch_starts(self, items: Iterable[Item], batching: Batching, context: int | None = None) -> list[int]:
        """Where each batch starts (item positions), found by tokenising only."""
        starts, at = [], 0
        for batch in self.batches(items, batching, context):
            starts.append(at)
            at += len(batch)
        return starts


def check_prefix(tokens: int, context: int | None) -> None:
    """Refuse (PrefixTooLong) a static prefix of `tokens` tokens that leaves no room in `context`."""
    if context and tokens >= context:
        raise PrefixTooLong(f"the static prompt prefix has {tokens} tokens, more than the model's context of {context}; "
                            f"shorten the system text or the examples")
