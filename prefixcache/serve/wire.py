"""The wire formats a request comes in, one contract (`WireFormat`) each implements: TypeSafe's
System One (serve/systemone.py) and OpenAI's Decisions (serve/decisions.py). The server's routes
(serve/app.py) and `decide`'s replay (serve/replay.py) run every format through it, never
branching on which one it is; a third format is one more value here. No HTTP stack here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import decisions, systemone
from .decider import Decided
from .errors import Invalid


@dataclass(frozen=True)
class WireFormat:
    """What one wire format says, so that every route runs one ladder (`_route`): `parse` (a body
    to the ask and what its answer needs), `count` (its questions, for the access log), `answer`,
    `invalid` (a body that does not validate), `refused` (a library error refusing the ask),
    `refusal` (a request refused before its body is read: status, message), `error` (status, code,
    message: the server's own conditions) and `bad_json`. A third format is one of these and one
    route line."""

    name: str
    parse: Callable[[Any], tuple[Any, Any]]
    count: Callable[[Any, Any], int]
    answer: Callable[[Decided, Any, str], dict[str, Any]]
    invalid: Callable[[Invalid], tuple[int, dict[str, Any]]]
    refused: Callable[[Exception], tuple[int, dict[str, Any]]]
    refusal: Callable[[int, str], tuple[int, dict[str, Any]]]
    error: Callable[[int, str, str], tuple[int, dict[str, Any]]]
    bad_json: Callable[[str], tuple[int, dict[str, Any]]]


REFUSAL_KINDS = {400: "invalid_request", 401: "authentication_error", 403: "forbidden"}
REFUSAL_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden"}
SYSTEM_ONE = WireFormat(
    name="systemone", parse=lambda body: (systemone.parse(body), None), count=lambda ask, _: len(ask.questions),
    answer=lambda decided, _, model: systemone.answer(decided, model), invalid=systemone.invalid,
    refused=systemone.refused, refusal=lambda status, message: systemone.failure(status, REFUSAL_KINDS[status], message),
    error=lambda status, code, message: systemone.failure(status, code, message),
    bad_json=lambda message: (422, {"detail": [{"loc": ["body"], "msg": message, "type": "value_error.jsondecode"}]}))
DECISIONS = WireFormat(
    name="decisions", parse=decisions.parse, count=lambda _, questions: len(questions), answer=decisions.answer,
    invalid=decisions.invalid, refused=decisions.refused,
    refusal=lambda status, message: decisions.failure(status, message, code=REFUSAL_CODES[status]),
    error=lambda status, code, message: decisions.failure(
        status, message, kind="server_error" if status >= 500 else "invalid_request_error", code=code),
    bad_json=lambda message: decisions.failure(400, message, code="invalid_json"))


def format_of(body: Any) -> WireFormat:
    """The format a request body is in, told apart by its `questions`: a list (Decisions) or an
    object (System One, whose errors a body of neither shape gets)."""
    return DECISIONS if isinstance(body, dict) and isinstance(body.get("questions"), list) else SYSTEM_ONE
