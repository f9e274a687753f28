"""Replaying requests offline (`prefixcache decide`): a JSONL file of request bodies, System One or
OpenAI Decisions (told apart by `questions`: an object or a list), answered in order by the
server's engine, one response line per request line.

A response line: `{"custom_id": ..., "line": N, "response": {"status_code": S, "body": B}}`, the
body what the server would answer (the answer, or the error in that format's shape); a request's
optional `custom_id` is taken out of its body and echoed. Lines are answered in passes of `batch`
(lines sharing instructions share the cached prefix) and each pass's responses are written and
flushed before the next: `resume` continues an output from its last complete line, after checking
that its lines answer the same requests.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .. import safefile
from ..errors import InputError, OutputError
from .decider import Ask, Decided, Decider
from .defaults import MAX_BATCH
from .body import BadBody, parsed
from .errors import Invalid
from .wire import SYSTEM_ONE, WireFormat, format_of


@dataclass
class Replayed:
    """What a replay did: lines answered (200), refused (4xx), taken from an earlier run."""

    answered: int = 0
    refused: int = 0
    resumed: int = 0
    seconds: float = 0.0


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as stream:
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise InputError(f"{path}: cannot read the requests: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from exc


def request_digest(line: str) -> str:
    return hashlib.sha256(line.strip().encode("utf-8")).hexdigest()[:16]


def _parse(line: str) -> tuple[Any, WireFormat, Ask | None, Any, tuple[int, dict] | None]:
    """(custom_id, its format, ask, what its answer needs, error response)."""
    try:  # read as the server reads a body: no key twice, bounded depth, valid Unicode
        body = parsed(line.encode("utf-8", "surrogatepass"))
    except BadBody as exc:
        return None, SYSTEM_ONE, None, None, SYSTEM_ONE.invalid(Invalid([(("body",), str(exc), "value_error")]))
    except Invalid as exc:
        return None, SYSTEM_ONE, None, None, SYSTEM_ONE.invalid(exc)
    custom_id = body.pop("custom_id", None) if isinstance(body, dict) else None
    fmt = format_of(body)
    try:
        ask, needs = fmt.parse(body)
        return custom_id, fmt, ask, needs, None
    except Invalid as exc:
        return custom_id, fmt, None, None, fmt.invalid(exc)


def _response(fmt: WireFormat, got: Decided | Exception, needs: Any, model: str) -> tuple[int, dict]:
    if not isinstance(got, Decided):
        return fmt.refused(got)
    return 200, fmt.answer(got, needs, model)


def answer_lines(decider: Decider, lines: Sequence[str]) -> list[tuple[Any, int, dict]]:
    """Each request line's (custom_id, status, body), the lines' asks decided in one pass: the
    body what the server answers (the answer, or the error in the request's format)."""
    parsed = [_parse(line) for line in lines]
    answers = iter(decider.decide([ask for _, _, ask, _, error in parsed if error is None and ask is not None]))
    return [(custom_id, *(error if error is not None else _response(fmt, next(answers), needs, decider.name)))
            for custom_id, fmt, _, needs, error in parsed]


def done_lines(output: Path) -> tuple[list[dict], int]:
    """An earlier output's complete response lines and their size in bytes (a torn last line is
    left out, to be cut)."""
    records, size = [], 0
    with open(output, "rb") as stream:
        for raw in stream:
            if not raw.endswith(b"\n"):
                break
            try:
                records.append(json.loads(raw))
            except ValueError:
                break
            size += len(raw)
    return records, size


def replay(decider: Decider, requests: Path, output: Path, resume: bool = False, batch: int = MAX_BATCH,
           on_pass: Optional[Callable[[int, int], None]] = None) -> Replayed:
    """Answer every request line of `requests` into `output`; `on_pass(done, total)` after each pass."""
    lines = list(_lines(requests))
    result, start = Replayed(), time.perf_counter()
    safefile.check_target(output, "the responses")
    if output.exists() and not resume:
        raise OutputError(f"{output}: exists; --resume to continue it, or remove it")
    earlier, size = done_lines(output) if resume and output.exists() else ([], 0)
    for got, (number, line) in zip(earlier, lines):
        if got.get("line") != number or got.get("request_sha") != request_digest(line):
            raise OutputError(f"{output}: line {number} answers another request than {requests} holds there; "
                              f"write to a new file")
    result.resumed = len(earlier)
    stream = safefile.append(output, keep=size, what="the responses") if earlier else safefile.create(output, "the responses")
    with stream:
        todo = lines[len(earlier):]
        for at in range(0, len(todo), batch):
            chunk = todo[at: at + batch]
            for (number, line), (custom_id, status, body) in zip(chunk, answer_lines(decider, [t for _, t in chunk])):
                result.answered += status == 200
                result.refused += status != 200
                stream.write(json.dumps({"custom_id": custom_id, "line": number, "request_sha": request_digest(line),
                                         "response": {"status_code": status, "body": body}}, ensure_ascii=False) + "\n")
            stream.flush()
            if on_pass is not None:
                on_pass(result.resumed + at + len(chunk), len(lines))
    result.seconds = time.perf_counter() - start
    return result
