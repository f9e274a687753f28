"""The server's worker, with a stand-in decider (no model): a request too large to score is
refused from its size before anything is tokenised, and once passes are timed a light request
never shares a long pass with heavy ones."""

from __future__ import annotations

import threading
import time

import pytest

from prefixcache.serve.batcher import Batcher
from prefixcache.serve.decider import Ask, Decided, Ready
from prefixcache.serve.errors import TooLarge

SECONDS_A_TOKEN = 1e-4


class StandIn:
    """Makes asks ready at a cost of one token a character of state (`ready` calls counted), and
    decides a pass in time proportional to its tokens (each pass's states kept)."""

    def __init__(self, max_tokens: int = 16384):
        self.max_tokens = max_tokens
        self.readied: list[str] = []
        self.passes: list[list[str]] = []
        self.in_pass = threading.Event()

    def ready(self, asks):
        self.readied += [a.state for a in asks]
        return [Ready(a, "pack", None, None, True, len(a.state)) for a in asks]

    def decide_ready(self, ready):
        self.passes.append([r.ask.state for r in ready])
        self.in_pass.set()
        time.sleep(SECONDS_A_TOKEN * sum(r.cost for r in ready))
        return [Decided({}, r.cost, 0, 0.0) for r in ready]


def test_a_request_too_large_to_score_is_refused_at_once_and_never_tokenised():
    decider = StandIn(max_tokens=100)
    batcher = Batcher(decider, wait=0)
    criteria = {f"option {i}": "x" * 40 for i in range(255)}
    huge = Ask("", "my card was charged twice", {f"q{j}": {"type": "choice", "criteria": criteria} for j in range(50)})
    refused = batcher.submit(huge)
    assert refused.done()  # refused as it was submitted, never queued
    with pytest.raises(TooLarge, match="characters of instructions, state and questions, more than this server.s limit of 100"):
        refused.result(timeout=0)
    assert decider.readied == []
    hoarder = Ask("Route tickets carefully. " * 150000, "my card was charged twice", {})  # 3.7 MB of instructions
    assert batcher.submit(hoarder).done() and decider.readied == []
    assert batcher.submit(Ask("", "short", {})).result(timeout=120).input_tokens == 5
    batcher.close(5)


def test_a_light_request_waits_at_most_the_pass_running_and_shares_no_pass_with_heavy_ones():
    decider = StandIn()
    batcher = Batcher(decider, wait=0, tokens=16384, seconds=0.05)  # about 500 tokens a pass once timed
    batcher.submit(Ask("", "w" * 100, {})).result(timeout=120)  # a first pass, timed
    heavy = [batcher.submit(Ask("", f"{n}" * 3000, {})) for n in range(4)]  # 0.3 s a pass each
    decider.in_pass.clear()
    assert decider.in_pass.wait(120)
    begun = len(decider.passes)  # the pass running now is the last of these
    light = batcher.submit(Ask("", "light", {}))
    light.result(timeout=120)
    assert not all(f.done() for f in heavy)
    for f in heavy:
        f.result(timeout=120)
    # the heavy pass running when it came, at most one more begun meanwhile, then its own: not four
    assert decider.passes.index(["light"]) <= begun + 1, decider.passes
    alone = [p for p in decider.passes if "light" in p]
    assert alone == [["light"]]  # no heavy request shared its pass
    batcher.close(5)
