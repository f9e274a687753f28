"""A model's chat template rendered within bounds.

A chat template is code from the model's files. transformers renders it in jinja2's sandbox,
which keeps it from the process's objects but not from its memory or time: `'x' * 2000000000`
allocates 2 GB, two nested `range(99999)` loops run for hours. The environment here is the
sandbox with bounds on what a template may build and how long one rendering may take:

- a string or list a template builds (`*`, `+`, `~`, `%`, `format`, `join`, `replace`, a filter's
  result, the whole output) holds at most `MAX_CHARS` characters or items, checked before it is
  built where its size can be known beforehand;
- a number passed to a filter or method (a width, a count) is at most `MAX_ARGUMENT`;
- everything one rendering builds, all values together (held or dropped since), takes at most
  `MAX_BYTES` of memory: what a rendering holds is bounded by memory, not by time;
- a whole number a template computes (`*`, `**`) has at most `MAX_BITS` bits, checked before it
  is computed (one multiplication of huge numbers is one bytecode: no watchdog stops it);
- `range()` yields at most `MAX_STEPS` numbers in one rendering, all ranges together;
- one rendering lasts at most `SECONDS` (a watchdog interrupts it), and recursion past Python's
  limit is refused like any other bound.

Whatever exceeds a bound raises `ModelError` naming it: the model's files are at fault.
`install()` makes transformers compile every chat template in this environment.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.environment import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .. import compat
from ..errors import ModelError

MAX_CHARS = 1 << 24  # 16,777,216: far beyond any context a model reads
MAX_ARGUMENT = 1 << 16  # widths and counts: real templates pass tens
MAX_STEPS = 1_000_000  # range() numbers in one rendering
SECONDS = 10.0  # one rendering; real templates take milliseconds
MAX_BYTES = 1 << 28  # 256 MiB built in one rendering, all values together: real templates build their prompt (KBs)
MAX_BITS = 1 << 16  # a whole number's bits (19,729 digits): real templates count messages
_LONG_NUMBER = re.compile(r"\d{6,}")  # a width or precision of a million or more in a format
_STARRED = re.compile(r"%[-#0 +]*\*|%[-#0 +]*\d*\.\*")


def install() -> None:
    """Every chat template transformers compiles from now on is compiled in `BoundedEnvironment`
    (templates it compiled before are compiled again). Idempotent."""
    compat.chat_template_environment(BoundedEnvironment)


def refused(what: str) -> ModelError:
    return ModelError(f"the model's chat template {what}: refused (a chat template may build at most "
                      f"{MAX_CHARS:,} characters and render in {SECONDS:g} s)")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _checked(value: Any) -> Any:
    if _sized(value) > MAX_CHARS:
        raise refused(f"built a value of {_sized(value):,} characters or items")
    _spend(value)
    return value


class _Budget(threading.local):
    left: int = MAX_BYTES


_BUDGET = _Budget()


def _spend(value: Any) -> None:
    """Count a value built against the rendering's `MAX_BYTES` (a list or tuple by its own array:
    its items were counted as they were built)."""
    if isinstance(value, (str, list, tuple, int)) and not isinstance(value, bool):
        _BUDGET.left -= sys.getsizeof(value)
        if _BUDGET.left < 0:
            raise ModelError(f"the model's chat template built more than {MAX_BYTES >> 20} MiB of values in one "
                             f"rendering: refused (a chat template's values may take at most {MAX_BYTES >> 20} MiB)")


def _check_bits(operator: str, left: Any, right: Any) -> None:
    """Refuse a product or power of whole numbers beyond `MAX_BITS`, from its operands' sizes."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right)):
        return
    if operator == "*":
        bits = left.bit_length() + right.bit_length()
    elif right <= 0 or abs(left) <= 1:
        return
    else:
        bits = (abs(left).bit_length() - 1) * right + 1
    if bits > MAX_BITS:
        raise refused(f"would compute a number of about {bits:,} bits with {operator} (at most {MAX_BITS:,})")


def _check_numbers(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise refused(f"passed the number {value:,} as a width or count (at most {MAX_ARGUMENT:,})")


def _check_format(text: Any) -> None:
    if isinstance(text, str) and _LONG_NUMBER.search(text) and re.search(r"%[-#0 +]*\d{6,}|\{[^{}]*:[^{}]*\d{6,}", text):
        raise refused("asked for a formatted field a million characters wide")


def _expected(name: str, subject: Any, args: tuple) -> int:
    """The size of what `replace` or `join` will build, known before it is built (0: unknown)."""
    if name == "replace" and isinstance(subject, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        count = subject.count(old) if old else len(subject) + 1
        return len(subject) + count * max(len(new) - len(old), 0)
    if name == "join" and isinstance(subject, str) and args and isinstance(args[0], (list, tuple)):
        parts = args[0]
        return len(subject) * max(len(parts) - 1, 0) + sum(len(p) for p in parts if isinstance(p, str))
    return 0


def _bounded_call(name: str, func: Callable, subject: Any, args: tuple, kwargs: dict) -> Any:
    _check_numbers(args, kwargs)
    if _expected(name, subject, args) > MAX_CHARS:
        raise refused(f"would build {_expected(name, subject, args):,} characters with {name}")
    return _checked(func(*args, **kwargs))


def _bounded_filter(name: str, func: Callable) -> Callable:
    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marks
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = [a for a in args if not hasattr(a, "environment")]  # the context or environment passed in
        if name == "join" and values:
            sep = kwargs.get("d", values[1] if len(values) > 1 else "")
            parts = list(values[0]) if isinstance(values[0], (list, tuple)) else []
            if _expected("join", sep, (parts,)) > MAX_CHARS:
                raise refused(f"would build {_expected('join', sep, (parts,)):,} characters with join")
        subject = values[0] if values else None
        rest = tuple(values[1:])
        if name == "replace" and _expected("replace", subject, rest) > MAX_CHARS:
            raise refused(f"would build {_expected('replace', subject, rest):,} characters with replace")
        if name == "format":
            _check_format(subject)
        _check_numbers(rest, kwargs)
        return _checked(func(*args, **kwargs))

    return wrapper


class _Filters(dict):
    """The environment's filters, each wrapped in the bounds when it is put in."""

    def __init__(self, filters: dict[str, Callable]):
        super().__init__()
        for name, func in filters.items():
            self[name] = func

    def __setitem__(self, name: str, func: Callable) -> None:
        super().__setitem__(name, _bounded_filter(name, func))


class _Steps(threading.local):
    left: int = MAX_STEPS


_STEPS = _Steps()


def _bounded_range(*args: int) -> range:
    numbers = range(*args)
    if len(numbers) > _STEPS.left:
        raise refused(f"asked for more than {MAX_STEPS:,} numbers from range() in one rendering")
    _STEPS.left -= len(numbers)
    return numbers


class _Generator(CodeGenerator):
    """Jinja's code generator with `~` joined through the environment's bounded join."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Interrupted(BaseException):
    """Raised in a rendering thread by the watchdog: a BaseException, so no template or library
    code on the way catches it as an ordinary error."""


class _Watchdog:
    """One thread that interrupts renderings past their deadline (an asynchronous exception in
    the rendering's thread, delivered between two of its bytecodes)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._armed: dict[object, tuple[int, float]] = {}
        self._thread: threading.Thread | None = None

    @contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        token = object()
        with self._lock:
            self._armed[token] = (threading.get_ident(), time.monotonic() + seconds)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="prefixcache-template-watchdog", daemon=True)
                self._thread.start()
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:  # past this, the watchdog never fires for this token
                self._armed.pop(token, None)

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for token, (thread, due) in list(self._armed.items()):
                    if due <= now:
                        del self._armed[token]
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_Interrupted))
                due = min((d for _, d in self._armed.values()), default=now + 3600)
                self._lock.wait(max(due - now, 0.001))


_WATCHDOG = _Watchdog()


class BoundedTemplate(Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        _STEPS.left, _BUDGET.left = MAX_STEPS, MAX_BYTES
        try:
            with _WATCHDOG.deadline(SECONDS):
                return super().render(*args, **kwargs)
        except _Interrupted:
            raise refused(f"did not finish rendering in {SECONDS:g} s") from None
        except RecursionError:
            raise refused("recursed beyond Python's limit (a macro calling itself without end)") from None
        except MemoryError:
            raise refused("ran out of memory") from None


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the bounds above."""

    code_generator_class = _Generator
    template_class = BoundedTemplate
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = _Filters(self.filters)
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            count, other = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and _sized(other) * max(count, 0) > MAX_CHARS:
                raise refused(f"would build {_sized(other) * count:,} characters or items with *")
        elif operator == "+" and _sized(left) + _sized(right) > MAX_CHARS:
            raise refused(f"would build {_sized(left) + _sized(right):,} characters or items with +")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise refused(f"raised a number to the power {right}")
        if operator in ("*", "**"):
            _check_bits(operator, left, right)
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            if _STARRED.search(left):  # a width or precision taken from the values
                _check_numbers(right if isinstance(right, tuple) else (right,), {})
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        if __obj is _bounded_range:  # bounded by its own count
            return super().call(__context, __obj, *args, **kwargs)
        name = getattr(__obj, "__name__", "")
        subject = getattr(__obj, "__self__", None)
        return _bounded_call(name, lambda *a, **k: super(BoundedEnvironment, __self).call(__context, __obj, *a, **k),
                             subject, args, kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if isinstance(obj, str) and argument in ("format", "format_map"):
            _check_format(obj)
        return super().getitem(obj, argument)

    def joined(self, parts: tuple) -> str:
        texts = [str(p) for p in parts]
        if sum(len(t) for t in texts) > MAX_CHARS:
            raise refused(f"would build {sum(len(t) for t in texts):,} characters with ~")
        return _checked("".join(texts))

    def concat(self, parts: Iterator[str]) -> str:  # type: ignore[override]  # the whole output
        out, size = [], 0
        for part in parts:
            size += len(part)
            if size > MAX_CHARS:
                raise refused(f"wrote more than {MAX_CHARS:,} characters")
            out.append(part)
        return _checked("".join(out))
