"""When two texts a spec or a request lists are one: the same once spaces around them are trimmed
and Unicode is normalised (NFC), so `café` typed with one code point or with `e` and a combining
accent, or `Billing` and ` Billing `, are one option, label or form. The model would read them as
different token sequences and split one answer's probability between two names."""

from __future__ import annotations

import unicodedata
from typing import Iterable


def text_key(text: str) -> str:
    """What a listed text is compared by."""
    return unicodedata.normalize("NFC", text.strip())


def twins(texts: Iterable[str]) -> tuple[str, str] | None:
    """The first two texts that are one (the earlier first), or None."""
    seen: dict[str, str] = {}
    for text in texts:
        key = text_key(text)
        if key in seen:
            return seen[key], text
        seen[key] = text
    return None


def twice(what: str, pair: tuple[str, str]) -> str:
    """The words a refusal of two listed texts that are one uses."""
    first, second, what = *pair, f"{what} " if what else ""
    if first == second:
        return f"lists {what}{first!r} twice"
    return (f"lists {what}{first!r} and {second!r}, which are the same text once spaces around them are trimmed and "
            f"Unicode is normalised (NFC)")
