"""`prefixcache serve` on a tiny model, started as a user starts it (a process on a free loopback
port): the conformance suite, the official clients, the batch CLI's numbers, batch invariance,
every bad request's status and shape, auth, and SIGTERM with requests in flight."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import invoke, records, write_spec

pytestmark = pytest.mark.slow  # the quick tier (-m "not slow and not e2e") leaves it out

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install 'prefixcache[serve]')")

TICKET = "I was charged twice for March and my refund has not arrived. I will dispute the charge."
PACK = {
    "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"Billing": "Payments and refunds", "Technical": None, "Sales": None}},
    "anger": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
}
START_S = 600  # a server's start (torch, the model) is bounded, generously: suites run on busy machines


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, chat_tokenizer):
    """A tiny Llama with a context long enough for a 255-option question listed in the prompt."""
    from conftest import tiny_model

    path = tmp_path_factory.mktemp("tiny-long")
    tiny_model("llama", len(chat_tokenizer), positions=16384).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


class Served:
    """A `prefixcache serve` process and what it wrote to stderr."""

    def __init__(self, model: Path, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixcache", "serve", "-m", str(model), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                if " on http://" in line:
                    self.url = line.split(" on ", 1)[1].split()[0]
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(START_S) or not hasattr(self, "url"):
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


def post(url: str, body, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(long_model_dir):
    served = Served(long_model_dir, "--batch-wait-ms", "20")
    yield served
    assert served.stop() == 0


def test_the_conformance_suite_reports_conformant(server, tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([str(Path(sys.executable).parent / "jevcompat"), "test", server.url, "--json", str(report)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "conformant to spec" in done.stdout and "MUST 32/32" in done.stdout
    assert "SHOULD 12/12" in done.stdout  # every applicable SHOULD (auth is off: its checks do not apply)


def test_the_official_clients_parse_every_answer_type(server):
    from openai import OpenAI
    from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

    with TypeSafeClient(api_key="local", base_url=server.url) as client:
        got = client.system_one(state=TICKET, questions={
            "refund": Noul(instructions="Does the customer want money back?"),
            "team": Choice(instructions="Which team?", criteria={"Billing": None, "Technical": None}),
            "anger": Score(instructions="How angry?", criteria=["calm", "annoyed", "furious"])})
    assert 0 <= got.answers["refund"].noul <= 1 and got.answers["team"].choice in ("Billing", "Technical")
    assert {int(k) for k in got.answers["anger"].legend} == {0, 1, 2}  # the SDK reads the keys as levels

    client = OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
    decision = client.decisions.create(model="any", input=[
        {"role": "developer", "content": "You read support tickets."}, {"role": "user", "content": TICKET}],
        questions=[{"type": "predicate", "name": "refund", "instructions": "Does the customer want money back?"},
                   {"type": "choice", "instructions": "Is it urgent?", "choices": [{"value": True}, {"value": False},
                                                                                 {"value": "true", "description": "text"}]},
                   {"type": "score", "name": "anger", "instructions": "How angry?",
                    "levels": [{"label": "calm"}, {"label": "annoyed", "description": "a bit"}, {"label": "furious"}]}])
    refund, urgent, anger = decision.answers
    assert (refund.type, refund.name, urgent.type, urgent.name, anger.type) == ("predicate", "refund", "choice", None, "score")
    assert 0 <= refund.probability <= 1
    assert urgent.choice in (True, False, "true") and [p.value for p in urgent.probabilities] == [True, False, "true"]
    assert [(p.value, p.label) for p in anger.probabilities] == [(0, "calm"), (1, "annoyed"), (2, "furious")]
    assert decision.usage.input_tokens > decision.usage.input_tokens_details.cached_tokens >= 0


def test_the_server_answers_as_run_does_and_alone_as_in_a_batch(server, long_model_dir, tmp_path):
    states = [f"{TICKET} (ticket {n})" if n % 2 else f"Thanks, all good now. Case {n}." for n in range(17)]
    spec = write_spec(tmp_path, system="You read support tickets.", template="{state}", questions=PACK,
                      model=str(long_model_dir))
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": n, "state": s}) + "\n" for n, s in enumerate(states)))
    assert invoke("run", spec, items, "-o", tmp_path / "out.jsonl").exit_code == 0
    want = records(tmp_path / "out.jsonl")

    def ask(state: str) -> dict:
        status, body = post(server.url + "/v1/systemone", {"model": "x", "instructions": "You read support tickets.",
                                                           "state": state, "questions": PACK})
        assert status == 200, body
        return body["answers"]

    alone = ask(states[0])
    with ThreadPoolExecutor(17) as pool:  # 17 at once: they share forward passes
        together = list(pool.map(ask, states))
    for got, record in zip(together, want, strict=True):
        _close(got, record["answers"])
    _close(alone, together[0])


def _close(got: dict, want: dict, tol: float = 1e-5) -> None:
    for qid, answer in want.items():
        kind = answer["type"]
        assert got[qid]["type"] == kind
        if kind == "choice":
            assert got[qid]["choice"] == answer["choice"]
        assert abs(got[qid][kind] - answer[kind]) < tol if kind != "choice" else True
        for option, p in answer.get("probabilities", {}).items():
            assert abs(got[qid]["probabilities"][option] - p) < tol


def test_bad_requests_get_their_documented_status_and_shape(server):
    so, oa = server.url + "/v1/systemone", server.url + "/v1/decisions"
    good = {"model": "x", "state": TICKET, "questions": {"refund": PACK["refund"]}}
    many = {"model": "x", "state": "s", "questions": {"q": {"type": "choice", "instructions": "Which?",
                                                             "criteria": {f"o{i}": None for i in range(256)}}}}
    cases = [
        (so, None, b"{not json", 422), (so, {**good, "state": None}, None, 422), (so, {**good, "questions": {}}, None, 422),
        (so, many, None, 422),
        (so, {**good, "questions": {"a": {"type": "score", "instructions": "x", "criteria": {"0": "a", "1": "b"}}}}, None, 422),
        (so, {**good, "questions": {"a": {"type": "boolean", "instructions": "x"}}}, None, 422),
        (oa, None, b"[", 400), (oa, {"model": "x", "input": TICKET, "questions": []}, None, 400),
        (oa, {"model": "x", "input": TICKET, "questions": [{"type": "choice", "instructions": "x", "choices": [{"value": 1}]}]},
         None, 400),
    ]
    for url, body, raw, status in cases:
        got, payload = post(url, body, raw=raw)
        assert got == status, (body, raw, payload)
        if url == so:
            assert isinstance(payload["detail"], list) and all({"loc", "msg", "type"} <= set(d) for d in payload["detail"])
        else:
            assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]
    long_state = " ".join(["refund"] * 20000)
    got, payload = post(so, {**good, "state": long_state})
    assert got == 400 and payload["detail"]["error_type"] == "max_tokens_exceeded"
    got, payload = post(oa, {"model": "x", "input": long_state, "questions": [{"type": "predicate", "instructions": "x"}]})
    assert got == 400 and payload["error"]["code"] == "max_tokens_exceeded"
    # instructions longer than the context: the cached prefix cannot hold them (never a 5xx)
    got, payload = post(so, {**good, "instructions": long_state})
    assert got == 400 and payload["detail"]["error_type"] == "max_tokens_exceeded"
    got, payload = post(oa, {"model": "x", "input": [{"role": "system", "content": long_state}, {"role": "user", "content": "hi"}],
                             "questions": [{"type": "predicate", "instructions": "x"}]})
    assert got == 400 and payload["error"]["code"] == "max_tokens_exceeded"
    # instructions of 3.7 MB: refused from their size before anything is tokenised, never queued
    got, payload = post(so, {**good, "instructions": "Route tickets carefully, all of them. " * 100000})
    assert got == 413 and payload["detail"]["error_type"] == "request_too_costly"
    assert "characters of instructions, state and questions" in payload["detail"]["message"]
    got, payload = post(so, None, raw=b"x" * (9 * 1024 * 1024))
    assert got == 413 and payload["detail"]["error_type"] == "request_too_large"
    plain = post(so, good)[1]["answers"]
    for encoding, packed in (("gzip", gzip.compress(json.dumps(good).encode())), ("zstd", _zstd(json.dumps(good).encode()))):
        got, payload = post(so, None, {"Content-Encoding": encoding}, raw=packed)
        assert got == 200 and payload["answers"] == plain
    assert post(so, good, {"Authorization": "Bearer anything"})[0] == 200  # auth off: the header is ignored
    assert any(" POST /v1/systemone 200 questions=1 tokens=" in line for line in server.lines)


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def test_a_key_is_required_when_set_and_sigterm_finishes_the_requests_in_flight(long_model_dir):
    served = Served(long_model_dir, "--api-key-env", "PC_TEST_KEY", "--max-batch", "1",
                    env={"PC_TEST_KEY": "s3cret"})  # one request a pass: long ones queue up
    so = served.url + "/v1/systemone"
    body = {"model": "x", "state": TICKET, "questions": PACK}
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, payload = post(so, body, headers)
            assert status == 401 and payload["detail"]["error_type"] == "authentication_error"
        assert post(so, body, {"Authorization": "Bearer s3cret"})[0] == 200
        with ThreadPoolExecutor(8) as pool:
            long = f"{TICKET} " * 60  # about 1200 tokens: each request takes a while
            futures = [pool.submit(post, so, {**body, "state": f"{n} {long}"}, {"Authorization": "Bearer s3cret"})
                       for n in range(8)]
            # SIGTERM once the first long request is answered: one a pass, the other seven are queued
            # then, however fast this machine answers them (a fixed sleep raced the answers)
            deadline = time.monotonic() + 300
            while sum("POST /v1/systemone 200" in line for line in served.lines) < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            served.proc.send_signal(signal.SIGTERM)
            assert [f.result()[0] for f in futures] == [200] * 8
        assert served.proc.wait(120) == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    stop = next(i for i, line in enumerate(served.lines) if "stopping: no new requests" in line)
    # request number -> where its access line is (by number: a line written as the signal lands may be written twice)
    answered = {line.split(" request ")[1].split()[0]: i for i, line in enumerate(served.lines)
                if "POST /v1/systemone 200" in line}
    assert len(answered) == 9 and max(answered.values()) > stop  # some were answered after the signal: in flight


def test_decide_replays_requests_as_the_server_answers_them_and_resumes(server, long_model_dir, tmp_path):
    lines = [
        {"custom_id": "a", "model": "x", "instructions": "You read support tickets.", "state": TICKET, "questions": PACK},
        {"model": "x", "input": [{"role": "developer", "content": "You read support tickets."},
                                 {"role": "user", "content": TICKET}],
         "questions": [{"type": "predicate", "name": "refund", "instructions": "Does the customer want money back?"}]},
        {"custom_id": "bad", "model": "x", "state": "s", "questions": {"q": {"type": "score", "instructions": "x",
                                                                           "criteria": ["only one"]}}},
        {"custom_id": "d", "model": "x", "state": {"subject": "Charged twice", "body": TICKET}, "questions": PACK},
        {"custom_id": "long", "model": "x", "instructions": " ".join(["refund"] * 20000), "state": TICKET, "questions": PACK},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "responses.jsonl"
    result = invoke("decide", requests, "-o", out, "-m", long_model_dir, "-b", 2)
    assert result.exit_code == 4  # one request refused, as the server refuses it
    got = records(out)
    assert [(r["custom_id"], r["line"], r["response"]["status_code"]) for r in got] == [
        ("a", 1, 200), (None, 2, 200), ("bad", 3, 422), ("d", 4, 200), ("long", 5, 400)]
    for line, response in zip(lines, got, strict=True):
        body = {k: v for k, v in line.items() if k != "custom_id"}
        status, want = post(server.url + ("/v1/decisions" if "input" in body else "/v1/systemone"), body)
        assert status == response["response"]["status_code"]
        if status == 200 and "input" not in body:
            _close(response["response"]["body"]["answers"], want["answers"])
        elif status == 200:
            assert abs(response["response"]["body"]["answers"][0]["probability"] - want["answers"][0]["probability"]) < 1e-5
    whole = out.read_text()
    out.write_text("".join(whole.splitlines(keepends=True)[:2]) + '{"custom_id": "ba')  # stopped mid-line
    assert invoke("decide", requests, "-o", out, "-m", long_model_dir, "--resume").exit_code == 4
    again = records(out)
    assert [r["line"] for r in again] == [1, 2, 3, 4, 5]
    # the same answer; its prefix was written by the first run (or an earlier test), so now maybe read from the store
    assert again[3]["response"]["body"]["answers"] == got[3]["response"]["body"]["answers"]
    assert invoke("decide", requests, "-o", out, "-m", long_model_dir).exit_code == 2  # exists: not overwritten


def test_prefixes_kept_in_memory_are_bounded_and_one_read_from_disk_is_not_reported_as_written(long_model_dir, tmp_path):
    from prefixcache.scoring.options import ScoringOptions
    from prefixcache.serve.decider import Ask, Decider

    options = ScoringOptions.from_environment(tmp_path / "cache", device="cpu", dtype="float32")
    decider = Decider(str(long_model_dir), options, prefixes=2)
    asks = [Ask(f"You read tickets, {n}.", TICKET, {"refund": PACK["refund"]}) for n in range(4)]
    for ask in asks:  # four instructions, each asked twice: four packs, at most two prefixes held
        first, again = decider.decide([ask])[0], decider.decide([ask])[0]
        assert first.written_tokens > 0 and first.cached_tokens == 0 and again.cached_tokens == first.written_tokens
        assert decider.prefixes_in_memory <= 2
    fresh = Decider(str(long_model_dir), options)  # a new process: its prefixes are on disk, none in memory
    got = fresh.decide([asks[0]])[0]
    assert got.written_tokens == 0 and got.cached_tokens > 0  # read from the prefix store, not computed


def test_new_instructions_are_a_cost_the_fairness_rule_sees_and_are_never_prefilled_before_their_pass(
        long_model_dir, tmp_path, monkeypatch):
    from prefixcache.scoring.options import ScoringOptions
    from prefixcache.serve.decider import Ask, Decider
    from prefixcache.serve.errors import TooCostly

    options = ScoringOptions.from_environment(tmp_path / "cache", device="cpu", dtype="float32")
    decider = Decider(str(long_model_dir), options)
    prefilled: list[int] = []
    prefill = decider.engine.prefill
    decider.engine.prefill = lambda ids: prefilled.append(len(ids)) or prefill(ids)
    ask = Ask("You read support tickets for a bank. " * 40, TICKET, {"refund": PACK["refund"]})
    new = decider.ready([ask])[0]
    assert prefilled == [] and not new.cached  # made ready: tokenised, costed, not run
    assert new.cost > new.prep.enc.prefix_len > 200  # the prefix to prefill is part of its cost
    answered = decider.decide_ready([new])[0]
    assert prefilled == [new.prep.enc.prefix_len] and answered.written_tokens == new.prep.enc.prefix_len
    again = decider.ready([ask])[0]
    assert again.cached and again.cost == new.cost - new.prep.enc.prefix_len  # held now: only its own tokens
    assert answered.input_tokens == decider.decide_ready([again])[0].input_tokens
    strict = Decider(str(long_model_dir), options.replace(cache_store=False), max_tokens=new.cost - 1)
    fresh = Ask("You read support tickets for a shop. " * 40, TICKET, {"refund": PACK["refund"]})
    refused = strict.ready([fresh])[0]
    assert isinstance(refused, TooCostly) and "new instructions" in str(refused)
    # a pack whose scorer cannot be made in its pass is that ask's failure, never its neighbours'
    from prefixcache.errors import SpecError
    from prefixcache.serve import decider as module

    made = module.build_on
    monkeypatch.setattr(module, "build_on", lambda task, *a, **k: (_ for _ in ()).throw(SpecError("request: no"))
                        if "a bank" in task.spec.system else made(task, *a, **k))
    other = Decider(str(long_model_dir), options.replace(cache_store=False))
    failed, answered = other.decide([ask, Ask("You read tickets.", TICKET, {"refund": PACK["refund"]})])
    assert isinstance(failed, SpecError) and answered.answers["refund"]["type"] == "noul"


def _hang_up(url: str, body: dict) -> None:
    """Send a whole request, then close the connection without reading the answer (a client gone)."""
    import socket
    from urllib.parse import urlparse

    at = urlparse(url)
    data = json.dumps(body).encode()
    with socket.create_connection((at.hostname, at.port), timeout=10) as sock:
        sock.sendall(f"POST {at.path} HTTP/1.1\r\nHost: {at.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)


def test_abandoned_requests_are_not_computed_and_identical_ones_are_computed_once(long_model_dir):
    served = Served(long_model_dir, "--max-batch", "1")  # one request a pass: the others queue behind it
    so = served.url + "/v1/systemone"
    health = served.url + "/health"

    def counts() -> dict:
        with urllib.request.urlopen(health, timeout=10) as resp:
            return json.loads(resp.read())

    try:
        base = counts()
        with ThreadPoolExecutor(4) as pool:
            slow = pool.submit(post, so, {"model": "x", "state": f"{TICKET} " * 300, "questions": PACK})
            deadline = time.monotonic() + 300  # the slow one is in its pass before the others arrive
            while counts()["waiting"] == 0 and not slow.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            for n in range(3):
                _hang_up(so, {"model": "x", "state": f"gone {n} {TICKET}", "questions": PACK})
            same = {"model": "x", "state": f"twice {TICKET}", "questions": PACK}
            twice = [pool.submit(post, so, same) for _ in range(2)]
            assert slow.result()[0] == 200
            first, second = (f.result() for f in twice)
        assert first == second and first[0] == 200
        assert post(so, same) == first  # a retry just after: answered again, not computed
        after = counts()
        assert after["dropped"] - base["dropped"] == 3  # the three hung up while queued: never computed
        assert after["computed"] - base["computed"] == 2  # the slow one and the identical pair, once
        assert after["shared"] - base["shared"] == 2
        assert served.stop() == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    assert sum(" 499 " in line for line in served.lines) == 3


def test_exact_and_pruning_are_refused_by_the_server_not_ignored(tmp_path):
    from prefixcache.errors import UsageError
    from prefixcache.scoring.options import ScoringOptions
    from prefixcache.serve.decider import Decider

    for changes, said in (({"exact": True}, "on"), ({"prune": "on"}, "on"), ({"prune": "exact"}, "exact")):
        options = ScoringOptions.from_environment(tmp_path, device="cpu", dtype="float32").replace(**changes)
        with pytest.raises(UsageError, match=f"--exact and --prune {said} are for run"):
            Decider(None, options)


def test_the_client_snippets_in_the_docs_run(server):
    """Each snippet of docs/serve.md's Clients section, run against a server (its address put in)."""
    import re
    import shutil

    from helpers import ROOT

    text = (ROOT / "docs" / "serve.md").read_text()
    section = text.split("## Clients", 1)[1].split("\n## ", 1)[0]
    snippets = re.findall(r"```(python|bash)\n(.*?)```", section, re.S)
    assert [lang for lang, _ in snippets] == ["python", "python", "bash"]
    for lang, code in snippets:
        code = code.replace("http://127.0.0.1:8000", server.url)
        if lang == "bash":
            if shutil.which("curl") is None:
                continue
            done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0 and json.loads(done.stdout)["answers"]["refund"]["type"] == "noul", done.stderr
            continue
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), code


def test_a_question_that_gives_one_answer_to_nearly_every_request_is_said_once(long_model_dir, tmp_path, caplog):
    import logging

    from prefixcache.scoring.options import ScoringOptions
    from prefixcache.serve.decider import Ask, Decider

    options = ScoringOptions.from_environment(tmp_path / "cache", device="cpu", dtype="float32")
    decider = Decider(str(long_model_dir), options)
    same = Ask("You read tickets.", TICKET, {"refund": PACK["refund"]})
    with caplog.at_level(logging.WARNING, logger="prefixcache"):
        decider.decide([same] * 19)
        assert not [r for r in caplog.records if "for question 'refund'" in r.getMessage()]  # 19: too few to say
        decider.decide([same] * 30)  # a server's later requests: said once, not again
    said = [r.getMessage() for r in caplog.records if "for question 'refund'" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("100% of the requests (20 of 20) got ")
    assert 'try "calibrate": true on the question' in said[0]


def _bad_body(case: dict) -> bytes:
    if "nest" in case:
        n = case["nest"]
        return (n["prefix"] + n["open"] * n["n"] + n["middle"] + n["close"] * n["n"] + n["suffix"]).encode()
    if "raw" in case:
        return case["raw"].encode("utf-8", "surrogatepass")  # the JSON text as a client sends it
    return json.dumps(case["body"]).encode()


def test_the_hostile_body_corpus_gets_its_documented_status_and_never_a_5xx(server):
    cases = [json.loads(line) for line in (Path(__file__).parent / "data" / "bad_bodies.jsonl").read_text().splitlines()]
    assert len(cases) >= 40
    wrong = []
    for case in cases:
        route = server.url + ("/v1/systemone" if case["route"] == "systemone" else "/v1/decisions")
        status, payload = post(route, None, case.get("headers"), raw=_bad_body(case))
        if status != case["status"]:
            wrong.append((case["why"], status, payload))
            continue
        if status >= 400 and case["route"] == "systemone":  # the format's error shape
            assert isinstance(payload["detail"], list) if status == 422 else set(payload["detail"]) == {"error_type", "message"}
        elif status >= 400:
            assert payload["error"]["message"] and payload["error"]["type"] == "invalid_request_error"
    assert not wrong, wrong
    assert not any("Traceback" in line or " 500 " in line for line in server.lines)


def test_a_request_over_the_token_limit_is_refused_unscored_and_a_light_one_is_not_stuck_behind_heavy_ones(long_model_dir):
    served = Served(long_model_dir, "--max-request-tokens", "3000", "--batch-wait-ms", "0")
    so, oa = served.url + "/v1/systemone", served.url + "/v1/decisions"
    heavy_pack = {"c": {"type": "choice", "instructions": "Which queue?", "list": False,
                        "criteria": {f"queue number {i} of the support desk": None for i in range(200)}}}
    heavy = {"model": "x", "state": TICKET, "questions": heavy_pack}
    light = {"model": "x", "state": TICKET, "questions": {"refund": PACK["refund"]}}
    try:
        too = {**heavy, "questions": {**heavy_pack, "d": {**heavy_pack["c"], "instructions": "And which second?"}}}
        status, payload = post(so, too)
        assert status == 413 and payload["detail"]["error_type"] == "request_too_costly", payload
        assert "over this server's limit of 3000" in payload["detail"]["message"]
        status, payload = post(oa, {"model": "x", "input": TICKET, "questions": [
            {"type": "choice", "instructions": f"Which queue, {k}?", "choices": [{"value": f"queue number {i}"}
                                                                              for i in range(200)]} for k in range(2)]})
        assert status == 413 and payload["error"]["code"] == "request_too_costly"
        start = time.monotonic()
        assert post(so, heavy)[0] == 200
        heavy_s = time.monotonic() - start
        finished: dict[str, float] = {}

        def send(name: str, body: dict) -> None:
            assert post(so, body)[0] == 200
            finished[name] = time.monotonic()

        with ThreadPoolExecutor(8) as pool:  # six heavy requests queued (distinct states), then a light one
            for n in range(6):
                pool.submit(send, f"heavy{n}", {**heavy, "state": f"{n} {TICKET}"})
            time.sleep(min(0.5, heavy_s / 2))
            sent = time.monotonic()
            pool.submit(send, "light", light).result(timeout=120)
        # it waited for the pass running when it came (a pass takes heavy ones up to the token budget), not for six
        assert sum(v > finished["light"] for k, v in finished.items() if k != "light") >= 2, (finished, sent)
    finally:
        assert served.stop() == 0


def test_sigterm_answers_the_queue_until_its_deadline_then_503_and_exits_0_without_a_traceback(long_model_dir):
    # one request a pass: a queue forms; no time to drain it (the test before: a drain that answers all)
    served = Served(long_model_dir, "--max-batch", "1", "--drain-seconds", "0")
    so = served.url + "/v1/systemone"
    long = f"{TICKET} " * 60
    try:
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(post, so, {"model": "x", "state": f"{n} {long}", "questions": PACK}) for n in range(12)]
            deadline = time.monotonic() + 300
            while not any("POST /v1/systemone 200" in line for line in served.lines) and time.monotonic() < deadline:
                time.sleep(0.002)
            served.proc.send_signal(signal.SIGTERM)
            got = [f.result() for f in futures]
            assert served.proc.wait(120) == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    statuses = [status for status, _ in got]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1 and statuses.count(503) >= 6, statuses
    for status, payload in got:
        if status == 503:
            assert payload["detail"]["error_type"] == "unavailable"
    said = "".join(served.lines)
    assert "Traceback" not in said and "CancelledError" not in said
    assert "answered 503, to be sent again" in said


def _raw_exchange(url: str, head: bytes, body: bytes, hang_up: bool) -> bytes:
    import socket
    from urllib.parse import urlparse

    at = urlparse(url)
    with socket.create_connection((at.hostname, at.port), timeout=10) as sock:
        sock.sendall(head + body)
        if hang_up:
            time.sleep(0.3)
            return b""
        sock.settimeout(3)
        return sock.recv(4096)


def test_a_client_hanging_up_mid_body_is_its_own_499_and_an_impossible_length_is_413_at_once(server):
    from urllib.parse import urlparse

    so = server.url + "/v1/systemone"
    at = urlparse(so)
    for _ in range(2):  # declares 1000 bytes, sends 9, hangs up
        _raw_exchange(so, f"POST {at.path} HTTP/1.1\r\nHost: {at.netloc}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: 1000\r\n\r\n".encode(), b'{"model":', hang_up=True)
    answer = _raw_exchange(so, f"POST {at.path} HTTP/1.1\r\nHost: {at.netloc}\r\nContent-Type: application/json\r\n"
                               f"Content-Length: 99999999999\r\n\r\n".encode(), b"{", hang_up=False)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]  # answered before a body that never comes
    deadline = time.monotonic() + 120
    while sum(" 499 " in line for line in server.lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(" 499 " in line for line in server.lines) >= 2
    assert not any("internal error" in line or "Traceback" in line for line in server.lines)


def test_health_answers_this_machines_clients_only_and_two_host_headers_are_400(server):
    import socket
    from urllib.parse import urlparse

    at = urlparse(server.url)
    request = urllib.request.Request(server.url + "/health", headers={"Host": "attacker.example"})
    try:
        urllib.request.urlopen(request, timeout=10)
        status = 200
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status == 403
    with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"
    body = json.dumps({"model": "m", "state": "x", "questions": {"q": {"type": "noul", "instructions": "Urgent?"}}})
    with socket.create_connection((at.hostname, at.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        assert sock.recv(200).startswith(b"HTTP/1.1 400")
