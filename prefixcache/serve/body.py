"""A request's body, read once and checked before any route looks at it: at most `limit` bytes
(compressed and uncompressed), `Content-Type` JSON, `Content-Encoding` gzip or zstd undone whole
(one member or frame, nothing after it), UTF-8 JSON with no key twice in one object, nested at most
MAX_DEPTH deep, every string valid Unicode (no lone surrogate). What fails is a `TooLarge`, a
`WrongType` or a `BadBody` (the route answers it in its format's shape), or an `Invalid` naming the
field that holds a string that is not valid Unicode."""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any, AsyncIterator

from .errors import Invalid

MAX_DEPTH = 32  # arrays and objects inside each other, the body itself counted
DRAIN = 4  # an oversized body is read and dropped up to this many times the limit, then the connection closes
DRAIN_S = 1.0  # ... and for at most this long (a client that declares more than it sends is not waited for)
ZSTD_STEP = 256  # compressed bytes fed at a time: a zstd frame's output per step is bounded, so a bomb stops early


class TooLarge(Exception):
    """The body is over the limit, as sent or once decompressed."""


class WrongType(Exception):
    """The body is not declared JSON (`Content-Type`)."""


class BadBody(Exception):
    """The body cannot be read as one JSON value."""


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header declares JSON (application/json, or a `+json` type)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def read_body(stream: AsyncIterator[bytes], declared: str | None, content_type: str | None,
                    encoding: str | None, limit: int) -> Any:
    """The body's JSON value. `declared`: its Content-Length header."""
    size = int(declared) if declared and declared.isdigit() else 0
    if size > DRAIN * limit:  # never read: answered at once
        raise TooLarge()
    raw, over = bytearray(), size > limit
    if not over:
        async for chunk in stream:
            raw += chunk
            if len(raw) > limit:
                over = True
                break
    if over:
        await _drained(stream, DRAIN * limit - len(raw))
        raise TooLarge()
    if not is_json(content_type):
        raise WrongType(f"the body must be sent as Content-Type: application/json (got {content_type or 'none'})")
    data = inflated(bytes(raw), (encoding or "identity").strip().lower(), limit)
    if len(data) > limit:
        raise TooLarge()
    return parsed(data)


async def _drained(stream: AsyncIterator[bytes], most: int) -> None:
    """Read and drop what a client still sends of an oversized body (at most `most` bytes and
    DRAIN_S seconds), so that a client still sending gets the 413 rather than a reset."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for chunk in stream:
                most -= len(chunk)
                if most < 0:
                    return
    except TimeoutError:
        return


def inflated(data: bytes, encoding: str, limit: int) -> bytes:
    """The body with its Content-Encoding undone, read to at most `limit` + 1 bytes."""
    if encoding in ("identity", ""):
        return data
    if encoding == "gzip":
        return _gunzipped(data, limit)
    if encoding == "zstd":
        return _unzstd(data, limit)
    raise BadBody(f"unsupported Content-Encoding {encoding!r} (gzip, zstd or none)")


def _gunzipped(data: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadBody(f"the body is not valid gzip: {exc}") from exc
    if len(out) > limit:
        return out
    if not inflater.eof:
        raise BadBody("the body is not valid gzip: it ends before its gzip stream does")
    if inflater.unused_data:
        raise BadBody("the body is not valid gzip: bytes follow its gzip stream (a second member, or garbage)")
    return out


def _unzstd(data: bytes, limit: int) -> bytes:
    import zstandard

    inflater, out, fed = zstandard.ZstdDecompressor().decompressobj(), bytearray(), 0
    try:
        while fed < len(data) and not inflater.eof:
            out += inflater.decompress(data[fed: fed + ZSTD_STEP])
            fed += ZSTD_STEP
            if len(out) > limit:
                return bytes(out)
    except zstandard.ZstdError as exc:
        raise BadBody(f"the body is not valid zstd: {exc}") from exc
    if not inflater.eof:
        raise BadBody("the body is not valid zstd: it ends before its frame does")
    if inflater.unused_data or fed < len(data):
        raise BadBody("the body is not valid zstd: bytes follow its frame (a second frame, or garbage)")
    return bytes(out)


class _Twice(Exception):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


def parsed(data: bytes) -> Any:
    """One JSON value from UTF-8 bytes, checked (see the module's docstring)."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_unique, parse_constant=_not_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadBody(f"the body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadBody(f"the body nests arrays and objects more than {MAX_DEPTH} deep") from exc
    except _Twice as exc:
        raise BadBody(f"the key {_shown(str(exc.args[0]))} appears twice in one object of the body") from exc
    _check(value)
    return value


def _not_json(constant: str) -> Any:
    """NaN, Infinity and -Infinity, which Python's reader takes and JSON does not have."""
    raise BadBody(f"the body is not JSON: {constant} is not a JSON value (numbers are finite)")


def _check(value: Any) -> None:
    """Depth at most MAX_DEPTH, every string and key valid Unicode; walked without recursion."""
    todo: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while todo:
        node, where = todo.pop()
        if len(where) >= MAX_DEPTH and isinstance(node, (dict, list)):
            raise BadBody(f"the body nests arrays and objects more than {MAX_DEPTH} deep")
        if isinstance(node, str):
            _unicode(node, where)
        elif isinstance(node, dict):
            for key, item in node.items():
                _unicode(key, where + (_shown(key),))
                todo.append((item, where + (key,)))
        elif isinstance(node, list):
            todo.extend((item, where + (i,)) for i, item in enumerate(node))


def _unicode(text: str, where: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Invalid([(("body",) + where, f"not valid Unicode: a lone surrogate ({text[exc.start]!a}) at character "
                                           f"{exc.start}", "value_error.unicode")]) from exc


def _shown(key: str) -> str:
    """A key as an error message can print it, lone surrogates escaped."""
    return ascii(key) if any(0xD800 <= ord(c) <= 0xDFFF for c in key) else repr(key)
