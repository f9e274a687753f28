"""TypeSafe's System One wire format (`POST /v1/systemone`): requests in, answers and errors out.

Request: `{model, state, instructions?, questions: {id: question}}`; `state` a string, an object or
an array (objects and arrays are shown to the model as JSON text), `instructions` text, an object or
an array; unknown top-level fields are ignored. The questions are checked by the same rules as a
spec's `questions:` (task/questions.py), so a pack can be pasted between a spec and a request.

Answer: `{model, answers: {id: answer}, usage: {input_tokens, output_tokens, x_cached_tokens}}`,
each answer in the shape of a record's `answers` (task/kind.py; extra fields prefixed `x_`).

Errors: validation errors are 422 `{"detail": [{"loc", "msg", "type"}]}`; others carry
`{"detail": {"error_type", "message"}}` (401 `authentication_error`, 400 `max_tokens_exceeded`,
413 `request_too_large`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ItemError, PrefixTooLong, SpecError, TooLong
from .decider import Ask, Decided, state_text
from .errors import Invalid, TooCostly, said


def parse(body: Any) -> Ask:
    """A request body (parsed JSON) as an ask; raises Invalid with every problem found."""
    if not isinstance(body, dict):
        raise Invalid([(("body",), "the request body must be a JSON object", "type_error.dict")])
    problems: list[tuple[tuple[Any, ...], str, str]] = []
    if not isinstance(body.get("model"), str) or not body["model"]:
        problems.append((("body", "model"), "field required: the model name (any name is accepted)", "value_error.missing"))
    state = body.get("state")
    if state is None:
        problems.append((("body", "state"), "field required: a string, an object or an array", "value_error.missing"))
    elif not isinstance(state, (str, dict, list)):
        problems.append((("body", "state"), "state must be a string, an object or an array", "type_error"))
    elif not state or (isinstance(state, str) and not state.strip()):
        problems.append((("body", "state"), "state must not be empty: it is what the questions are asked about",
                         "value_error"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, (str, dict, list)):
        problems.append((("body", "instructions"), "instructions must be text, an object or an array", "type_error"))
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        problems.append((("body", "questions"), "field required: an object of question id -> question, at least one",
                         "value_error.missing" if questions is None else "type_error.dict"))
    else:
        for qid, question in questions.items():
            if not qid:
                problems.append((("body", "questions", qid), "a question id must be a non-empty string", "value_error"))
            elif not isinstance(question, dict):
                problems.append((("body", "questions", qid), "a question must be an object", "type_error.dict"))
            elif not isinstance(question.get("type"), str):
                problems.append((("body", "questions", qid, "type"), "field required: choice, noul or score",
                                 "value_error.missing"))
            elif "gold" in question:
                problems.append((("body", "questions", qid, "gold"), "gold names the item field a batch spec grades a "
                                 "question by; a request has no such field (grade the answers offline, or run a spec)",
                                 "value_error"))
    if problems or not isinstance(questions, dict):
        raise Invalid(problems)
    return Ask(instructions if isinstance(instructions, str) else "" if instructions is None else instructions,
               state_text(state), questions)


def answer(decided: Decided, model: str) -> dict[str, Any]:
    """The response body for an ask's answers."""
    return {"model": model, "answers": decided.answers,
            "usage": {"input_tokens": decided.input_tokens, "output_tokens": 0,
                      "x_cached_tokens": decided.cached_tokens}}


def invalid(error: Invalid) -> tuple[int, dict[str, Any]]:
    """A validation error: 422 with one `detail` entry per problem."""
    return 422, {"detail": [{"loc": list(loc), "msg": msg, "type": kind} for loc, msg, kind in error.problems]}


def failure(status: int, error_type: str, message: str) -> tuple[int, dict[str, Any]]:
    """Any other error: `detail.error_type` and `detail.message`."""
    return status, {"detail": {"error_type": error_type, "message": message}}


def refused(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The answer to a request the engine refused: a pack `run` would refuse (422), a state
    or instructions beyond the model's context (400 `max_tokens_exceeded`); any other error is raised again."""
    if isinstance(exc, SpecError):
        return invalid(Invalid([(("body", "questions"), said(exc), "value_error")]))
    if isinstance(exc, (TooLong, PrefixTooLong)):
        return failure(400, "max_tokens_exceeded", said(exc))
    if isinstance(exc, ItemError):  # a state `run` would refuse as an item
        return invalid(Invalid([(("body", "state"), said(exc), "value_error")]))
    if isinstance(exc, TooCostly):
        return failure(413, "request_too_costly", str(exc))
    raise exc
