"""What a wire format raises for a request it cannot take: `Invalid`, with every problem found
(where in the body, what is wrong, a short type), turned into each format's error body; `said`,
a library error's message as an answer gives it."""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import ItemError

Problem = tuple[tuple[Any, ...], str, str]  # (location in the body, message, type)


class Invalid(ValueError):
    """A request that does not validate."""

    def __init__(self, problems: Sequence[Problem]):
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg, _ in problems))
        self.problems = list(problems)


def said(exc: Exception) -> str:
    """A library error's message as a request's answer says it: without the item or the spec path
    (`request`) that name it for the batch tool."""
    return exc.message if isinstance(exc, ItemError) else str(exc).removeprefix("request: ")


class TooCostly(Exception):
    """A request that costs more than one request may: its tokens to compute (those it scores,
    and its instructions' when they are new) over the server's limit (`serve
    --max-request-tokens`). Answered 413, never computed."""

    def __init__(self, tokens: int, limit: int, prefix: int = 0):
        new = f"{prefix} of them new instructions to prefill, the others " if prefix else ""
        super().__init__(f"the request has {tokens} tokens to compute ({new}its state, and its questions' texts and "
                         f"options after it), over this server's limit of {limit}: split its questions into several "
                         f"requests, shorten its instructions, or start the server with a larger --max-request-tokens")
        self.tokens, self.limit = tokens, limit


class TooLarge(TooCostly):
    """A request whose texts are too long for its tokens to fit the server's limit, at the most
    characters a token can hold: refused from its size, before any of it is tokenised."""

    def __init__(self, chars: int, limit: int, per_token: int):
        Exception.__init__(self, f"the request holds {chars:,} characters of instructions, state and questions, more "
                                 f"than this server's limit of {limit} tokens can hold ({per_token} characters a token "
                                 f"at most): split its questions into several requests, shorten its instructions, or "
                                 f"start the server with a larger --max-request-tokens")
        self.tokens, self.limit = chars // per_token, limit
