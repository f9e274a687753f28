"""The HTTP server: a Starlette app on uvicorn, the model in one worker thread (serve/batcher.py).

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
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import date
from typing import Any, Awaitable, Callable, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import PrefixTooLong, SpecError, TooLong
from ..scoring.options import ScoringOptions
from .body import BadBody, TooLarge, WrongType, read_body
from .batcher import Batcher, ShuttingDown
from .decider import Decided, Decider
from .defaults import BATCH_WAIT_MS, DRAIN_S, MAX_BATCH, Limits
from ..task.head import Head
from .errors import Invalid, TooCostly
from .wire import DECISIONS, SYSTEM_ONE, WireFormat

log = logging.getLogger("prefixcache.serve")
MAX_BODY = 8 * 1024 * 1024  # bytes of a request body, compressed and uncompressed
_ids = itertools.count(1)


@dataclass
class Settings:
    """What the app needs besides its batcher: the served model's name, the key (None: no auth),
    the body limit, and the `Host` names and `Origin`s taken besides this machine's own (None
    for hosts: any, as for a server bound to a public address)."""

    model: str
    key: str | None = None
    max_body: int = MAX_BODY
    hosts: frozenset[str] | None = frozenset()
    origins: frozenset[str] = frozenset()


async def _body(request: Request, settings: Settings) -> Any:
    try:
        return await read_body(request.stream(), request.headers.get("content-length"),
                               request.headers.get("content-type"), request.headers.get("content-encoding"),
                               settings.max_body)
    except ClientDisconnect:  # hung up mid-body: the client's doing, logged as 499
        raise ClientGone() from None


def _authorized(request: Request, key: str | None) -> bool:
    if key is None:
        return True
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def served_app(model: str | None, options: ScoringOptions, key: str | None = None, wait_ms: float = BATCH_WAIT_MS,
               batch: int = MAX_BATCH, heads: Sequence[Head] = (), revision: str | None = None,
               limits: Limits = Limits(), bound: str = "127.0.0.1") -> tuple[Starlette, Batcher]:
    """What `serve` runs, and each Ray Serve replica (serve/rayserve.py): the model loaded, its
    batcher's worker started (`wait_ms`, `batch`: see `Batcher`) and the app answering with it;
    `heads`: fitted heads, each answering the requests of the pack it was fitted on; `bound`: the
    address served (on this machine only: the Host must name it, or one of `limits.hosts`)."""
    # the model is loaded on the worker thread that will run it (see Batcher._build)
    batcher = Batcher(lambda: Decider(model, options, heads=heads, revision=revision, max_tokens=limits.max_tokens),
                      wait_ms / 1000, batch)
    local = bound in LOOPBACK or bound.startswith("127.")
    hosts = None if "*" in limits.hosts or not local else frozenset(h.lower() for h in limits.hosts)
    settings = Settings(batcher.decider.name, key, hosts=hosts, origins=frozenset(limits.origins))
    return build_app(batcher, settings), batcher


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

    routes = [Route("/v1/systemone", _route(SYSTEM_ONE, decide, settings), methods=["POST"]),
              Route("/v1/decisions", _route(DECISIONS, decide, settings), methods=["POST"]),
              Route("/v1/models", _models_route(settings), methods=["GET"]),
              Route("/health", _health_route(settings, batcher), methods=["GET"])]
    app = Starlette(routes=routes)
    app.add_middleware(_AccessLog)
    return app


Decide = Callable[[Any, Request], Awaitable[Decided]]
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client hung up while its request waited: nothing is sent (logged as 499)."""


def _route(fmt: WireFormat, decide: Decide, settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    """A POST route of `fmt`: every failure answered in its shape, never a 5xx for the input's fault."""

    async def route(request: Request) -> Response:
        refused = _refused(request, settings)
        if refused is not None:
            return _json(*fmt.refusal(*refused))
        try:
            ask, parsed = fmt.parse(await _body(request, settings))
            decided = await decide(ask, request)
        except ClientGone:
            return Response(status_code=499)
        except ShuttingDown:
            return _json(*fmt.error(503, "unavailable", STOPPING), headers=RETRY)
        except TooLarge:
            return _json(*fmt.error(413, "request_too_large", f"the request body is over {settings.max_body} bytes"))
        except WrongType as exc:
            return _json(*fmt.error(415, "unsupported_media_type", str(exc)))
        except BadBody as exc:
            return _json(*fmt.bad_json(str(exc)))
        except Invalid as exc:
            return _json(*fmt.invalid(exc))
        except (SpecError, TooLong, PrefixTooLong, TooCostly) as exc:
            return _json(*fmt.refused(exc))
        except Exception:  # noqa: BLE001 - a fault of the server, never of the input: logged with the request
            return _json(*fmt.error(500, "internal_error", _fault(request)))
        request.state.usage = (fmt.count(ask, parsed), decided)
        return _json(200, fmt.answer(decided, parsed, settings.model))

    return route


def _fault(request: Request) -> str:
    """Log the exception being handled with the request's number; the message a 500 carries."""
    number = request.scope.get("state", {}).get("number", 0)
    log.exception("request %d: internal error", number)
    return f"internal error (request {number} in the server's log)"


LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _refused(request: Request, settings: Settings) -> tuple[int, str] | None:
    """Why a request is refused before its body is read: `_foreign`, or no valid key (401)."""
    foreign = _foreign(request, settings)
    if foreign is not None:
        return foreign
    if not _authorized(request, settings.key):
        return 401, "a valid API key is required (Authorization: Bearer KEY)"
    return None


def _foreign(request: Request, settings: Settings) -> tuple[int, str] | None:
    """A request from elsewhere than this machine's clients: a foreign Host or Origin (403: a web
    page the user visits could otherwise reach a server on this machine), or two Host headers
    (400, as HTTP/1.1 requires)."""
    if len(request.headers.getlist("host")) > 1:
        return 400, "the request has more than one Host header"
    host = _hostname(request.headers.get("host", ""))
    if settings.hosts is not None and host not in LOOPBACK and host not in settings.hosts:
        return 403, (f"the Host {host!r} is not this server's: a name pointed at this machine by another site is "
                     f"refused (start it with --allow-host {host} to accept it)")
    origin = request.headers.get("origin")
    if origin is not None and origin not in settings.origins and "*" not in settings.origins \
            and _hostname(origin.partition("://")[2]) not in LOOPBACK:
        return 403, (f"requests from the web page origin {origin!r} are refused (start the server with "
                     f"--allow-origin {origin} to accept them)")
    return None



def _systemone_refusal(refused: tuple[int, str]) -> Response:
    """A `_refused` request answered in System One's error shape."""
    return _json(*SYSTEM_ONE.refusal(*refused))


def _hostname(host: str) -> str:
    """A Host header's (or an origin's) name without its port, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _models_route(settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        refused = _refused(request, settings)
        if refused is not None:
            return _systemone_refusal(refused)
        return _json(200, {"object": "list",
                           "data": [{"id": settings.model, "object": "model", "created": int(time.time()),
                                     "owned_by": "prefixcache"}],
                           "models": [{"name": settings.model, "description": "served by prefixcache",
                                       "release_date": date.today().isoformat()}]})

    return route


def _health_route(settings: Settings, batcher: Batcher) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        foreign = _foreign(request, settings)  # no key needed (a load balancer's probe), but this machine's clients
        if foreign is not None:
            return _json(foreign[0], {"status": "refused", "detail": foreign[1]})
        return _json(200, {"status": "ok", "model": settings.model, "passes": batcher.passes,
                           "computed": batcher.computed, "shared": batcher.shared, "dropped": batcher.dropped,
                           "waiting": batcher.waiting, "rss_mb": _rss_mb()})

    return route


def _rss_mb() -> float | None:
    """This process's resident memory in MB (Linux), else None."""
    try:
        with open("/proc/self/statm") as statm:
            return round(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status_code=status, headers=headers)


STOPPING = "the server is stopping and did not reach this request: send it again (to another server, or once it is back)"
RETRY = {"Retry-After": "5"}


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

        scope.setdefault("state", {})["number"] = number  # what a 500 and its log line name
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
    stop asked for is a clean exit, 0): it takes no new requests, answers those queued for up to
    `drain` seconds, then answers what is left 503 (`Batcher.drain`) and returns. A second signal
    exits at once, with one line."""

    def __init__(self, config: uvicorn.Config, batcher: Batcher | None = None, drain: float = DRAIN_S):
        super().__init__(config)
        self.batcher, self.drain = batcher, drain

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
        if self.should_exit:
            left = self.batcher.waiting if self.batcher is not None else 0
            log.warning("stopped at once by a second %s: %d requests unanswered", signal.Signals(sig).name, left)
            logging.shutdown()
            os._exit(128 + sig)
        log.info("stopping: no new requests; answering those queued for up to %g s (a second Ctrl-C or SIGTERM "
                 "stops at once)", self.drain)
        self.should_exit = True
        if self.batcher is not None:
            timer = threading.Timer(self.drain, self._deadline)
            timer.daemon = True
            timer.start()

    def _deadline(self) -> None:
        left = self.batcher.drain() if self.batcher is not None else 0
        if left:
            log.warning("stop deadline (%g s): %d requests answered 503, to be sent again", self.drain, left)
