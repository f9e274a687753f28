"""Small helpers shared by the tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from prefixcache.task.spec import TaskSpec, load_spec

# Labels chosen to break first-token scoring on the test tokenizer: `tech` is a token-prefix of
# `technical`, `bill`/`billing` share their first tokens, `account access` is long.
LABELS = ["tech", "technical", "bill", "billing", "account access", "x"]

TEXTS = [
    "The app crashes when I open a project.",
    "I was charged twice, please refund.",
    "Hi",
    "I forgot my password and cannot sign in to my account, and the reset email never arrives either.",
    ":: odd start",
    " leading space",
    "Error 502 from the API",
    "é accented",
    "refund the payment for my subscription invoice please",
    "x",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. " * 2,
]


def write_spec(tmp_path: Path, name: str = "spec.yaml", **data) -> Path:
    data.setdefault("system", "You are a support ticket router.")
    data.setdefault("labels", LABELS)
    data.setdefault("template", "Ticket: {text}")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def make_spec(tmp_path: Path, **data) -> TaskSpec:
    return load_spec(write_spec(tmp_path, **data))


def invoke(*args, **kwargs):
    """The CLI in-process, with any argument given as a path or a number."""
    from typer.testing import CliRunner

    from prefixcache.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], **kwargs)
