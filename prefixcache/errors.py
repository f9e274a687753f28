"""Typed errors raised by the library. The CLI turns each into one line and an exit code."""

from __future__ import annotations

# Exit codes, documented in the README ("Exit codes").
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2  # bad spec, bad input, unwritable output, bad option
EXIT_MODEL = 3  # the model or tokenizer could not be loaded
EXIT_ITEM = 4  # an item could not be scored (too long for the context, ...)
EXIT_GATE = 5  # --min-accuracy was not reached


class PrefixcacheError(Exception):
    """Base class: a message fit for one line, and the exit code the CLI should use."""

    exit_code = EXIT_INTERNAL


class SpecError(PrefixcacheError):
    """The task spec is missing, unreadable or invalid."""

    exit_code = EXIT_USAGE


class UsageError(PrefixcacheError):
    """A bad option or environment value (a device that does not exist, a size that is no number)."""

    exit_code = EXIT_USAGE


class InputError(PrefixcacheError):
    """The items file is unreadable or a record is invalid."""

    exit_code = EXIT_USAGE


class OutputError(PrefixcacheError):
    """The output cannot be written."""

    exit_code = EXIT_USAGE


class ModelError(PrefixcacheError):
    """The model or its tokenizer cannot be found or loaded, or does not fit the task."""

    exit_code = EXIT_MODEL


class PrefixTooLong(ModelError):
    """The static prompt prefix (system text, examples; a request's instructions) does not fit the
    model's context: it is never cut to fit."""


class ItemError(PrefixcacheError):
    """One item cannot be scored (for example it is longer than the model's context)."""

    exit_code = EXIT_ITEM

    def __init__(self, item_id: object, message: str):
        super().__init__(f"item {item_id!r}: {message}")
        self.item_id, self.message = item_id, message


class TooLong(ItemError):
    """An item whose prompt does not fit the model's context (it is never cut to fit)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; finished records are written and the run can be resumed.

    Like KeyboardInterrupt, not an `Exception`: the `except Exception` that turns a damaged file
    into "build it again" (a converted model, a stored prefix) or a library's failure into a
    ModelError must never take a stop for one of those."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x20), *range(0x7F, 0xA0)] if chr(c) not in "\t"}
_CONTROL.update({c: f"\\u{c:04x}" for c in [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]})


def shown(text: object) -> str:
    """Text another user or a data file may have written, fit to print on a terminal: control
    characters (escape sequences, line ends, bidirectional overrides) written as escapes."""
    return str(text).translate(_CONTROL)
