"""The server's defaults, in one place: `serve`, `decide`, Ray Serve and Ray Data take them from
here, and the command line shows them. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

BATCH_WAIT_MS = 25.0  # under load, how long a forward pass waits for more requests to join it
MAX_BATCH = 16  # requests in one forward pass at most
PREFIXES = 16  # prefilled prefixes kept in memory (more are read back from the prefix store on disk)
PACKS = 64  # question packs kept (their tokenised options, calibration), each holding one of those prefixes
RECENT, RECENT_S = 256, 30.0  # answers kept to answer an identical request (a client's retry) again, and for how long
MAX_REQUEST_TOKENS = 16384  # tokens one request may have to score (its state, questions, options): 255 described options take ~7,500
CHARS_A_TOKEN = 16  # a request with more characters than this many a token allowed is refused before tokenising
PASS_TOKENS = 4096  # a forward pass takes requests up to about this many tokens (at least one request)
PASS_SECONDS = 2.0  # ... and, once passes were timed, about this long (a light request shares no long pass)
AGE = 4  # passes a costlier request may be passed over for cheaper ones before it goes first
DRAIN_S = 30.0  # after SIGTERM or Ctrl-C, how long requests queued are still answered (then 503)


@dataclass(frozen=True)
class Limits:
    """What a server takes and how it stops: `max_tokens` to score a request (more: 413),
    `drain_s` seconds to answer what is queued after a stop, `hosts` and `origins` accepted
    besides this machine's own (`--allow-host`, `--allow-origin`; "*" for any)."""

    max_tokens: int = MAX_REQUEST_TOKENS
    drain_s: float = DRAIN_S
    hosts: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()
