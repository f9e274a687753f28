"""docs/cli.md, generated from the commands' --help. Regenerate with `python tests/cli_reference.py`;
tests/test_docs.py fails when the file is stale. Every command the app has is in it: the list is
read from the app, so a new command cannot be left out."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from prefixcache.cli import app

PATH = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def commands() -> list[list[str]]:
    """Every command path, groups before their commands: [], ["run"], ..., ["cache"], ["cache", "list"]."""
    found: list[list[str]] = []

    def walk(group, path: list[str]) -> None:
        found.append(path)
        for name, command in getattr(group, "commands", {}).items():
            walk(command, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def help_text(command: list[str]) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], prog_name="prefixcache", terminal_width=100,
                                env={"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines).strip("\n")


def reference() -> str:
    parts = ["# Command-line reference", "",
             "Every command's `--help`, as the installed version prints it. Options with an environment",
             "variable read it when the option is not given.", ""]
    for command in commands():
        name = " ".join(["prefixcache", *command])
        parts += [f"## `{name}`", "", "```", help_text(command), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    PATH.write_text(reference(), encoding="utf-8")
    sys.stderr.write(f"wrote {PATH}\n")
