"""What a wire format raises for a request it cannot take: `Invalid`, with every problem found
(where in the body, what is wrong, a short type), turned into each format's error body."""

from __future__ import annotations

from typing import Any, Sequence

Problem = tuple[tuple[Any, ...], str, str]  # (location in the body, message, type)


class Invalid(ValueError):
    """A request that does not validate."""

    def __init__(self, problems: Sequence[Problem]):
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg, _ in problems))
        self.problems = list(problems)
