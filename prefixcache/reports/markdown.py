"""Text from the data (ids, labels, file names) put into Markdown that CI pages render."""

from __future__ import annotations

import re


def cell(value: object) -> str:
    """A table cell that shows `value` as it is: a `|` does not end the cell, a line break does
    not end the row, `<`, `&` are not read as HTML nor `$...$` as math."""
    text = "-" if value is None else str(value)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("$", "\\$")  # $...$ is math on GitHub
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def code(value: object) -> str:
    """`value` in a code span, whatever backticks it holds (one line)."""
    text = str(value).replace("\n", " ").replace("\r", " ")
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
