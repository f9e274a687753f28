"""What the tests share: specs, items, running a command as a user does, reading records back,
free ports. One place, so tests never copy helpers from file to file."""

from __future__ import annotations

import json
import random
import re
import socket
import weakref
from pathlib import Path
from typing import Any

import yaml

from prefixcache.task.spec import TaskSpec
from prefixcache.task.specfile import load_spec

ROOT = Path(__file__).resolve().parent.parent  # the checkout: configs/, data/samples/, docs/

# Labels chosen to break first-token scoring on the test tokenizer: `tech` is a token-prefix of
# `technical`, `bill`/`billing` share their first tokens, `account access` is long.
LABELS = ["tech", "technical", "bill", "billing", "account access", "x"]

TEXTS = [
    "The app crashes when I open a project.",
    "I was charged twice, please refund.",
    "Hi",
    "I forgot my password and cannot sign in to my account, and the reset email never arrives either.",
    ":: odd start",
    " leading space",
    "Error 502 from the API",
    "é accented",
    "refund the payment for my subscription invoice please",
    "x",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. " * 2,
]


def write_spec(tmp_path: Path, name: str = "spec.yaml", **data) -> Path:
    data.setdefault("system", "You are a support ticket router.")
    if "questions" not in data:
        data.setdefault("labels", LABELS)
    data.setdefault("template", "Ticket: {text}")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def make_spec(tmp_path: Path, **data) -> TaskSpec:
    return load_spec(write_spec(tmp_path, **data))


def invoke(*args: Any, **kwargs: Any):
    """A `prefixcache` command in-process, named as a user sees it (`prefixcache run ...`), with any
    argument given as a path or a number. `kwargs`: CliRunner.invoke's (input, env, ...)."""
    from typer.testing import CliRunner

    from prefixcache.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], prog_name="prefixcache", **kwargs)
    # stderr is no terminal here: its error line carries the time, as a log read later needs
    # (tested on its own); the tests read the messages without it.
    result.stderr_bytes = _unstamped(result.stderr_bytes)
    result.output_bytes = _unstamped(result.output_bytes)
    return result


def _unstamped(data: bytes) -> bytes:
    return re.sub(rb"(?m)^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: (?=(internal )?error: )", b"", data)


def records(path: Path, timing: bool = False) -> list[dict]:
    """A JSONL output's records, in file order; without `ms` (which differs between runs) unless
    `timing`."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    return rows if timing else [{k: v for k, v in row.items() if k != "ms"} for row in rows]


def free_port() -> int:
    """A TCP port nobody listens on now (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hand_record(rid, label, probs, gold=None, **kept):
    """A label task's record as `run` writes it, built by hand."""
    record = {"id": rid, **kept, "label": label, "prob": probs.get(label), "margin": 0.1, "probs": probs,
              "logprobs": {k: -1.0 for k in probs}, "normalize": "sum", "prefix_tokens": 10, "item_tokens": 3,
              "item_sha": "0" * 16, "ms": 1.0}
    if gold is not None:
        record.update(gold=gold, correct=label == gold)
    return record


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Two hand-built runs of eight items with gold "a": A gets 2 right; B fixes 5 of the 6 wrong ones and breaks one right one.
A = [hand_record(f"i{k}", "a" if k in (0, 1) else "b", {"a": 0.6 if k < 2 else 0.3, "b": 0.4 if k < 2 else 0.7}, "a",
          title=f"t{k}") for k in range(8)]
B_LABELS = ["b", "a", "a", "a", "a", "a", "a", "b"]  # i0 broken; i2..i6 fixed; i7 still wrong
B = [hand_record(f"i{k}", lab, {"a": 0.8 if lab == "a" else 0.2, "b": 0.2 if lab == "a" else 0.8}, "a", title=f"t{k}")
     for k, lab in enumerate(B_LABELS)]


_NAIVE = weakref.WeakKeyDictionary()  # model -> {(prompt ids, candidates): scores}


def naive_scores(model, prompt_ids, candidates) -> list[float]:
    """The slow reference (a full forward per candidate), computed once per model, prompt and
    candidates: tests that vary only the batching or the backend compare against the same values."""
    from prefixcache.model.reference import score_naive

    known = _NAIVE.setdefault(model, {})
    key = (tuple(prompt_ids), tuple(tuple(c) for c in candidates))
    if key not in known:
        known[key] = score_naive(model, prompt_ids, candidates)
    return known[key]


def whole_tag_prompt(tokenizer, spec, record, label: str, answer: str) -> tuple[str, bool]:
    """The whole prompt of a multi-label task for one (item, label) question and its answer,
    written out by hand from the spec (each example asked about every label, then the item), and
    whether the tokenizer adds its special tokens to it (plain layout)."""
    def ask(fields, name):
        return f"{spec.template.render(fields)}\n{spec.question.replace('{label}', name)}"

    yes, no = spec.answers
    shots = [(ask(ex, lab), yes if lab in ex["label"] else no) for ex in spec.examples for lab in spec.label_names]
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": spec.system_text()}]
        for said, ans in shots:
            messages += [{"role": "user", "content": said}, {"role": "assistant", "content": ans}]
        messages.append({"role": "user", "content": ask(record, label)})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt + answer + tokenizer.eos_token, False
    blocks = [spec.system_text()] + [f"{said}\n{spec.answer_prefix} {ans}" for said, ans in shots]
    return "\n\n".join(blocks + [f"{ask(record, label)}\n{spec.answer_prefix} {answer}\n"]), True


def naive_yes_logprob(model, tokenizer, spec, record, label: str) -> float:
    """log P(yes) / (P(yes) + P(no)) for one (item, label), from full forwards of the two whole
    prompts, each tokenised in one piece."""
    import math

    from prefixcache.task.prompt import common_prefix_len

    texts = [whole_tag_prompt(tokenizer, spec, record, label, answer) for answer in spec.answers]
    yes_ids, no_ids = (tokenizer(text, add_special_tokens=special)["input_ids"] for text, special in texts)
    shared = common_prefix_len(yes_ids, no_ids)
    lp_yes, lp_no = naive_scores(model, yes_ids[:shared], [yes_ids[shared:], no_ids[shared:]])
    return -math.log1p(math.exp(lp_no - lp_yes))


# -- helpers shared by the topic files (run/, data/, model/, cli/) --


# -- two processes on one output ---------------------------------------------------------------
LABELS3 = ["billing", "technical", "account"]


WORDS = "crash refund password invoice login error slow payment account screen update billing".split()


# -- damaged outputs and parts: resume and merge either finish correctly or refuse in one line ----------
def damage(data: bytes, rng: random.Random) -> bytes:
    lines = data.split(b"\n")[:-1]
    kind = rng.choice(["truncate", "garbage-tail", "garbage-line", "duplicate", "delete", "foreign", "swap"])
    if kind == "truncate":
        return data[: rng.randint(0, len(data))]
    if kind == "garbage-tail":
        return data + bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 40)))
    k = rng.randrange(len(lines))
    if kind == "garbage-line":
        lines.insert(k, bytes(rng.choice(b'{}[]":,ab\\ 01') for _ in range(rng.randint(1, 30))))
    elif kind == "duplicate":
        lines.insert(k, lines[k])
    elif kind == "delete":
        del lines[k]
    elif kind == "foreign":
        lines.insert(k, b'{"name": "not a record"}')
    else:
        j = rng.randrange(len(lines))
        lines[k], lines[j] = lines[j], lines[k]
    return b"\n".join(lines) + b"\n"


def items_file(tmp_path, n=3, name="in.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"id": f"i{k}", "text": f"ticket {k}"}) + "\n" for k in range(n)))
    return path


def jsonl_of_ids(path: Path, ids) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": f"ticket {i!s}"}) + "\n" for i in ids))
    return path


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ticket_rows(ids) -> list[dict]:
    return [{"id": f"t{n}", "text": f"{WORDS[n % 12]} {WORDS[(n * 5) % 12]} ticket {n}", "cat": "tech"} for n in ids]


def ticket_texts(n: int) -> list[str]:
    return [f"{WORDS[i % 12]} {WORDS[(i * 7) % 12]} number {i} " + "again " * (i % 5) for i in range(n)]


def refund_items_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": k, "text": f"ticket number {k} about a refund"}) + "\n" for k in range(n)))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_texts(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"id": f"i{n}", "text": t}) + "\n" for n, t in enumerate(texts)))
    return path


# A small pack of the three question kinds, and how a table row of its answers reads.
QUESTIONS = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "invoices", "tech": None}},
             "blocked": {"type": "noul", "instructions": "Is the customer blocked?"},
             "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]}}


def question_row_is(row: dict, answers: dict, tol: float = 1e-5) -> bool:
    """A table row's question columns say what a record's answers say."""
    team, blocked, mood = answers["team"], answers["blocked"], answers["mood"]
    return (row["team"] == team["choice"] and abs(row["team__confidence"] - team["confidence"]) < tol
            and all(abs(row[f"team__p__{x}"] - team["probabilities"][x]) < tol for x in ("billing", "tech"))
            and abs(row["blocked"] - blocked["noul"]) < tol and abs(row["mood"] - mood["score"]) < tol
            and all(abs(row[f"mood__p__{i}"] - mood["probabilities"][str(i)]) < tol for i in range(3)))


def tiny_scorer(spec: TaskSpec, tokenizer: Any, model: Any) -> Any:
    """A scorer of `spec` on a model built in the test (its prefix prefilled, not stored)."""
    from prefixcache.model.engine import Engine
    from prefixcache.model.load import ModelSource
    from prefixcache.scoring.prepare import Task
    from prefixcache.scoring.scorer import Scorer

    return Scorer.start(Task(spec, ModelSource("tiny", "dir", "."), tokenizer), Engine(model))


def text_items(texts: list[str]) -> list[Any]:
    """Items of the given texts, their ids 0, 1, ... (lines 1, 2, ...)."""
    from prefixcache.data.items import Item

    return [Item(i, {"id": i, "text": t}, i + 1) for i, t in enumerate(texts)]
