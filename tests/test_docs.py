"""The docs stay true: the CLI reference matches --help, the README's commands are the ones CI
runs, and every relative link points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import cli_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_cli_reference_is_current():
    assert cli_reference.PATH.read_text(encoding="utf-8") == cli_reference.reference(), \
        "docs/cli.md is stale: regenerate it with `python tests/cli_reference.py`"


def test_cli_reference_covers_every_command():
    text = cli_reference.PATH.read_text(encoding="utf-8")
    names = [" ".join(["prefixcache", *c]) for c in cli_reference.commands()]
    assert {"prefixcache diff", "prefixcache report", "prefixcache cache clear"} <= set(names)
    for name in names:
        assert f"## `{name}`" in text, f"docs/cli.md has no section for {name}"


def test_readme_has_the_two_set_up_commands_and_ci_runs_the_test_one():
    blocks = re.findall(r"```\n(python3 -m venv .*?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) == 2
    main, tests = blocks
    assert main.endswith("prefixcache run configs/support-tickets.yaml data/samples/tickets.jsonl -o predictions.jsonl")
    assert tests.endswith("python -m pytest -q -n 2")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests.split("pip install torch==2.13.0 && ", 1)[1] in ci


def _anchors(doc: Path) -> set[str]:
    """The anchors a Markdown renderer makes of a file's headings (GitHub's rule)."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", doc.read_text(encoding="utf-8"), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_relative_links_and_their_anchors_resolve():
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", doc.read_text(encoding="utf-8")):
            path = doc.parent / target if target else doc
            assert path.exists(), f"{doc.name}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor} in {path.name}"


def test_every_yaml_block_in_the_docs_parses():
    """A spec shown in the docs is one a user can paste: each ```yaml block is YAML (a block of
    several documents, or a fragment marked `# ...`, is read as YAML too)."""
    import yaml

    bad = []
    for doc in DOCS:
        for block in re.findall(r"```ya?ml\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S):
            try:
                list(yaml.safe_load_all(block))
            except yaml.YAMLError as exc:
                bad.append(f"{doc.name}: {str(exc).splitlines()[0]}: {block[:60]!r}")
    assert not bad, "\n".join(bad)
