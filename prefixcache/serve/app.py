"""The HTTP server: a Starlette app on uvicorn, the model in one worker thread (serve/decider.py).

Routes: `POST /v1/systemone` (serve/systemone.py), `POST /v1/decisions` (serve/decisions.py),
`GET /v1/models` (both clients' lists in one body), `GET /health`. Every request body is read here
once: at most `max_body` bytes (413 beyond, compressed or not), `Content-Encoding` gzip or zstd
undone, JSON parsed; a bad request gets a 4xx in its format's shape, never a 5xx. With a key, a
request must carry `Authorization: Bearer KEY` (401 otherwise); without one the header is
accepted and ignored. One access-log line per request on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import itertools
import json
import logging
import signal
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import date
from typing import Any, Awaitable, Callable, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import PrefixTooLong, SpecError, TooLong
from . import decisions, systemone
from ..scoring.options import ScoringOptions
from .decider import Batcher, Decided, Decider
from .defaults import BATCH_WAIT_MS, MAX_BATCH
from ..task.head import Head
from .errors import Invalid

log = logging.getLogger("prefixcache.serve")
MAX_BODY = 8 * 1024 * 1024  # bytes of a request body, compressed and uncompressed
DRAIN = 4  # an oversized body is read and dropped up to this many times the limit, then the connection closes
_ids = itertools.count(1)


class TooLarge(Exception):
    pass


class BadBody(Exception):
    pass


@dataclass
class Settings:
    """What the app needs besides its batcher: the served model's name, the key (None: no auth)
    and the body limit."""

    model: str
    key: str | None = None
    max_body: int = MAX_BODY


async def _body(request: Request, limit: int) -> Any:
    """The request's JSON body, decompressed; TooLarge past `limit` bytes, BadBody when unreadable."""
    declared = request.headers.get("content-length")
    raw, over = bytearray(), bool(declared and declared.isdigit() and int(declared) > limit)
    drained = 0
    async for chunk in request.stream():  # an oversized body is read and dropped (up to a bound), so that
        if over:                          # the client, still sending, gets the 413 rather than a reset
            drained += len(chunk)
            if drained > DRAIN * limit:
                break
            continue
        raw += chunk
        over = len(raw) > limit
    if over:
        raise TooLarge()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    data = _inflated(bytes(raw), encoding, limit)
    if len(data) > limit:
        raise TooLarge()
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadBody(f"the body is not JSON: {exc}") from exc


def _inflated(data: bytes, encoding: str, limit: int) -> bytes:
    """The body with its Content-Encoding undone, read to at most `limit` + 1 bytes."""
    if encoding in ("identity", ""):
        return data
    if encoding == "gzip":
        try:
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data, limit + 1)
        except zlib.error as exc:
            raise BadBody(f"the body is not valid gzip: {exc}") from exc
    if encoding == "zstd":
        import zstandard

        try:
            return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read(limit + 1)
        except zstandard.ZstdError as exc:
            raise BadBody(f"the body is not valid zstd: {exc}") from exc
    raise BadBody(f"unsupported Content-Encoding {encoding!r} (gzip, zstd or none)")


def _authorized(request: Request, key: str | None) -> bool:
    if key is None:
        return True
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def served_app(model: str | None, options: ScoringOptions, key: str | None = None, wait_ms: float = BATCH_WAIT_MS,
               batch: int = MAX_BATCH, heads: Sequence[Head] = (), revision: str | None = None) -> tuple[Starlette, Batcher]:
    """What `serve` runs, and each Ray Serve replica (serve/rayserve.py): the model loaded, its
    batcher's worker started (`wait_ms`, `batch`: see `Batcher`) and the app answering with it;
    `heads`: fitted heads, each answering the requests of the pack it was fitted on."""
    # the model is loaded on the worker thread that will run it (see Batcher._build)
    batcher = Batcher(lambda: Decider(model, options, heads=heads, revision=revision), wait_ms / 1000, batch)
    return build_app(batcher, Settings(batcher.decider.name, key)), batcher


def build_app(batcher: Batcher, settings: Settings) -> Starlette:
    """The app answering with `batcher`'s model."""

    async def decide(ask, request: Request) -> Decided:
        """The ask's answer; while it waits, whether its client is still there: a client that
        hung up abandons it (dropped from the queue when nobody else waits for it)."""
        future = batcher.submit(ask)
        waiting = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                batcher.abandon(future)  # not cancelled: another caller may share it; the worker settles it
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: never "not retrieved"
                raise ClientGone()

    routes = [Route("/v1/systemone", _systemone_route(decide, settings), methods=["POST"]),
              Route("/v1/decisions", _decisions_route(decide, settings), methods=["POST"]),
              Route("/v1/models", _models_route(settings), methods=["GET"]),
              Route("/health", _health_route(settings, batcher), methods=["GET"])]
    app = Starlette(routes=routes)
    app.add_middleware(_AccessLog)
    return app


Decide = Callable[[Any, Request], Awaitable[Decided]]
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client hung up while its request waited: nothing is sent (logged as 499)."""


def _systemone_route(decide: Decide, settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    def fail(status: int, kind: str, message: str) -> Response:
        return _json(*systemone.failure(status, kind, message))

    async def route(request: Request) -> Response:
        if not _authorized(request, settings.key):
            return fail(401, "authentication_error", "a valid API key is required (Authorization: Bearer KEY)")
        try:
            ask = systemone.parse(await _body(request, settings.max_body))
            decided = await decide(ask, request)
        except ClientGone:
            return Response(status_code=499)
        except TooLarge:
            return fail(413, "request_too_large", f"the request body is over {settings.max_body} bytes")
        except BadBody as exc:
            return _json(422, {"detail": [{"loc": ["body"], "msg": str(exc), "type": "value_error.jsondecode"}]})
        except Invalid as exc:
            return _json(*systemone.invalid(exc))
        except (SpecError, TooLong, PrefixTooLong) as exc:
            return _json(*systemone.refused(exc))
        request.state.usage = (len(ask.questions), decided)
        return _json(200, systemone.answer(decided, settings.model))

    return route


def _decisions_route(decide: Decide, settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        if not _authorized(request, settings.key):
            return _json(*decisions.failure(401, "a valid API key is required (Authorization: Bearer KEY)",
                                            code="invalid_api_key"))
        try:
            ask, questions = decisions.parse(await _body(request, settings.max_body))
            decided = await decide(ask, request)
        except ClientGone:
            return Response(status_code=499)
        except TooLarge:
            return _json(*decisions.failure(413, f"the request body is over {settings.max_body} bytes",
                                            code="request_too_large"))
        except BadBody as exc:
            return _json(*decisions.failure(400, str(exc), code="invalid_json"))
        except Invalid as exc:
            return _json(*decisions.invalid(exc))
        except (SpecError, TooLong, PrefixTooLong) as exc:
            return _json(*decisions.refused(exc))
        request.state.usage = (len(questions), decided)
        return _json(200, decisions.answer(decided, questions, settings.model))

    return route


def _models_route(settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        if not _authorized(request, settings.key):
            return _json(*systemone.failure(401, "authentication_error", "a valid API key is required"))
        return _json(200, {"object": "list",
                           "data": [{"id": settings.model, "object": "model", "created": int(time.time()),
                                     "owned_by": "prefixcache"}],
                           "models": [{"name": settings.model, "description": "served by prefixcache",
                                       "release_date": date.today().isoformat()}]})

    return route


def _health_route(settings: Settings, batcher: Batcher) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return _json(200, {"status": "ok", "model": settings.model, "passes": batcher.passes,
                           "computed": batcher.computed, "shared": batcher.shared, "dropped": batcher.dropped,
                           "waiting": batcher.waiting})

    return route


def _json(status: int, body: Any) -> Response:
    return JSONResponse(body, status_code=status)


class _AccessLog:
    """One line per request on stderr: number, method, path, status, questions, tokens, cached
    tokens, milliseconds."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, number, status = time.perf_counter(), next(_ids), [0]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        scope.setdefault("state", {})
        try:
            await self.app(scope, receive, sending)
        finally:
            usage = scope["state"].get("usage")
            extra = ""
            if usage is not None:
                questions, decided = usage
                extra = f" questions={questions} tokens={decided.input_tokens} cached={decided.cached_tokens}"
            log.info("request %d %s %s %d%s ms=%.1f", number, scope["method"], scope["path"], status[0], extra,
                     (time.perf_counter() - start) * 1000)


class StoppableServer(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT or SIGTERM without re-raising the signal afterwards (a
    stop asked for is a clean exit, 0); a second Ctrl-C stops at once."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            log.info("stopping: no new requests; answering those in flight")
            self.should_exit = True
