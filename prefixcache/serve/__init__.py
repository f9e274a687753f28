"""A local typed-decisions server: TypeSafe's System One and OpenAI's Decisions over one model.

Modules:
    decider.py    requests as the batch tool's specs and items; one model, prefixes kept, asks decided together
    batcher.py    the decider in one worker thread: asks batched in passes (cheapest first, none starved)
    systemone.py  the System One wire format: request, answer, errors
    decisions.py  the OpenAI Decisions wire format: request, answer, errors
    body.py       a request body read and checked: size, JSON type, one gzip/zstd member, depth, keys, Unicode
    errors.py     what a wire format raises for a request it cannot take
    defaults.py   the server's defaults (batch wait, batch size, prefixes and packs kept), in one place
    wire.py       the contract every wire format implements (`WireFormat`), and the two formats as values
    app.py        the HTTP app (Starlette on uvicorn): routes, bodies, auth, access log, clean stops
    replay.py     `decide`: a file of requests answered in order, resumable
    tally.py      answers counted per pack and question: one that takes nearly every request is said once
    loadtest.py   a load benchmark for a running server (python -m prefixcache.serve.loadtest URL)
    raydata.py    `decide` on Ray Data: a callable for map_batches, one decider per actor (no Ray import)
    rayserve.py   the server as N Ray Serve replicas (imports Ray; the `rayserve` extra)

`serve` starts it on uvicorn; Ctrl-C or SIGTERM stop taking requests, answer those queued until a
deadline (then 503) and return. A room beside `api/`: it may import scoring, model, data and task (scorers through
scoring/build.py, as `Classifier` builds them), never run/ or the CLI; the CLI imports it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..errors import UsageError
from ..scoring.options import ScoringOptions
from .defaults import BATCH_WAIT_MS, MAX_BATCH, Limits

if TYPE_CHECKING:
    from ..task.head import Head

log = logging.getLogger("prefixcache.serve")


def api_key(variable: str, said_as: str) -> str:
    """The API key held by the environment variable `variable` (`said_as`: how the user named it,
    for the refusal when it is unset or empty)."""
    key = os.environ.get(variable, "").strip()
    if not key:
        raise UsageError(f"{said_as}: that environment variable is not set or empty")
    return key


def check_port(host: str, port: int) -> None:
    """Refuse, in one line, an address this process cannot listen on (another server holds the
    port, or the host is not this machine's), by binding it once as the server will."""
    import socket

    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server there?): choose "
                         f"another --port, or stop the other one") from None


def serve(model: Optional[str], options: ScoringOptions, host: str = "127.0.0.1", port: int = 8000,
          key: Optional[str] = None, wait_ms: float = BATCH_WAIT_MS, batch: int = MAX_BATCH,
          ready: Optional[Callable[[int], None]] = None, heads: Sequence[Head] = (), revision: Optional[str] = None,
          limits: Limits = Limits()) -> None:
    """Load the model and answer requests until SIGINT or SIGTERM, which stop taking requests
    and return once those queued are answered, or `limits.drain_s` later with the rest answered
    503 (a second signal exits at once). `ready(port)` is called once the socket listens (default:
    a line on stderr)."""
    import asyncio

    try:
        import uvicorn

        from .app import StoppableServer, served_app
    except ImportError as exc:
        raise UsageError(f"serve needs its extra: pip install 'prefixcache[serve]' ({exc})") from exc

    if host not in ("127.0.0.1", "localhost", "::1") and key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model "
                    "(set one with --api-key-env)", host)
    check_port(host, port)  # before the model loads: a port in use costs a second, not a load
    app, batcher = served_app(model, options, key, wait_ms, batch, heads, revision, limits, host)
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning",
                            timeout_graceful_shutdown=int(limits.drain_s) + 2, lifespan="off")
    server = StoppableServer(config, batcher, limits.drain_s)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            if ready is not None:
                ready(bound)
            else:
                log.info("serving %s on http://%s:%d (System One: POST /v1/systemone, OpenAI: POST /v1/decisions)",
                         batcher.decider.name, host, bound)
        await task

    try:
        asyncio.run(main())
    finally:
        stopped = batcher.close(timeout=0.2 if server.should_exit else None)
    if not stopped:  # its requests were answered 503 at the deadline; the pass cannot be interrupted
        log.info("a forward pass was still running at the stop: left unfinished")
        logging.shutdown()
        os._exit(0)  # a clean exit now: the interpreter's teardown would abort under a running torch thread
