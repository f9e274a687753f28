"""`run --backend llama.cpp` on a GGUF file written by the tests: labels, tags, typed questions
and pruning give the records `--backend transformers` gives on the same file (to float rounding);
the prefix store keeps its prefix; what it cannot do is refused in one line before loading."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

from conftest import seed_cache  # noqa: E402
from helpers import invoke, records, write_spec  # noqa: E402

pytestmark = pytest.mark.slow  # the quick tier (-m "not slow and not e2e") leaves it out

ROWS = [{"id": f"t{n}", "text": text} for n, text in enumerate([
    "I was charged twice for my subscription, please refund it.", "The app crashes when I open a project.",
    "I forgot my password and cannot sign in.", "Where is my invoice for March?", "Error 502 from the API",
    "Please close my account and delete my data."])]
PACK = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "invoices", "tech": None,
                                                                         "sales": None}},
    "blocked": {"type": "noul", "instructions": "Is the customer blocked?"},
}


@pytest.fixture(autouse=True)
def _cache(gguf_parsed, tmp_path):
    """Each test's own cache (`tmp_path / "cache"`: prefixes and outputs of its own), the file's
    tokenizer parsed once for all."""
    seed_cache(gguf_parsed, tmp_path / "cache")


@pytest.fixture()
def items(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def both(tmp_path, spec, items, gguf_file, *extra):
    """The records of each backend on the same spec, items and file, and llama.cpp's stderr."""
    out = {}
    for backend in ("transformers", "llama.cpp"):
        path = tmp_path / f"{spec.stem}-{backend}.jsonl"
        result = invoke("run", spec, items, "-o", path, "-m", gguf_file, "--backend", backend,
                        "--cache-dir", tmp_path / "cache", *extra)
        assert result.exit_code == 0, result.output
        out[backend] = records(path)
    return out["transformers"], out["llama.cpp"], result.stderr


def close(a, b, tol=1e-3):
    """Two records alike: every number within `tol`, everything else equal."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_labels_match_transformers_and_the_prefix_is_kept(tmp_path, items, gguf_file):
    spec = write_spec(tmp_path, labels=["billing", "technical problem", "account access"])
    want, got, said = both(tmp_path, spec, items, gguf_file)
    assert close(want, got), (want[0], got[0])
    assert "backend: llama.cpp" in said and "cpu all F32" in said and "prefix" in said
    again = invoke("run", spec, items, "-o", tmp_path / "again.jsonl", "-m", gguf_file, "--backend", "llama.cpp",
                   "--cache-dir", tmp_path / "cache")
    assert again.exit_code == 0 and " tokens loaded" in again.stderr  # from the prefix store
    assert records(tmp_path / "again.jsonl") == got


def test_tags_and_typed_questions_match_transformers(tmp_path, items, gguf_file):
    tags = write_spec(tmp_path, "tags.yaml", labels=["billing", "bug", "login"], multi_label=True)
    want, got, _ = both(tmp_path, tags, items, gguf_file)
    assert close(want, got) and all("labels" in r for r in got)
    questions = write_spec(tmp_path, "questions.yaml", questions=PACK)
    want, got, _ = both(tmp_path, questions, items, gguf_file)
    assert close(want, got) and all(set(r["answers"]) == {"team", "blocked"} for r in got)


@pytest.mark.usefixtures("races_of_any_size")
@pytest.mark.parametrize("mode", ["on", "exact"])
def test_pruning_races_as_on_transformers(tmp_path, items, gguf_file, mode):
    """The race on llama.cpp (items kept in their sequences between decodes) gives the records
    the race on transformers gives: the same labels, the same labels left at their bounds, the
    same probabilities to float rounding; with fewer label tokens than full scoring."""
    short = ["billing", "bug", "login", "refund", "crash", "invoice", "password", "account"]
    long = [f"{w} and then some more words" for w in ("apple", "river", "garden", "window", "yellow", "market",
                                                      "silver", "orange", "forest", "planet", "summer", "castle")]
    spec = write_spec(tmp_path, labels=short + long)  # a near-flat model: long labels lose by their length
    want, got, said = both(tmp_path, spec, items, gguf_file, "--prune", mode)
    assert close(want, got), (want[0], got[0])
    assert [r["pruned"] for r in got] == [r["pruned"] for r in want]
    assert sum(len(r["pruned"]) for r in got) >= (len(long) * len(got) // 2 if mode == "on" else 1)
    assert "every label is scored to the end" not in said
    if mode == "on":  # the labels of scoring every label (transformers' race is held to them in tests/scoring)
        full = tmp_path / "full.jsonl"
        assert invoke("run", spec, items, "-o", full, "-m", gguf_file, "--backend", "llama.cpp").exit_code == 0
        assert [r["label"] for r in records(full)] == [r["label"] for r in got]


def test_the_spec_names_the_backend(tmp_path, items, gguf_file):
    spec = write_spec(tmp_path, labels=["billing", "technical"], backend="llama.cpp", model=str(gguf_file))
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0 and "backend: llama.cpp" in result.stderr
    bad = write_spec(tmp_path, "bad.yaml", labels=["a", "b"], backend="vllm")
    result = invoke("run", bad, items, "-o", tmp_path / "bad.jsonl")
    assert result.exit_code == 2 and "backend must be one of auto, transformers, llama.cpp" in result.stderr


@pytest.mark.parametrize("extra, words", [
    (["--exact", "--dtype", "bfloat16"], "--exact scores close calls again in float32"),
    (["--dtype", "bfloat16"], "llama.cpp computes in the GGUF file's own types"),
])
def test_what_llama_cpp_cannot_do_is_refused_in_one_line(tmp_path, items, gguf_file, extra, words):
    spec = write_spec(tmp_path, labels=["billing", "technical"])
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "-m", gguf_file, "--backend", "llama.cpp",
                    *extra)
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_a_model_that_is_no_gguf_file_is_refused(tmp_path, items, tiny_model_dir):
    spec = write_spec(tmp_path, labels=["billing", "technical"])
    result = invoke("run", spec, items, "-o", tmp_path / "out.jsonl", "-m", tiny_model_dir, "--backend", "llama.cpp")
    assert result.exit_code == 2 and "llama.cpp reads GGUF files" in result.stderr


def test_fit_reads_states_on_llama_cpp_and_the_fitted_spec_runs_there(tmp_path, gguf_file):
    pytest.importorskip("sklearn")
    words = {"billing": "invoice refund charge", "technical": "crash error bug"}
    rows = [{"id": f"i{k}", "text": " ".join([words[label]] * (1 + k % 3)), "gold": label}
            for k, label in enumerate(["billing", "technical"] * 10)]
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = write_spec(tmp_path, labels=["billing", "technical"], gold="gold", model=str(gguf_file))
    out = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", out, "--folds", "4", "-q", "--backend", "llama.cpp",
                    "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    assert "backend: llama.cpp" in out.read_text()  # the head runs where its states were read
    ran = invoke("run", out, labelled, "-o", tmp_path / "preds.jsonl", "--cache-dir", tmp_path / "cache")
    assert ran.exit_code == 0 and "backend: llama.cpp" in ran.stderr, ran.output
    assert all(r["readout"] == "head" for r in records(tmp_path / "preds.jsonl"))


def test_an_output_names_its_engine_and_is_not_continued_by_another(tmp_path, items, gguf_file):
    """Two engines' numbers differ: an output's sidecar names the engine, its version and the
    precision it computed in, and a resume under another engine is refused in one line."""
    spec = write_spec(tmp_path, labels=["billing", "technical", "account"])
    out = tmp_path / "out.jsonl"
    common = ["-o", out, "-m", gguf_file, "--cache-dir", tmp_path / "cache"]
    first = invoke("run", spec, items, *common, "--backend", "llama.cpp", "--limit", "3")
    assert first.exit_code == 0, first.output
    sidecar = json.loads((tmp_path / "out.jsonl.prefixcache.json").read_text())
    fingerprint = sidecar.get("fingerprint", sidecar)
    assert fingerprint["engine"] == "llama.cpp" and fingerprint["engine_version"]
    assert fingerprint["dtype"] == "the GGUF file's own types"
    other = invoke("run", spec, items, *common, "--backend", "transformers", "--resume")
    assert other.exit_code == 2
    assert "it was written with --backend llama.cpp (this run: transformers); add it back" in other.stderr
    assert "--dtype" not in other.stderr  # the precision follows from the engine: not a second thing to restore
    again = invoke("run", spec, items, *common, "--backend", "llama.cpp", "--resume")
    assert again.exit_code == 0, again.output
    assert len(records(out)) == len(ROWS)


def test_a_head_fitted_on_llama_cpps_states_is_refused_on_transformers(tmp_path, gguf_file):
    pytest.importorskip("sklearn")
    spec = write_spec(tmp_path, labels=["billing", "technical"], gold="gold")
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({"id": f"x{n}", "text": f"{r['text']} ({n})", "gold": ["billing", "technical"][n % 2]})
                                + "\n" for n, r in enumerate(ROWS * 2)))
    fitted = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", fitted, "-m", gguf_file, "--backend", "llama.cpp", "--folds", "2",
                    "--cache-dir", tmp_path / "cache", "-q")
    assert result.exit_code == 0, result.output
    other = invoke("run", fitted, labelled, "-o", tmp_path / "o.jsonl", "--backend", "transformers",
                   "--cache-dir", tmp_path / "cache", "-q")
    assert other.exit_code == 2 and "run it with --backend llama.cpp" in other.stderr


def test_a_spec_beyond_llama_cpps_sequences_is_refused_before_the_model_loads(tmp_path, items, gguf_file):
    spec = write_spec(tmp_path, labels=[f"queue {n}" for n in range(300)])
    result = invoke("run", spec, items, "-o", tmp_path / "o.jsonl", "-m", gguf_file, "--backend", "llama.cpp",
                    "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 3, result.output
    assert "llama.cpp sequences an item, more than its 255" in result.stderr
    assert "memory:" not in result.stderr  # refused before the memory check and the load


def test_decide_on_llama_cpp_answers_as_on_transformers(tmp_path, gguf_file):
    """The server's path (what `decide` replays) on llama.cpp: a pack's answers those of the
    transformers engine on the same file, to float rounding."""
    lines = [{"custom_id": r["id"], "model": "x", "instructions": "You read support tickets.", "state": r["text"],
              "questions": PACK} for r in ROWS[:4]]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    answers = {}
    for backend in ("transformers", "llama.cpp"):
        out = tmp_path / f"{backend}.jsonl"
        result = invoke("decide", requests, "-o", out, "-m", gguf_file, "--backend", backend, "--cache-dir",
                        tmp_path / "cache", "-q")
        assert result.exit_code == 0, result.output
        answers[backend] = [r["response"]["body"]["answers"] for r in records(out)]
    assert len(answers["llama.cpp"]) == 4
    for want, got in zip(answers["transformers"], answers["llama.cpp"], strict=True):
        assert want.keys() == got.keys()
        for q in want:
            assert got[q].get("choice") == want[q].get("choice")
            for key, value in want[q].items():  # probabilities, confidence, noul: to float rounding
                if isinstance(value, float):
                    assert abs(got[q][key] - value) < 1e-3, (q, key)
                elif isinstance(value, dict) and key != "x_logprobs":
                    assert max(abs(got[q][key][k] - v) for k, v in value.items()) < 1e-3, (q, key)


def test_a_head_alone_on_typed_questions_runs_on_llama_cpp(tmp_path, gguf_file):
    """A pack fitted on llama.cpp's states: its heads of the state alone answer every question
    there, as its fit judged them (readout head, no option's log-probabilities)."""
    pytest.importorskip("sklearn")
    words = {"billing": "invoice refund charge", "tech": "crash error bug"}
    pack = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None},
                     "gold": "gold"}}
    rows = [{"id": f"i{k}", "text": " ".join([words[t]] * (1 + k % 3)), "gold": t}
            for k, t in enumerate(["billing", "tech"] * 10)]
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = write_spec(tmp_path, model=str(gguf_file), template="{text}", questions=pack)
    fitted = tmp_path / "fitted.yaml"
    result = invoke("fit", spec, labelled, "-o", fitted, "--folds", "4", "-q", "--backend", "llama.cpp",
                    "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    ran = invoke("run", fitted, labelled, "-o", tmp_path / "preds.jsonl", "--cache-dir", tmp_path / "cache")
    assert ran.exit_code == 0 and "backend: llama.cpp" in ran.stderr, ran.output
    got = records(tmp_path / "preds.jsonl")
    assert len(got) == len(rows)
    assert all(r["readout"] == {"team": "head"} and "logprobs" not in r for r in got)
    assert sum(r["correct"]["team"] for r in got) >= 0.8 * len(rows)


def test_short_memory_decodes_in_smaller_micro_batches_with_the_same_records(tmp_path, items, gguf_file, monkeypatch):
    """A decode runs as one micro-batch where memory allows; where a whole decode's buffers would
    not fit what is available, in UBATCH_TOKENS micro-batches (said), the records the same."""
    from prefixcache.model import llamaentry
    from prefixcache.model.llamacpp import DECODE_TOKENS, UBATCH_TOKENS, context_cells
    from prefixcache.model.memory import llama_footprint

    spec = write_spec(tmp_path, labels=["billing", "technical", "account"])
    common = ["-m", gguf_file, "--backend", "llama.cpp", "--cache-dir", tmp_path / "cache"]
    whole = invoke("run", spec, items, "-o", tmp_path / "whole.jsonl", *common)
    assert whole.exit_code == 0 and "micro-batches" not in whole.stderr, whole.output
    cells = context_cells(40)  # more than this spec's prefix: the estimates only grow with it
    small, big = (llama_footprint(gguf_file, cells, n).total for n in (UBATCH_TOKENS, DECODE_TOKENS))
    monkeypatch.setattr(llamaentry, "available_and_why", lambda: ((small + big) // 2, "this machine"))
    short = invoke("run", spec, items, "-o", tmp_path / "short.jsonl", *common)
    assert short.exit_code == 0 and f"{UBATCH_TOKENS}-token micro-batches" in short.stderr, short.output
    assert close(records(tmp_path / "short.jsonl"), records(tmp_path / "whole.jsonl"), 1e-4)


def test_bench_on_llama_cpp_times_its_cheapest_ranking_beside_the_pipeline(tmp_path, items, gguf_file, monkeypatch):
    """bench shows llama.cpp's own cheapest path (each label's first token, one prompt at a time)
    beside the run pipeline, with how many items it would label otherwise; no matmul peak; the
    races timed beside full scoring, as on transformers."""
    from prefixcache.run import bench

    monkeypatch.setattr(bench, "PEAK_SECONDS", 0.05)
    spec = write_spec(tmp_path, labels=["billing", "technical", "account"])
    result = invoke("bench", spec, items, "-m", gguf_file, "--backend", "llama.cpp", "--limit", 2, "--json",
                    "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    first = report["first_token"]
    assert first["items"] == len(ROWS) and first["ms_per_item"] > 0 and first["mode"].startswith("llama.cpp first token")
    assert 0 <= report["first_token_differing"] <= len(ROWS)
    assert report["peak_gflops"] == 0
    assert set(report["pruning"]["races"]) == {"on", "exact"}
    assert all(race["items_differing"] == 0 for race in report["pruning"]["races"].values())  # a float32 file
    table = invoke("bench", spec, items, "-m", gguf_file, "--backend", "llama.cpp", "--limit", 2,
                   "--cache-dir", tmp_path / "cache")
    assert table.exit_code == 0 and "its cheapest): " in table.stdout and "items get another label" in table.stdout


@pytest.mark.usefixtures("races_of_any_size")
def test_a_quantised_files_race_gives_a_resumed_run_the_same_records(tmp_path, gguf_file):
    """The race's groups (and so its decodes' shapes) follow from a batch's rows alone, never from
    what the process raced before: the second batch of a resumed run is raced as in the
    uninterrupted run, to the last bit, on a quantised file."""
    from gguf_fixture import quantize

    labels = [f"{w} {v}" for w in ("card", "loan", "account", "transfer", "payment", "app", "login", "refund")
              for v in ("new", "lost", "late", "failed", "closed", "changed", "blocked", "pending")]
    spec = write_spec(tmp_path, labels=labels)  # 64 labels: a group of a sequence a leaf holds 3 rows
    items = tmp_path / "many.jsonl"
    items.write_text("".join(json.dumps({"id": f"m{n}", "text": f"{ROWS[n % len(ROWS)]['text']} (case {n})"}) + "\n"
                             for n in range(8)))
    q8 = quantize(gguf_file, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    common = ["-m", q8, "--backend", "llama.cpp", "--prune", "on", "-b", 4, "--batch-tokens", 100000]
    whole = tmp_path / "whole.jsonl"
    assert invoke("run", spec, items, "-o", whole, *common).exit_code == 0
    assert resumed_after(tmp_path, spec, items, whole, 4, common) == records(whole)  # stopped after the first batch
    assert any(r["pruned"] for r in records(whole))


def resumed_after(tmp_path, spec, items, whole, kept, common):
    """The records of a run stopped after `kept` of `whole`'s records, then resumed."""
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text("".join(whole.read_text().splitlines(keepends=True)[:kept]))
    (tmp_path / "stopped.jsonl.prefixcache.json").write_text((tmp_path / "whole.jsonl.prefixcache.json").read_text())
    resumed = invoke("run", spec, items, "-o", stopped, "--resume", *common)
    assert resumed.exit_code == 0, resumed.output
    return records(stopped)


def test_a_quantised_files_records_are_the_same_after_a_stop_and_resume(tmp_path, items, gguf_file):
    """On a quantised file llama.cpp's numbers move a little with a row's neighbours: a resume forms
    the batches an uninterrupted run formed and scores a batch it stopped in whole again, so every
    record is the uninterrupted run's, to the last bit."""
    from prefixcache.model.load import embedded_model_file

    spec = write_spec(tmp_path, labels=["billing", "technical", "account"])
    common = ["-m", embedded_model_file(), "--backend", "llama.cpp", "--cache-dir", tmp_path / "cache"]
    pairs = tmp_path / "pairs.jsonl"  # the numbers do move with a row's neighbours on this Q4_1 file
    assert invoke("run", spec, items, "-o", pairs, *common, "-b", 2).exit_code == 0
    common += ["-b", 4]
    whole = tmp_path / "whole.jsonl"
    assert invoke("run", spec, items, "-o", whole, *common).exit_code == 0
    assert records(pairs) != records(whole)
    assert json.loads((tmp_path / "whole.jsonl.prefixcache.json").read_text())["scores_move_with_batch"] is True
    assert resumed_after(tmp_path, spec, items, whole, 2, common) == records(whole)  # stopped inside the first batch
