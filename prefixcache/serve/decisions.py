"""OpenAI's Decisions wire format (`POST /v1/decisions`): requests in, answers and errors out.

Request: `{model, input, questions: [question, ...]}`. `input` is a string (the state), or a list of
messages: the text of `system` and `developer` messages becomes the instructions (the cached
prefix), the text of the others (user and assistant messages, tool outputs) the state, each joined
by blank lines. Questions, in order (1 to 400): `predicate` (a yes/no question, asked as a System
One `noul`), `choice` (`choices: [{value, description?}]`, a value a string or a boolean: a boolean
is shown to the model as `true`/`false` and answered as the boolean; a string that reads like one
of the booleans given is shown quoted, so `"true"` and `true` stay two options), `score` (`levels: [{label,
description?}]`, level i is the score i; shown as `label: description`). Unknown fields are ignored.

Answer: `{model, answers: [...], usage}`, answers in question order with the question's `name`
(null when unnamed): predicate `{type, name, probability}`, choice `{type, name, choice,
probabilities: [{value, probability}], confidence}`, score `{type, name, score, probabilities:
[{value, label, probability}], confidence}`. `usage.input_tokens_details.cached_tokens` counts the
prefix tokens read from the cache instead of computed.

Errors: `{"error": {"message", "type", "param", "code"}}`, 400 `invalid_request_error` for a bad
request.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ItemError, PrefixTooLong, SpecError, TooLong
from .decider import Ask, Decided
from .errors import Invalid, TooCostly, said

MAX_QUESTIONS = 400
# keys of a spec's (and System One's) questions that this format has no place for: refused, never ignored
SPEC_ONLY = ("threshold", "gold", "normalize", "calibrate", "words", "read", "list", "criteria")


def _text(content: Any, where: tuple[Any, ...]) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                raise Invalid([(where + (i,), "only text parts are read (no images or files)", "invalid_value")])
        return "\n".join(parts)
    raise Invalid([(where, "content must be a string or a list of text parts", "invalid_type")])


def _input(value: Any) -> tuple[str, str]:
    """(instructions, state) from `input`."""
    if isinstance(value, str):
        return "", value
    if not isinstance(value, list) or not value:
        raise Invalid([(("input",), "input must be a string or a non-empty list of messages", "invalid_type")])
    system: list[str] = []
    rest: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise Invalid([(("input", i), "each input item must be an object", "invalid_type")])
        if "role" in item:
            (system if item["role"] in ("system", "developer") else rest).append(_text(item.get("content"), ("input", i)))
        elif "output" in item:  # a tool call's output
            rest.append(_text(item["output"], ("input", i, "output")))
        elif isinstance(item.get("arguments"), str) or isinstance(item.get("input"), str):  # a tool call (may be empty)
            rest.append(item["arguments"] if isinstance(item.get("arguments"), str) else item["input"])
        else:
            raise Invalid([(("input", i), "an input item must be a message or a tool call or output", "invalid_value")])
    return "\n\n".join(system), "\n\n".join(rest)


def _choice_names(choices: list[dict[str, Any]]) -> list[str]:
    """The option texts the model reads for choice values: a boolean as `true`/`false`, a string as
    it is, or quoted (`"true"`) where a boolean of the same text is among the choices."""
    booleans = {("true" if c["value"] else "false") for c in choices if isinstance(c["value"], bool)}
    return [("true" if c["value"] else "false") if isinstance(c["value"], bool)
            else json.dumps(c["value"], ensure_ascii=False) if c["value"] in booleans else c["value"] for c in choices]


def _question(q: Any, i: int) -> dict[str, Any]:
    """One question in the System One shape."""
    where = ("questions", i)
    if not isinstance(q, dict):
        raise Invalid([(where, "a question must be an object", "invalid_type")])
    kind, instructions = q.get("type"), q.get("instructions")
    spec_only = next((k for k in SPEC_ONLY if k in q), None)
    if spec_only is not None:
        raise Invalid([(where + (spec_only,), f"{spec_only} is a key of a batch spec's questions, not of this format: "
                                              f"send the question to /v1/systemone, which takes it", "unknown_parameter")])
    if not isinstance(instructions, (str, list)) or not instructions:
        raise Invalid([(where + ("instructions",), "instructions are required", "missing_required_parameter")])
    if isinstance(instructions, list):
        instructions = _text(instructions, where + ("instructions",))
    if kind == "predicate":
        return {"type": "noul", "instructions": instructions}
    if kind == "choice":
        choices = q.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) and isinstance(c.get("value"), (str, bool))
                                                    for c in choices):
            raise Invalid([(where + ("choices",), "choices must be a list of {value, description?}, each value a "
                                                  "string or a boolean", "invalid_type")])
        names = _choice_names(choices)
        if len(set(names)) != len(names):
            raise Invalid([(where + ("choices",), "choice values must be unique", "invalid_value")])
        return {"type": "choice", "instructions": instructions,
                "criteria": {name: c.get("description") for name, c in zip(names, choices)}}
    if kind == "score":
        levels = q.get("levels")
        if not isinstance(levels, list) or not all(isinstance(v, dict) and isinstance(v.get("label"), str) for v in levels):
            raise Invalid([(where + ("levels",), "levels must be a list of {label, description?}", "invalid_type")])
        return {"type": "score", "instructions": instructions,
                "criteria": [f"{v['label']}: {v['description']}" if v.get("description") else v["label"] for v in levels]}
    raise Invalid([(where + ("type",), "type must be predicate, choice or score", "invalid_value")])


def parse(body: Any) -> tuple[Ask, list[dict[str, Any]]]:
    """A request body as an ask, and its questions as given (for the answers' names and values)."""
    if not isinstance(body, dict):
        raise Invalid([((), "the request body must be a JSON object", "invalid_type")])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise Invalid([(("model",), "model is required", "missing_required_parameter")])
    if "input" not in body:
        raise Invalid([(("input",), "input is required", "missing_required_parameter")])
    instructions, state = _input(body["input"])
    if not state.strip():
        raise Invalid([(("input",), "input has no state to decide on: give a string, or messages besides the system "
                                    "and developer ones (their text is the instructions)", "invalid_value")])
    questions = body.get("questions")
    if not isinstance(questions, list) or not 1 <= len(questions) <= MAX_QUESTIONS:
        raise Invalid([(("questions",), f"questions must be a list of 1 to {MAX_QUESTIONS} questions", "invalid_value")])
    pack = {qid: _question(q, i) for i, (qid, q) in enumerate(zip(question_ids(questions), questions))}
    return Ask(instructions, state, pack), questions


def question_ids(questions: list[Any]) -> list[str]:
    """The pack's question ids: the questions' names where every one has its own (so a head
    fitted on a pack with those ids answers them, as the System One route names them), else
    q0, q1, ... in order."""
    names = [q.get("name") if isinstance(q, dict) else None for q in questions]
    if all(isinstance(n, str) and n.strip() for n in names) and len(set(names)) == len(names):
        return names  # type: ignore[return-value]
    return [f"q{i}" for i in range(len(questions))]


READOUT_KEYS = ("x_readout", "x_readout_why")  # what answered it, when heads are served, as on System One


def answer(decided: Decided, questions: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The response body: one answer per question, in order (each with what answered it, when
    heads are served)."""
    out = []
    for qid, q in zip(question_ids(questions), questions):
        got = decided.answers[qid]
        name = q.get("name")
        if got["type"] == "noul":
            out.append({"type": "predicate", "name": name, "probability": got["noul"]})
        elif got["type"] == "choice":
            value = dict(zip(_choice_names(q["choices"]), (c["value"] for c in q["choices"])))
            out.append({"type": "choice", "name": name, "choice": value[got["choice"]],
                        "probabilities": [{"value": value[k], "probability": p} for k, p in got["probabilities"].items()],
                        "confidence": got["confidence"]})
        else:
            labels = [level["label"] for level in q["levels"]]
            out.append({"type": "score", "name": name, "score": got["score"],
                        "probabilities": [{"value": int(k), "label": labels[int(k)], "probability": p}
                                          for k, p in got["probabilities"].items()],
                        "confidence": got["confidence"]})
        out[-1].update({k: v for k, v in got.items() if k in READOUT_KEYS})
    usage = {"input_tokens": decided.input_tokens,
             "input_tokens_details": {"cached_tokens": decided.cached_tokens, "cache_write_tokens": decided.written_tokens},
             "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": decided.input_tokens}
    return {"object": "decision", "model": model, "answers": out, "usage": usage}


def failure(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
            code: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(error: Invalid) -> tuple[int, dict[str, Any]]:
    """A bad request: 400, the first problem's location as `param`."""
    loc = error.problems[0][0]
    loc = loc[1:] if loc[:1] == ("body",) else loc  # where in the body (the body reader names it so)
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc)) or None
    return failure(400, str(error) if len(error.problems) > 1 else error.problems[0][1], param=param,
                   code=error.problems[0][2])


def refused(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The answer to a request the engine refused: a pack `run` would refuse, a state beyond the
    model's context (both 400); any other error is raised again."""
    if isinstance(exc, SpecError):
        return failure(400, said(exc), param="questions", code="invalid_value")
    if isinstance(exc, (TooLong, PrefixTooLong)):
        return failure(400, said(exc), param="input", code="max_tokens_exceeded")
    if isinstance(exc, ItemError):  # a state `run` would refuse as an item
        return failure(400, said(exc), param="input", code="invalid_value")
    if isinstance(exc, TooCostly):
        return failure(413, str(exc), code="request_too_costly")
    raise exc
