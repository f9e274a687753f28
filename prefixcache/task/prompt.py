"""Rendering prompts, finding the token-clean static prefix, and tokenising the candidates.

No torch here: the tokenizer is used through `__call__`, `apply_chat_template` and a few
attributes, so any Hugging Face tokenizer works.

The layout (documented in the README, "How the prompt is built"):
- chat (the tokenizer has a chat template): a system turn with the system text and the label
  list, each few-shot example as a user turn (the rendered template) and an assistant turn (its
  label), then the item as a user turn and the generation prompt. A candidate is the label text
  followed by the template's end-of-turn token, so `tech` and `technical` are told apart.
- plain: system text, blank line, then each example as `<template>\\n<answer_prefix> <label>`
  separated by blank lines, then the item and `<answer_prefix>`. A candidate is
  ` <label>` followed by a line break.

Multi-label tasks and typed questions branch after the item: the item's prompt stops after its
text and a line break, and each question (its text, then what ends the user's turn and opens the
answer) is the leading part of its answers' candidates. For typed questions that leading part is
read, not scored (`skips`), and a question never sees another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from jinja2 import TemplateError

from ..errors import ItemError, ModelError, SpecError
from .decision import Groups
from .kind import Question
from .questions import label_kind
from .spec import (
    LETTERS,
    OPTIONS_FIELD,
    TaskSpec,
    choice_list,
    lettered_options,
    option_of,
)

# What a model's chat template raises on messages it refuses (jinja's raise_exception, a role it
# lacks) or when there is no template.
TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError)

if TYPE_CHECKING:  # any Hugging Face tokenizer
    from transformers import PreTrainedTokenizerBase

# Field values used to find where item text starts and which prefix tokens never merge with it.
_PROBES = ("A", "a", "1", " ", "  x", "\n", "\t", ".", ",", ":", "'s", '"', "-", "<", "é", "中", "x y", "")
_SENTINEL = "\u2063PREFIXCACHE\u2063"
ASK_SEP = "\n"  # multi-label: between the item's text and the question about a label
TAIL_CHARS = 64  # a question stem's tail encoded with each answer: its last lines, at least this long


@dataclass(frozen=True)
class EncodedItem:
    text: str
    ids: tuple[int, ...]
    prefix_len: int  # how many leading ids are the cached prefix (at most len(ids) - 1)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptBuilder:
    """Turns item records into token ids that share one cached prefix, and labels into candidates.

    Attributes:
        mode: "chat" or "plain".
        prefix_ids: the static prefix, the same leading ids for every item (token-clean).
        candidates: label name -> ids scored after the prompt (label tokens + end-of-answer).
    """

    def __init__(self, spec: TaskSpec, tokenizer: PreTrainedTokenizerBase):
        self.spec, self.tok = spec, tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if spec.format == "chat" and not has_template:
            raise SpecError(f"{spec.path}: 'format: chat' but the model's tokenizer has no chat template")
        self.mode = "chat" if (spec.format == "chat" or (spec.format == "auto" and has_template)) else "plain"
        self._system_role = True
        self._system = spec.system_text()
        self._after_question: str | None = None
        self.skips: tuple[int, ...] = ()  # typed questions: per candidate, its stem's ids (read, not scored)
        self.spans: tuple[tuple[int, int], ...] = ()  # per question asked, its candidates (start, end)
        self.parts: tuple[tuple[int, int], ...] = ()  # per question asked, its options (start, end)
        self.prefix_ids = self._find_prefix()
        if not self.prefix_ids:
            raise SpecError(f"{spec.path}: the static prompt prefix is empty (no system text, no examples, and the "
                            f"tokenizer adds no BOS token), so there is nothing to cache; add a 'system' text")
        self.end_of_answer = self._end_of_answer()
        self.candidates = self._candidates()

    # -- rendering ---------------------------------------------------------------------------
    def render(self, record: Mapping[str, Any], item_id: object = None) -> str:
        """The item's prompt. Multi-label: up to the questions, which are the branches scored
        after it (`branch_text`)."""
        body = self._body(record, item_id)
        if not self.branched:
            return self._render_full(body)
        text = self._render_full(f"{body}{ASK_SEP}{_SENTINEL}")
        return text[: text.index(_SENTINEL)]

    def _render_full(self, body: str) -> str:
        return self._render_chat(body) if self.mode == "chat" else self._render_plain(body)

    @property
    def branched(self) -> bool:
        """Questions are branches after the item (multi-label and typed questions): the item's
        prompt stops where they start."""
        return self.spec.multi_label or bool(self.spec.questions)

    def branch_text(self, question: str, answer: str) -> str:
        """Multi-label and typed questions: what follows the item's prompt for one question and
        answer, to the end of the answer."""
        return self.stem_text(question) + self.candidate_text(answer)

    def stem_text(self, question: str) -> str:
        """A question as it follows the item's prompt, up to where its answer starts."""
        if self._after_question is None:
            text = self._render_full(_SENTINEL)
            self._after_question = text[text.index(_SENTINEL) + len(_SENTINEL):]
        return question + self._after_question

    def _body(self, record: Mapping[str, Any], item_id: object = None) -> str:
        """The template filled in; with a lettered layout `{options}` shows the item's options as
        "A. ...\nB. ..." lines."""
        choices = self.spec.choices
        if self.spec.lettered and choices is not None and isinstance(record.get(choices), (list, str)):
            try:
                record = {**record, OPTIONS_FIELD: lettered_options(choice_list(record, choices))}
            except ValueError:
                pass  # not a list of options (a probe, a content-free prompt): shown as it is
        return self.spec.template.render(record, item_id)

    def answer_of(self, example: Mapping[str, Any]) -> str:
        """What a few-shot example's answer turn says: its label, or for multiple choice its
        option's text or letter (as `score_by` asks)."""
        label = str(example["label"])
        if not self.spec.choices:
            return label
        options = choice_list(example, self.spec.choices)
        option = option_of(label, options)
        if option is None:  # the spec's check of its examples refuses this before any prompt is built
            raise SpecError(f"a few-shot example's label {label!r} is not one of its options")
        return LETTERS[options.index(option)] if self.spec.score_by == "letter" else option

    def _shots(self) -> list[tuple[str, str]]:
        """The few-shot examples as (what the user says, the answer). A multi-label example is
        one shot per label: its text and the label's question, answered yes or no."""
        if self.spec.questions:
            return self._question_shots()
        if not self.spec.multi_label:
            return [(self._body(ex), self.answer_of(ex)) for ex in self.spec.examples]
        yes, no = self.spec.answers
        return [(f"{self._body(ex)}{ASK_SEP}{self.spec.question_for(label)}", yes if label.name in ex["label"] else no)
                for ex in self.spec.examples for label in self.spec.labels]

    def _question_shots(self) -> list[tuple[str, str]]:
        """A question example is one shot per question it answers: its text and the question,
        answered by the option's first scored text. Within an example the shots follow the
        questions' text, never the pack's order or ids, so reordering or renaming questions
        leaves the prompt as it is."""
        shots = []
        for ex in self.spec.examples:
            asked = sorted((self.spec.question_named(qid) for qid in ex["answers"]), key=lambda q: q.branch())
            for q in asked:
                shots.append((f"{self._body(ex)}{ASK_SEP}{q.branch()}", q.said[q.options.index(ex["answers"][q.id])][0]))
        return shots

    def _render_plain(self, body: str) -> str:
        blocks = [self._system] if self._system.strip() else []
        for said, answer in self._shots():
            blocks.append(f"{said}\n{self.spec.answer_prefix} {answer}")
        blocks.append(f"{body}\n{self.spec.answer_prefix}")
        return "\n\n".join(blocks)

    def _messages(self, body: str) -> list[dict[str, str]]:
        turns = []
        for said, answer in self._shots():
            turns.append({"role": "user", "content": said})
            turns.append({"role": "assistant", "content": answer})
        turns.append({"role": "user", "content": body})
        if self._system_role:
            return [{"role": "system", "content": self._system}, *turns]
        # Templates without a system role (e.g. Gemma): the system text opens the first user turn.
        turns[0] = {"role": "user", "content": f"{self._system}\n\n{turns[0]['content']}"}
        return turns

    def _apply(self, messages: list[dict[str, str]], generation: bool) -> str:
        try:
            return _text(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))
        except TEMPLATE_ERRORS as exc:  # the template is the model's
            raise ModelError(f"the model's chat template failed: {exc}")

    def _render_chat(self, body: str) -> str:
        if self._system_role:
            try:
                return _text(self.tok.apply_chat_template(self._messages(body), tokenize=False, add_generation_prompt=True))
            except TEMPLATE_ERRORS:  # e.g. "System role not supported": the text opens the first turn
                self._system_role = False
        return self._apply(self._messages(body), generation=True)

    def encode(self, text: str) -> list[int]:
        # A chat template writes its own special tokens (BOS included) into the text.
        return list(self.tok(text, add_special_tokens=self.mode == "plain")["input_ids"])

    # -- prefix and candidates ---------------------------------------------------------------
    def _probe_ids(self) -> list[list[int]]:
        fields = self.spec.template.fields
        return [self.encode(self.render({f: value for f in fields})) for value in _PROBES]

    def _find_prefix(self) -> tuple[int, ...]:
        """The longest run of leading ids shared by every probe item, leaving each at least one
        id of its own. Real items are checked again one by one (`encode_item`)."""
        probes = self._probe_ids()
        first = probes[0]
        n = min(len(p) for p in probes) - 1
        for p in probes[1:]:
            n = min(n, common_prefix_len(first, p))
        return tuple(first[: max(n, 0)])

    def _end_of_answer(self) -> str:
        """The text a chat template puts right after an assistant answer, when it is a special
        token (e.g. `<|im_end|>`); empty when there is none. Plain mode ends answers with "\\n"."""
        if self.mode == "plain":
            return "\n"
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._apply(msgs, generation=False)
        at = text.find(_SENTINEL)
        if at < 0:
            return ""
        tail = text[at + len(_SENTINEL):]
        ids = self.encode(tail) if tail else []
        if not ids:
            return ""
        special = set(getattr(self.tok, "all_special_ids", ()) or ())
        added = getattr(self.tok, "added_tokens_decoder", {}) or {}
        if ids[0] in special or getattr(added.get(ids[0]), "special", False):
            return str(self.tok.convert_ids_to_tokens(ids[0]))
        return ""

    def candidate_text(self, label: str) -> str:
        return (f" {label}" if self.mode == "plain" else label) + self.end_of_answer

    def _tail_anchor(self) -> str:
        """The static text after the last item field: what every candidate directly follows."""
        marker = "\ue000"
        text = self.render({f: marker for f in self.spec.template.fields})
        return text[text.rindex(marker) + 1:]

    def candidate_ids(self, text: str, whole: bool = False) -> tuple[int, ...]:
        """Ids of a label or option (with the end of answer) as they follow the prompt; `whole`:
        `text` is already all that follows (a multi-label branch). Cut from the tokenisation of
        prompt tail + candidate, which must split token-clean."""
        ids = self._candidate_cache.get(text)
        if ids is None:
            joined = self.encode(self._anchor + (text if whole else self.candidate_text(text)))
            n = len(self._anchor_ids)
            if joined[:n] != self._anchor_ids or len(joined) == n:
                raise SpecError(
                    f"{self.spec.path}: {text!r} does not split token-clean from the prompt "
                    f"(the tokenizer merges it with the text before it)"
                )
            ids = tuple(joined[n:])
            if len(self._candidate_cache) > 65536:
                self._candidate_cache.clear()
            self._candidate_cache[text] = ids
        return ids

    def options(self, texts: Sequence[str], item_id: object = None, whole: bool = False) -> dict[str, tuple[int, ...]]:
        """Candidate ids for each text; texts that tokenise identically cannot be told apart."""
        out: dict[str, tuple[int, ...]] = {}
        seen: dict[tuple[int, ...], str] = {}
        for text in dict.fromkeys(texts):
            ids = self.candidate_ids(text, whole)
            if ids in seen:
                where = f"item {item_id!r}: options" if item_id is not None else f"{self.spec.path}: labels"
                raise (ItemError(item_id, f"options {seen[ids]!r} and {text!r} tokenise to the same ids")
                       if item_id is not None else SpecError(f"{where} {seen[ids]!r} and {text!r} tokenise to the same ids"))
            seen[ids] = text
            out[text] = ids
        return out

    def _candidates(self) -> dict[str, tuple[int, ...]]:
        """What is scored after each item: every scored text of every question asked (`asked`:
        a pack's questions, or a label spec's one question; none for multiple choice, whose
        options are the item's). `groups` says which candidates make each option's score,
        `spans` and `parts` where each question's candidates and options start and end."""
        self._candidate_cache: dict[str, tuple[int, ...]] = {}
        self._anchor = self._tail_anchor()
        self._anchor_ids = self.encode(self._anchor)
        spec = self.spec
        self.asked: tuple[Question, ...] = spec.questions or ((label_kind(spec).question(spec),) if spec.labels else ())
        if spec.questions:
            return self._question_candidates()
        if spec.multi_label:
            members = [tuple(self.branch_text(spec.question_for(label), answer) for answer in spec.answers)
                       for label in spec.labels]
            return self._label_candidates(members, "yes/no")
        return self._label_candidates([label.forms for label in spec.labels], "forms")

    def _label_candidates(self, members: list[tuple[str, ...]], kind: str) -> dict[str, tuple[int, ...]]:
        """A label spec's candidates: each label's forms, or its yes and no branches (`whole`)."""
        texts = [text for group in members for text in group]
        candidates = self.options(texts, whole=kind == "yes/no")
        order = list(candidates)
        self.groups = Groups(self.spec.label_names, tuple(tuple(order.index(t) for t in group) for group in members),
                             kind)
        self.spans = ((0, len(candidates)),) if members else ()
        self.parts = ((0, len(members)),) if members else ()
        return candidates

    def _after_stem(self, stem_text: str, stem: tuple[int, ...], texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Each answer's candidate ids after a question's stem (`stem`: the stem's ids). The
        stem's last lines are encoded with each answer instead of the whole stem, so a stem that
        lists 255 described options is encoded once, not 255 times; this holds when the tail
        tokenises alike alone and within the stem, each answer splits token-clean from it, and the
        first and last answers give what encoding the whole gives: otherwise every answer is
        encoded whole (the reference)."""
        def whole(text: str) -> tuple[int, ...]:
            return self.candidate_ids(stem_text + self.candidate_text(text), whole=True)

        cut = stem_text.rfind("\n", 0, len(stem_text) - TAIL_CHARS) + 1
        if cut <= 0 or len(texts) < 3:
            return [whole(t) for t in texts]
        tail = stem_text[cut:]
        tail_ids = self.tok(tail, add_special_tokens=False)["input_ids"]
        out = []
        for text in texts:
            joined = self.tok(tail + self.candidate_text(text), add_special_tokens=False)["input_ids"]
            if joined[: len(tail_ids)] != tail_ids or len(joined) == len(tail_ids):
                return [whole(t) for t in texts]
            out.append(stem + tuple(joined[len(tail_ids):]))
        if list(stem[-len(tail_ids):]) != tail_ids or out[0] != whole(texts[0]) or out[-1] != whole(texts[-1]):
            return [whole(t) for t in texts]
        return out

    def _question_candidates(self) -> dict[str, tuple[int, ...]]:
        """Typed questions: each scored text of each option of each question, after its question's
        stem; `self.skips` holds per candidate the stem's length (read, not scored), and
        `self.spans` per question where its candidates start and end, in option order."""
        candidates: dict[str, tuple[int, ...]] = {}
        skips, spans = [], []
        for q in self.spec.questions:
            stem_text = self.stem_text(q.branch())
            stem = self.candidate_ids(stem_text, whole=True)
            start = len(candidates)
            seen: dict[tuple[int, ...], str] = {}
            for text, ids in zip(q.texts, self._after_stem(stem_text, stem, q.texts)):
                if ids[: len(stem)] != stem or len(ids) == len(stem):
                    raise SpecError(f"{self.spec.path}: question {q.id!r}: answer {text!r} does not split "
                                    f"token-clean from the question (the tokenizer merges it with the text before it)")
                if ids in seen:
                    raise SpecError(f"{self.spec.path}: question {q.id!r}: {seen[ids]!r} and {text!r} tokenise to the "
                                    f"same ids")
                seen[ids] = text
                candidates[f"{q.id}\x1f{text}"] = ids
                skips.append(len(stem))
            spans.append((start, len(candidates)))
        self.skips, self.spans = tuple(skips), tuple(spans)
        names: list[str] = []
        members: list[tuple[int, ...]] = []
        parts: list[tuple[int, int]] = []
        for q, (start, _) in zip(self.spec.questions, spans):
            parts.append((len(names), len(names) + len(q.options)))
            names += [f"{q.id}\x1f{option}" for option in q.options]
            members += [tuple(start + i for i in m) for m in q.groups.members]
        self.parts = tuple(parts)
        self.groups = Groups(tuple(names), tuple(members), "forms")
        return candidates

    def encode_item(self, record: Mapping[str, Any], item_id: object = None) -> EncodedItem:
        text = self.render(record, item_id)
        ids = self.encode(text)
        # An item whose first characters merge with the prefix's last tokens shares fewer ids;
        # the engine then masks the cached positions it does not share.
        shared = min(common_prefix_len(ids, self.prefix_ids), len(ids) - 1)
        return EncodedItem(text, tuple(ids), shared)


def _text(rendered: object) -> str:
    """A chat template's rendering as text (asked for text, a tokenizer gives a string)."""
    if not isinstance(rendered, str):
        raise ModelError(f"the model's chat template gave {type(rendered).__name__}, not text")
    return rendered
