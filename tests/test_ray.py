"""prefixcache on a local Ray cluster and a tiny model, one cluster for all (each start costs
seconds and processes on the suite's two cores): Ray Data's `Classify` gives the CLI's records,
Ray Data's `Decide` writes `decide`'s responses, and Ray Serve with one replica answers over HTTP
as `decide` answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from helpers import QUESTIONS, free_port, invoke, question_row_is, records, write_spec

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install 'prefixcache[serve]')")

INSTRUCTIONS = "You read support tickets."
TICKET = "I was charged twice for March and my refund has not arrived."
PACK = {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"Billing": "Payments", "Technical": None}},
        "anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]}}
LINES = [
    {"custom_id": "a", "model": "x", "instructions": INSTRUCTIONS, "state": TICKET, "questions": PACK},
    {"custom_id": "b", "model": "x", "input": [{"role": "developer", "content": INSTRUCTIONS},
                                               {"role": "user", "content": "The app crashes on start."}],
     "questions": [{"type": "predicate", "name": "refund", "instructions": "Does the customer want money back?"}]},
    {"custom_id": "c", "model": "x", "state": "s", "questions": {"q": {"type": "score", "instructions": "x",
                                                                       "criteria": ["only one"]}}},
    {"custom_id": "d", "model": "x", "instructions": INSTRUCTIONS, "state": {"subject": "Locked out"}, "questions": PACK},
]


def _resume_from_a_checkpoint(ray, tmp_path, folder, spec, cache_dir, actor) -> object:
    """A job with Ray Data's row-level checkpoint that wrote the first file's rows and stopped,
    resumed on every file by the same spec: the rows both wrote. (A job of another spec is refused
    as its actors start: tests/scoring/test_raycheckpoint.py.)"""
    import pandas as pd
    from ray.data.checkpoint import CheckpointConfig

    context = ray.data.DataContext.get_current()
    context.checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=str(tmp_path / "checkpoint"),
                                                 delete_checkpoint_on_success=False)
    try:
        def job(spec_file, items, out):
            ray.data.read_parquet(str(items)).map_batches(
                prefixcache.ray.Classify, fn_constructor_kwargs={"spec": str(spec_file), "cache_dir": str(cache_dir)},
                batch_size=8, **actor).write_parquet(str(out))

        import prefixcache.ray

        job(spec, folder / "part0.parquet", tmp_path / "first")  # stopped after the first file's rows
        job(spec, folder, tmp_path / "rest")
    finally:
        context.checkpoint_config = None
    written = [pd.read_parquet(tmp_path / name) for name in ("first", "rest") if (tmp_path / name).exists()]
    assert (tmp_path / "checkpoint" / "prefixcache.fingerprint.json").is_file()  # what answered, kept for a resume
    return pd.concat(written, ignore_index=True)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _numbers(body: dict) -> list[float]:
    """Every probability in an answer body of either format, in order (ids, usage and timings aside)."""
    answers = body.get("answers")
    found: list[float] = []
    for answer in (answers.values() if isinstance(answers, dict) else answers or []):
        for key in ("noul", "score", "probability", "confidence"):
            if isinstance(answer.get(key), float):
                found.append(answer[key])
        found += list((answer.get("probabilities") or {}).values())
    return found


def _same(got: dict, want: dict) -> None:
    """The same answer to float rounding, or the same error."""
    if "answers" not in want:
        assert got == want
        return
    assert set(got) == set(want) and _numbers(want)
    assert _numbers(got) == pytest.approx(_numbers(want), abs=1e-5)


@pytest.mark.slow
def test_classify_decide_and_serve_on_ray_give_the_clis_numbers(tmp_path, tiny_model_dir, cache_dir, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'prefixcache[ray]')")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'prefixcache[rayserve]')")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from ray import serve

    import prefixcache.ray
    from prefixcache.serve.rayserve import deployment

    spec = write_spec(tmp_path, model=str(tiny_model_dir), questions=QUESTIONS)
    texts = [f"{TICKET} (case {n})" if n % 2 else f"Thanks, all good. Case {n}." for n in range(24)]
    folder = tmp_path / "items"
    folder.mkdir()
    for part in range(2):  # two files, two blocks
        rows = range(part * 12, part * 12 + 12)
        pq.write_table(pa.table({"id": [f"i{n}" for n in rows], "text": [texts[n] for n in rows]}),
                       folder / f"part{part}.parquet")
    pq.write_table(pa.table({"id": [f"i{n}" for n in range(24)], "text": texts}), tmp_path / "all.parquet")
    assert invoke("run", spec, tmp_path / "all.parquet", "-o", tmp_path / "run.jsonl", "-q").exit_code == 0
    records_by_id = {r["id"]: r for r in records(tmp_path / "run.jsonl")}
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    assert invoke("decide", requests, "-o", tmp_path / "out.jsonl", "-m", tiny_model_dir, "-q").exit_code == 4
    want = records(tmp_path / "out.jsonl")

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a local, private cluster
    monkeypatch.setenv("RAY_enable_worker_prestart", "0")  # workers started when needed, not two idle ones first
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # logical CPUs: a resumed job's checkpoint filter holds one of its own
    try:
        actor = {"compute": ray.data.ActorPoolStrategy(size=1), "num_cpus": 0.5, "batch_format": "pandas"}
        # Classify's rows: a job with Ray Data's checkpoint stopped after one file, resumed
        classified = _resume_from_a_checkpoint(ray, tmp_path, folder, spec, cache_dir, actor)
        decided = ray.data.from_items([{"text": json.dumps(line)} for line in LINES], override_num_blocks=2).map_batches(
            prefixcache.ray.Decide, fn_constructor_kwargs={"model": str(tiny_model_dir), "cache_dir": str(cache_dir)},
            batch_size=2, **actor).to_pandas()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(str(tiny_model_dir), num_replicas=1), name="decisions", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
            listed = json.loads(resp.read())
        served = [_post(url + ("/v1/decisions" if "input" in line else "/v1/systemone"),
                        {k: v for k, v in line.items() if k != "custom_id"}) for line in LINES]
        # ray.shutdown() below ends Serve with the local cluster it started
    finally:
        ray.shutdown()

    assert sorted(classified["id"]) == sorted(records_by_id)  # each item once: the first job's rows, then the rest
    for row in classified.to_dict("records"):
        assert question_row_is(row, records_by_id[row["id"]]["answers"])
    by_id = {row["custom_id"]: row for row in decided.to_dict("records")}
    assert sorted(by_id) == ["a", "b", "c", "d"]
    for response in want:
        row = by_id[response["custom_id"]]
        assert row["status_code"] == response["response"]["status_code"]
        assert row["request_sha"] == response["request_sha"]
        _same(json.loads(row["body"]), response["response"]["body"])
    assert listed["data"][0]["id"] == tiny_model_dir.name and listed["models"]
    for (status, body), response in zip(served, want, strict=True):
        assert status == response["response"]["status_code"], body
        _same(body, response["response"]["body"])
