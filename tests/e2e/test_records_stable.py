"""Records of the shipped samples stay exactly as stored (tests/golden): a change of layout or
naming must not change what a run writes. One task of each kind: labels, multiple choice,
multi-label, many labels, and typed questions."""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT, invoke

GOLDEN = ROOT / "tests" / "golden"
CASES = [("support-tickets", "tickets.jsonl"), ("general-knowledge", "general_knowledge.jsonl"),
         ("review-aspects", "review_aspects.jsonl"), ("banking-intents", "banking_intents.jsonl"),
         ("support-emails", "support_emails.jsonl")]

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("converted_once")]


def _without_timing(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        record = json.loads(line)
        assert isinstance(record.pop("ms"), (int, float))
        lines.append(json.dumps(record, ensure_ascii=False))
    return lines


@pytest.fixture()
def one_thread():
    """Float sums split over threads round differently in the last bits (a probability's sixth
    decimal can move): the stored records were written on one thread, as each test process runs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("config,sample", CASES, ids=[c for c, _ in CASES])
def test_a_shipped_sample_gives_the_stored_records(config, sample, tmp_path, one_thread):
    out, stored = tmp_path / "out.jsonl", GOLDEN / f"{config}.jsonl"
    result = invoke("run", ROOT / "configs" / f"{config}.yaml", ROOT / "data" / "samples" / sample, "--limit", 2,
                    "-o", out, "--device", "cpu", "--dtype", "float32", "-q")
    assert result.exit_code == 0, result.output
    got = _without_timing(out.read_text(encoding="utf-8"))
    if os.environ.get("PREFIXCACHE_WRITE_GOLDEN") == "1":  # a change meant to change records (see golden/README.md)
        stored.write_text("".join(line + "\n" for line in got), encoding="utf-8")
    assert got == stored.read_text(encoding="utf-8").splitlines()
