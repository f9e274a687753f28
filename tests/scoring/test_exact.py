"""--exact: a bfloat16 pass whose close calls are scored again in float32. Compared with a plain
float32 run on the same items: the same labels, and re-scored records equal to float32 records."""

from __future__ import annotations

import json

import pytest
from helpers import TEXTS, invoke, json_lines, write_spec

from prefixcache import compat

from prefixcache.data.output import read_records
from prefixcache.scoring import exact


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache of the test's own: a bound one test measures (under its patched constants) is kept
    there, and must not reach another."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture()
def job(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: True)  # run the bf16 pass on any CPU
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=["tech", "technical", "billing", "account access"])
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": f"{t} (case {n})"}) + "\n" for n, t in enumerate(TEXTS * 2)))
    plain = tmp_path / "fp32.jsonl"
    assert invoke("run", spec, items, "-o", plain, "-b", 4, "-q").exit_code == 0
    return spec, items, [json.loads(line) for line in plain.read_text().splitlines()]


def _exact_run(spec, items, out, *more):
    result = invoke("run", spec, items, "-o", out, "-b", 4, "--dtype", "bfloat16", "--exact", *more)
    assert result.exit_code == 0, result.output
    return result, [json.loads(line) for line in out.read_text().splitlines()]


def _drop_ms(records):
    return [{k: v for k, v in r.items() if k != "ms"} for r in records]


def test_everything_under_the_bound_is_a_float32_run(job, tmp_path, monkeypatch):
    spec, items, fp32 = job
    monkeypatch.setattr(exact, "FLOOR", 1e9)  # every item is a close call
    result, records = _exact_run(spec, items, tmp_path / "exact.jsonl")
    assert f"{len(fp32)} of {len(fp32)} items re-scored in float32 (100%" in result.stderr
    for got, want in zip(records, fp32, strict=True):
        assert got["precision"] == "float32" and got["label"] == want["label"]
        assert max(abs(got["logprobs"][k] - want["logprobs"][k]) for k in want["logprobs"]) < 1e-5


def test_the_bound_is_measured_on_the_first_items_and_only_calls_under_it_are_rescored(job, tmp_path, monkeypatch):
    spec, items, fp32 = job
    monkeypatch.setattr(exact, "FLOOR", 1e-12)
    monkeypatch.setattr(exact, "SAFETY", 0.0)  # a bound of 1e-12: no call is that close
    result, records = _exact_run(spec, items, tmp_path / "exact.jsonl")
    assert "on the first 22 items; calls closer than 1e-12 are scored again in float32" in result.stderr
    assert {r["precision"] for r in records} == {"bfloat16"}  # the measured items are decided as every other
    assert "0 of 22 items re-scored in float32" in result.stderr


def test_a_task_measured_once_is_not_measured_again_nor_its_twin_loaded_when_no_call_is_close(job, tmp_path, monkeypatch):
    spec, items, fp32 = job
    monkeypatch.setattr(exact, "FLOOR", 1e-12)
    monkeypatch.setattr(exact, "SAFETY", 0.0)
    first, records = _exact_run(spec, items, tmp_path / "first.jsonl")
    assert "loading the float32 twin" in first.stderr
    again, twice = _exact_run(spec, items, tmp_path / "again.jsonl")
    assert "measured before for this model, precision and task" in again.stderr
    assert "loading the float32 twin" not in again.stderr and "rounding moved" not in again.stderr
    assert _drop_ms(twice) == _drop_ms(records)


def test_records_follow_from_the_scores_alone_whatever_the_limit_the_cache_or_the_reading(job, tmp_path, monkeypatch):
    """The bound is measured on the input's first items batched as by default, so a run with
    --limit, a run that measures it anew and one on a stream write the same records; in other
    batches (bfloat16 scores move with the items beside them) the same labels."""
    spec, items, fp32 = job
    leads = sorted(sorted(r["logprobs"].values())[-1] - sorted(r["logprobs"].values())[-2] for r in fp32)
    monkeypatch.setattr(exact, "FLOOR", leads[len(leads) // 2])  # the median lead: some calls re-scored, others not
    monkeypatch.setattr(exact, "SAFETY", 0.0)
    _, whole = _exact_run(spec, items, tmp_path / "whole.jsonl")
    assert {r["precision"] for r in whole} == {"bfloat16", "float32"}
    _, limited = _exact_run(spec, items, tmp_path / "limited.jsonl", "--limit", 8)
    assert _drop_ms(limited) == _drop_ms(whole[:8])
    for size in (1, 3, 8):
        _, other = _exact_run(spec, items, tmp_path / f"b{size}.jsonl", "-b", size)
        assert [r["label"] for r in other] == [r["label"] for r in whole] == [r["label"] for r in fp32], size
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "another-cache"))  # measured anew: the same bound
    streamed = invoke("run", spec, "-", "-o", tmp_path / "stream.jsonl", "-b", 4, "--dtype", "bfloat16", "--exact",
                      "--format", "jsonl", input=items.read_text())
    assert streamed.exit_code == 0, streamed.output
    assert _drop_ms(json_lines(tmp_path / "stream.jsonl")) == _drop_ms(whole)


def test_labels_equal_a_float32_run_and_rescored_records_are_float32_records(job, tmp_path):
    spec, items, fp32 = job
    result, records = _exact_run(spec, items, tmp_path / "exact.jsonl")
    assert [r["label"] for r in records] == [r["label"] for r in fp32]
    assert {r["precision"] for r in records} <= {"float32", "bfloat16"}
    for got, want in zip(records, fp32, strict=True):
        if got["precision"] == "float32":
            assert max(abs(got["logprobs"][k] - want["logprobs"][k]) for k in want["logprobs"]) < 1e-5
            assert got["probs"] == pytest.approx(want["probs"], abs=1e-5)


def test_exact_needs_a_low_precision_dtype_and_falls_back_without_bf16_hardware(job, tmp_path, monkeypatch):
    spec, items, fp32 = job
    refused = invoke("run", spec, items, "--exact")
    assert refused.exit_code == 2
    assert refused.stderr == ("error: --exact re-scores the close calls of a bfloat16, float16 or int8 run in "
                              "float32: give --dtype bfloat16 (or int8, float16)\n")
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: False)
    out = tmp_path / "fallback.jsonl"
    result = invoke("run", spec, items, "-o", out, "-b", 4, "--dtype", "bfloat16", "--exact")
    assert result.exit_code == 0 and "no bfloat16 matrix instructions" in result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["precision"] for r in records} == {"float32"}
    assert [r["logprobs"] for r in records] == [r["logprobs"] for r in fp32]


def test_an_interrupted_and_resumed_exact_run_writes_the_uninterrupted_records(job, tmp_path):
    import signal

    from prefixcache.errors import Interrupted
    from prefixcache.run.job import run_job
    from prefixcache.run.options import RunOptions

    spec, items, _ = job
    _, whole = _exact_run(spec, items, tmp_path / "whole.jsonl")
    out = tmp_path / "resumed.jsonl"
    options = RunOptions(spec, str(items), output=str(out), batch_size=4, dtype="bfloat16", exact=True)
    batches = iter(range(100))
    with pytest.raises(Interrupted):
        run_job(options, stop=lambda: signal.SIGINT if next(batches) == 2 else None)  # after 3 of 6 batches
    assert 0 < len(out.read_text().splitlines()) < len(whole)
    assert invoke("run", spec, items, "-o", out, "-b", 4, "--dtype", "bfloat16", "--exact", "--resume").exit_code == 0
    assert _drop_ms(json_lines(out)) == _drop_ms(whole)


QUESTIONS = {"team": {"type": "choice", "instructions": "Which team?",
                      "criteria": {"billing": "invoices", "tech": None, "technical": None, "sales": None}},
             "blocked": {"type": "noul", "instructions": "Is the customer blocked?"},
             "mood": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "annoyed", "angry"]}}


def _decided(answer):
    """What an answer decides: the option, the side of a yes/no question, the most probable level."""
    if answer["type"] == "noul":
        return answer["noul"] >= 0.5
    return max(answer["probabilities"], key=answer["probabilities"].get)


@pytest.mark.parametrize("floor", [None, 1e9])
def test_typed_questions_decide_as_float32_and_rescored_answers_are_float32_answers(tmp_path, tiny_model_dir,
                                                                                    monkeypatch, floor):
    """Each question's decision is held to its own lead: an item is re-scored when any of its
    questions is a close call (floor 1e9: all of them, the whole run a float32 run)."""
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: True)
    if floor is not None:
        monkeypatch.setattr(exact, "FLOOR", floor)
    spec = write_spec(tmp_path, model=str(tiny_model_dir), questions=QUESTIONS)
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": f"{t} (case {n})"}) + "\n" for n, t in enumerate(TEXTS)))
    assert invoke("run", spec, items, "-o", tmp_path / "fp32.jsonl", "-b", 4, "-q").exit_code == 0
    fp32 = [json.loads(line) for line in (tmp_path / "fp32.jsonl").read_text().splitlines()]
    result = invoke("run", spec, items, "-o", tmp_path / "exact.csv", "-b", 4, "--dtype", "bfloat16", "--exact")
    assert result.exit_code == 0, result.output
    records = read_records(str(tmp_path / "exact.csv")).records  # the CSV's precision column reads back
    if floor:
        assert all(r["precision"] == "float32" for r in records)
    for got, want in zip(records, fp32, strict=True):
        assert {q: _decided(a) for q, a in got["answers"].items()} == {q: _decided(a) for q, a in want["answers"].items()}
        if got["precision"] == "float32":
            for q, answer in want["answers"].items():
                lps = got["answers"][q]["x_logprobs"]
                assert max(abs(lps[k] - v) for k, v in answer["x_logprobs"].items()) < 1e-5


def test_bfloat16_on_a_cpu_without_its_instructions_is_warned_of(job, tmp_path, monkeypatch):
    spec, items, fp32 = job
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: False)
    result = invoke("run", spec, items, "-o", tmp_path / "bf16.jsonl", "--dtype", "bfloat16", "--device", "cpu")
    assert result.exit_code == 0 and "--dtype bfloat16: this CPU has no bfloat16 matrix instructions" in result.stderr
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: True)
    quiet = invoke("run", spec, items, "-o", tmp_path / "bf16b.jsonl", "--dtype", "bfloat16", "--device", "cpu")
    assert quiet.exit_code == 0 and "no bfloat16 matrix instructions" not in quiet.stderr


def test_auto_runs_bfloat16_with_exact_where_the_cpu_and_the_model_make_it_pay(job, tmp_path, monkeypatch):
    """--dtype auto (the default) on a CPU with bfloat16 matrix instructions, for a model large
    enough (here: any), is bfloat16 with --exact: float32's labels, said in one line; without the
    instructions, or without the memory for both copies, float32 as before."""
    from prefixcache.model import memory
    from prefixcache.run import plan

    spec, items, fp32 = job
    monkeypatch.setattr(plan, "AUTO_LOW_PRECISION_PARAMETERS", 0)
    out = tmp_path / "auto.jsonl"
    result = invoke("run", spec, items, "-o", out, "-b", 4)
    assert result.exit_code == 0, result.output
    assert "dtype auto: bfloat16, its close calls scored again in float32 (--exact): this CPU has bfloat16 " \
           "matrix instructions (AVX-512 BF16 or AMX)" in result.stderr
    records = json_lines(out)
    assert [r["label"] for r in records] == [r["label"] for r in fp32] and {r["precision"] for r in records} <= {
        "bfloat16", "float32"}
    fingerprint = json.loads((tmp_path / "auto.jsonl.prefixcache.json").read_text())
    assert fingerprint["dtype"] == "bfloat16" and fingerprint["exact"] is True
    assert invoke("run", spec, items, "-o", out, "-b", 4, "--resume").exit_code == 0  # resolved the same way again

    monkeypatch.setattr(memory, "available_and_why", lambda: (1000, "this machine"))
    small = invoke("run", spec, items, "-o", tmp_path / "small.jsonl", "-b", 4)
    assert "dtype auto: float32 (bfloat16 with its float32 twin for close calls could need" in small.stderr
    monkeypatch.undo()
    monkeypatch.setattr(plan, "AUTO_LOW_PRECISION_PARAMETERS", 0)
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compat, "bf16_matmul", lambda device: False)
    plain = invoke("run", spec, items, "-o", tmp_path / "plain.jsonl", "-b", 4)
    assert plain.exit_code == 0 and "dtype auto" not in plain.stderr
    assert _drop_ms(json_lines(tmp_path / "plain.jsonl")) == _drop_ms(fp32)


def test_exacts_eligibility_is_one_rule_for_the_command_line_and_the_python_api(tmp_path, tiny_model_dir):
    from prefixcache import Classifier
    from prefixcache.errors import UsageError
    from prefixcache.scoring.options import exact_refusal
    from prefixcache.task.specfile import load_spec

    spec = load_spec(write_spec(tmp_path, model=str(tiny_model_dir)))
    assert exact_refusal(spec, None, "bfloat16") is None and exact_refusal(spec, "transformers", "int8") is None
    assert "give --dtype bfloat16" in exact_refusal(spec, None, "float32")
    assert "llama.cpp has no float32 twin" in exact_refusal(spec, "llama.cpp", "bfloat16")
    items = tmp_path / "in.jsonl"
    items.write_text(json.dumps({"id": 1, "text": TEXTS[0]}) + "\n")
    cli = invoke("run", write_spec(tmp_path, model=str(tiny_model_dir)), items, "--exact", "--dtype", "float32")
    assert cli.exit_code == 2 and exact_refusal(spec, None, "float32") in cli.stderr
    with pytest.raises(UsageError, match="give --dtype bfloat16"):  # the API hears the same line
        Classifier(str(write_spec(tmp_path, model=str(tiny_model_dir))), exact=True, dtype="float32", progress=False)
