"""Text from the data (ids, labels, file names) put into Markdown that CI pages render."""

from __future__ import annotations


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
    longest = max((len(part) for part in _backtick_runs(text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _backtick_runs(text: str) -> list[str]:
    runs, current = [], ""
    for ch in text:
        if ch == "`":
            current += ch
        elif current:
            runs.append(current)
            current = ""
    return runs + ([current] if current else [])
