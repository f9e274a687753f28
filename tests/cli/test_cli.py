"""The CLI, run in-process on a tiny local model: exact messages, exit codes, output records."""

from __future__ import annotations

import csv
import json
import re

import pytest
from helpers import LABELS, TEXTS, invoke, make_spec, write_spec
from transformers import AutoModelForCausalLM, AutoTokenizer

from prefixcache import __version__
from prefixcache.model.reference import score_naive




@pytest.fixture(autouse=True)
def quick_bench(monkeypatch):
    """`bench` measures the matmul peak for a second; these tests check its figures, not the machine."""
    from prefixcache.run import bench

    monkeypatch.setattr(bench, "PEAK_SECONDS", 0.05)

@pytest.fixture()
def spec_path(spec_file):
    return spec_file(labels=LABELS, examples=[{"text": "refund me", "label": "billing"}])


@pytest.fixture()
def items_path(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"id": f"i{n}", "text": t}) + "\n" for n, t in enumerate(TEXTS)))
    return path



def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout == f"prefixcache {__version__}\n"


def test_exact_help_says_what_decides_and_promises_no_speed():
    text = " ".join(w for w in invoke("run", "--help", env={"COLUMNS": "200"}).stdout.split() if w != "│")
    assert "at about bfloat16 speed" not in text and "Its speed depends on how many items are close calls" in text
    assert "Which items follows from the scores alone, by a bound measured once on the input's first items" in text


def test_every_command_has_examples_that_parse():
    """Each command's help shows examples, and every example's options are the command's own
    (parsed as the command would, nothing run): an option renamed or dropped breaks this."""
    import shlex

    import typer

    from prefixcache.cli import app

    group = typer.main.get_command(app)
    commands = {name: group.commands[name] for name in group.commands if name != "cache"}
    commands.update({f"cache {name}": cmd for name, cmd in group.commands["cache"].commands.items()})
    for name, command in commands.items():
        lines = [line.strip() for line in (command.help or "").splitlines() if (line.strip() + " ").startswith(f"prefixcache {name} ")]
        assert lines, f"prefixcache {name} --help shows no example"
        for line in lines:
            args = shlex.split(line.split("|")[-1].split(">")[0].split("#")[0])[len(name.split()) + 1:]
            command.make_context(f"prefixcache {name}", args)  # a usage error here is an example gone stale


def test_run_writes_records_equal_to_naive_scoring(spec_path, items_path, tmp_path, tiny_model_dir):
    out = tmp_path / "pred.jsonl"
    result = invoke("run", spec_path, items_path, "-o", out, "--batch-size", 3)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert f"{len(TEXTS)} items in" in result.stderr and "prefix" in result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [f"i{n}" for n in range(len(TEXTS))]

    rendered = invoke("render", spec_path, items_path)
    assert rendered.exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    lines = [json.loads(line) for line in rendered.stdout.splitlines()]
    prefix = lines[0]["prompt_ids"][: lines[0]["prefix_len"]]  # every item starts with the same cached ids
    assert len(prefix) > 10
    for record, r in zip(records, lines, strict=True):
        assert r["id"] == record["id"]
        assert r["prompt_ids"][: r["prefix_len"]] == prefix[: r["prefix_len"]] and r["prefix_len"] >= len(prefix) - 1
        names = list(r["candidates"])
        want = score_naive(model, r["prompt_ids"], list(r["candidates"].values()))
        got = [record["logprobs"][n] for n in names]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        assert record["label"] == names[max(range(len(names)), key=want.__getitem__)]
        assert abs(sum(record["probs"].values()) - 1) < 1e-4
        assert record["item_tokens"] == len(r["prompt_ids"]) - r["prefix_len"]


def test_render_shows_prefix_and_candidates(spec_path, items_path, tiny_model_dir):
    result = invoke("render", spec_path, items_path, "--limit", 2)
    assert result.exit_code == 0
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = lines[0]
    assert set(first) == {"id", "prompt", "prompt_ids", "prefix_len", "candidates"}
    assert tok(first["prompt"], add_special_tokens=False)["input_ids"] == first["prompt_ids"]
    assert lines[1]["prompt_ids"][: first["prefix_len"]] == first["prompt_ids"][: first["prefix_len"]]
    assert tok.decode(first["candidates"]["billing"]) == "billing<|im_end|>"


def test_csv_in_csv_out_and_stdin(spec_path, tmp_path):
    src = tmp_path / "items.csv"
    src.write_text('id,text\n1,"crash, again"\n2,"refund\nplease"\n', encoding="utf-8")
    out = tmp_path / "pred.csv"
    result = invoke("run", spec_path, src, "-o", out, "-q")
    assert result.exit_code == 0 and result.stderr == ""
    rows = list(csv.DictReader(out.open()))
    assert [r["id"] for r in rows] == ["1", "2"] and "prob_billing" in rows[0] and "logprob_tech" in rows[0]

    piped = invoke("run", spec_path, "-", "--format", "csv", "-q", input=src.read_text())
    assert piped.exit_code == 0
    records = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [r["label"] for r in records] == [r["label"] for r in rows]


def test_limit(spec_path, items_path):
    result = invoke("run", spec_path, items_path, "--limit", 2, "-q")
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 2


def test_unknown_key_one_line_exit_2(tmp_path, items_path):
    path = write_spec(tmp_path, colour="red")
    result = invoke("run", path, items_path)
    assert result.exit_code == 2
    assert result.stderr == f"error: {path}: unknown key 'colour'; known keys: model, revision, backend, system, labels, examples, template, id_field, format, normalize, answer_prefix, choices, score_by, gold, calibrate, threshold, trust_remote_code, multi_label, question, answers, gold_sep, questions, head\n"


def test_missing_model_path_exit_3(tmp_path, items_path):
    path = write_spec(tmp_path, model="./no/such/model")
    result = invoke("run", path, items_path)
    assert result.exit_code == 3
    assert result.stderr == "error: model path './no/such/model' does not exist\n"


def test_bad_input_line_exit_2(spec_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops}\n')
    result = invoke("run", spec_path, bad)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {bad}:2: malformed JSON")
    assert "Traceback" not in result.output


def test_missing_field_exit_2(spec_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "body": "ok"}\n')
    result = invoke("run", spec_path, bad)
    assert result.exit_code == 2
    assert result.stderr == f"error: {bad}:1: item 'a' lacks field 'text' used by the template (its fields: 'id', 'body')\n"


def test_unwritable_output_exit_2(spec_path, items_path, tmp_path):
    result = invoke("run", spec_path, items_path, "-o", tmp_path / "missing" / "out.jsonl")
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'missing' / 'out.jsonl'}: folder {tmp_path / 'missing'} does not exist\n"


def _model_with_context(tmp_path, tiny_model_dir, positions):
    import shutil

    small = tmp_path / f"model-{positions}"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (small / "config.json").write_text(json.dumps(config))
    return small


def test_item_too_long_for_context(tmp_path, tiny_model_dir, items_path, spec_path):
    rendered = [json.loads(line) for line in invoke("render", spec_path, items_path).stdout.splitlines()]
    prefix_len = rendered[0]["prefix_len"]
    limit = prefix_len + 40
    longest = max(len(c) for c in rendered[0]["candidates"].values())
    # The first item whose prompt and longest candidate (all but its last token) overflow.
    long_item = next(r for r in rendered if len(r["prompt_ids"]) + longest - 1 > limit)
    assert long_item is not rendered[0]
    path = write_spec(tmp_path, name="small.yaml", model=str(_model_with_context(tmp_path, tiny_model_dir, limit)),
                      examples=[{"text": "refund me", "label": "billing"}])
    out = tmp_path / "pred.jsonl"
    result = invoke("run", path, items_path, "-q", "-b", 1, "-o", out)
    assert result.exit_code == 4
    n = len(long_item["prompt_ids"])
    assert result.stderr == f"error: item {long_item['id']!r}: {n} prompt tokens do not fit the model's context of {limit}\n"
    done = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert done == [r["id"] for r in rendered[: rendered.index(long_item)]]  # finished work is kept


def test_prefix_too_long_for_context(tmp_path, tiny_model_dir, items_path):
    path = write_spec(tmp_path, model=str(_model_with_context(tmp_path, tiny_model_dir, 16)))
    result = invoke("run", path, items_path)
    assert result.exit_code == 3
    assert "more than the model's context of 16" in result.stderr


def test_bench_json_reports_every_mode(spec_path, items_path):
    result = invoke("bench", spec_path, items_path, "--limit", 3, "--json", "--batch-tokens", 200)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [m["mode"].split(" (")[0] for m in report["modes"]] == [
        "naive: full re-encode per item",
        "naive: full forward per item and label",
        "cached, one item at a time",
        "run pipeline",
    ]
    assert [m["items"] for m in report["modes"]] == [3, 3, len(TEXTS), len(TEXTS)]
    assert report["same_labels"] is True and report["items_compared"] == 3 and report["items_differing"] == 0
    assert report["peak_gflops"] > 0 and report["unavoidable_gflop"] > 0
    assert report["option_cost_ratio"] > 0 and report["option_cost_floor"] > 1  # labels add tokens and logits rows
    assert all(m["ms_per_item"] > 0 and 0 < m["efficiency"] for m in report["modes"])
    base = report["modes"][0]["ms_per_item"]  # speed-up is over the naive re-encode
    assert [m["speedup"] for m in report["modes"]] == pytest.approx([base / m["ms_per_item"] for m in report["modes"]])


def test_bench_table(spec_path, items_path):
    result = invoke("bench", spec_path, items_path, "--limit", 2, "--max-items", 4)
    assert result.exit_code == 0, result.output
    steps = [line.split("prefixcache: ", 1)[1] for line in result.stderr.splitlines()]  # a log: stamped lines
    assert steps[0] == "bench: loading the model" and "bench: timing naive: full re-encode per item on 2 items" in steps
    assert steps[-1] == "bench: measuring this machine's matrix-product peak at the engine's precision, where it has one"
    warm = steps.index("bench: warming up each mode on one item (with 6 labels)")
    assert re.fullmatch(r"bench: timing every mode: about \d+ s from the warm-up .*", steps[warm + 1]), steps
    assert "run pipeline" in result.stdout and "matmul peak" in result.stdout
    assert "same labels in every mode: yes" in result.stdout
    for row in ("every label to the end (--prune auto, off)", "--prune on", "--prune exact"):
        assert row in result.stdout
    assert re.search(r"pruning does not pay here|--prune (on|exact) is the fastest here \(\d\.\d\dx\)", result.stdout)
    assert "bench: timing 4 items, the naive modes on 2" in steps


def test_bench_estimates_the_per_label_naive_mode_when_it_would_take_minutes(spec_path, items_path, monkeypatch):
    import prefixcache.run.bench

    monkeypatch.setattr(prefixcache.run.bench, "NAIVE_SECONDS", 0.0)  # as if one item took minutes
    result = invoke("bench", spec_path, items_path, "--max-items", 4, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [m["estimated"] for m in report["modes"]] == [False, True, False, False]
    assert report["modes"][1]["ms_per_item"] > 0 and report["same_labels"]
    assert "not timing naive: full forward per item and label: about" in result.stderr
    timed = invoke("bench", spec_path, items_path, "--max-items", 4, "--limit", 1, "--json")  # asked for: timed
    assert not any(m["estimated"] for m in json.loads(timed.stdout)["modes"])


def test_bench_sizes_itself_by_the_labels_unless_told(tmp_path):
    from prefixcache.run.options import bench_sizes

    assert bench_sizes(make_spec(tmp_path, labels=["a", "b", "c"])) == (16, 256)
    many = make_spec(tmp_path, labels=[f"intent {n}" for n in range(59)])
    assert bench_sizes(many) == (2, 34)  # a naive mode runs a forward per item and label
    assert bench_sizes(make_spec(tmp_path, labels=[f"intent {n}" for n in range(300)])) == (1, 16)
    assert bench_sizes(many, naive=5, cached=100) == (5, 100)


def test_duplicate_items_are_scored_once(spec_path, tmp_path):
    src = tmp_path / "dups.jsonl"
    texts = ["crash on start", "refund please", "crash on start", "crash on start", "refund please", "new one"]
    src.write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(texts)))
    out = tmp_path / "o.jsonl"
    result = invoke("run", spec_path, src, "-o", out, "--batch-size", 2)
    assert result.exit_code == 0, result.output
    assert "3 duplicates reused" in result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == list(range(6))
    assert records[0]["logprobs"] == records[2]["logprobs"] == records[3]["logprobs"]
    assert records[1]["logprobs"] == records[4]["logprobs"]
    assert records[0]["logprobs"] != records[1]["logprobs"]


def test_hub_id_offline_is_one_line_exit_3(tmp_path, items_path, monkeypatch):
    from prefixcache.model.load import resolve_model

    assert resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct").kind == "hub"
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    path = write_spec(tmp_path, model="no-such-org/no-such-model")
    result = invoke("run", path, items_path)
    assert result.exit_code == 3
    assert result.stderr.startswith("error: cannot load the tokenizer of no-such-org/no-such-model: ")
    assert len(result.stderr.splitlines()) == 1


def test_bench_compares_decisions_under_the_specs_normalisation(tmp_path, tiny_model_dir):
    spec = write_spec(tmp_path, name="mc.yaml", labels=None, model=str(tiny_model_dir), choices="choices",
                      template="Q: {text}", normalize="mean")
    items = tmp_path / "mc.jsonl"
    options = [["two", "four legs and a tail", "six"], ["yes", "no, not at all, never"], ["a", "bb", "a longer option here"]]
    items.write_text("".join(json.dumps({"id": n, "text": t, "choices": o}) + "\n"
                             for n, (t, o) in enumerate(zip(TEXTS[:len(options)], options, strict=True))))
    result = invoke("bench", spec, items, "--limit", 3, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["same_labels"] is True


def test_bench_table_counts_items_whose_labels_differ(capsys):
    from prefixcache.run.bench import BenchReport, ModeResult
    from prefixcache.cli.show import print_bench

    modes = [ModeResult(f"mode {i}", 3, 10.0, 100.0, None, 0.5, 1.0) for i in range(4)]
    report = BenchReport(device="cpu", dtype="bfloat16", threads=2, peak_gflops=100.0, load_seconds=0.1,
                         prefill_ms=1.0, prefix_tokens=10, item_tokens=5.0, candidate_tokens=2.0,
                         unavoidable_gflop=1.0, same_labels=False, items_compared=3, items_differing=1,
                         option_cost_ratio=1.2, option_cost_floor=1.1, store_load_ms=1.0, store_prefill_ms=2.0,
                         modes=modes)
    print_bench(report)
    assert "same labels in every mode: NO (1 of 3 items differ)" in capsys.readouterr().out


def test_a_log_shows_long_labels_whole_in_the_evaluation_tables(tmp_path, tiny_model_dir):
    labels = ["search_flights_intent", "search_hotels_intent", "search_trains_intent"]
    spec = write_spec(tmp_path, model=str(tiny_model_dir), labels=labels, gold="answer")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": n, "text": f"trip {n}", "answer": labels[n % 3]}) + "\n" for n in range(6)))
    result = invoke("run", spec, src, "-o", tmp_path / "o.jsonl", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    table_lines = [line for line in result.stderr.splitlines() if line.startswith(("│", "┃"))]
    for label in labels:  # in the per-label table and in the confusion matrix's rows and header
        assert sum(label in line for line in table_lines) >= 3, (label, result.stderr)
    assert "…" not in result.stderr


def test_render_text_shows_the_prompt_with_the_split_marked(spec_path, items_path):
    as_json = json.loads(invoke("render", spec_path, items_path, "--limit", 1).stdout)
    result = invoke("render", spec_path, items_path, "--limit", 1, "--text")
    assert result.exit_code == 0, result.output
    head, rest = result.stdout.split("\n", 1)
    assert head == f"=== item {as_json['id']} ==="
    prefix, rest = rest.split(f"\n----- cached prefix above ({as_json['prefix_len']} tokens), the item's own "
                              f"{len(as_json['prompt_ids']) - as_json['prefix_len']} tokens below -----\n")
    own, candidates = rest.split("\n----- candidates, scored after the item -----\n")
    assert prefix + own == as_json["prompt"]
    assert [line.split(":")[0].strip() for line in candidates.strip().splitlines()] == [repr(c) for c in as_json["candidates"]]


def test_an_empty_gold_runs_a_labelled_spec_on_unlabelled_items(tmp_path, spec_file):
    spec = spec_file(labels=["tech", "billing"], gold="label")
    items = tmp_path / "unlabelled.jsonl"
    items.write_text('{"id": 1, "text": "The app crashes"}\n{"id": 2, "text": "Charged twice"}\n')
    refused = invoke("run", spec, items, "-o", tmp_path / "a.jsonl")
    assert refused.exit_code == 2 and "label" in refused.stderr
    result = invoke("run", spec, items, "-o", tmp_path / "b.jsonl", "--gold", "")
    assert result.exit_code == 0, result.output
    assert all("gold" not in json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines())
    qspec = spec_file(name="q.yaml", questions={"team": {"type": "choice", "instructions": "Which team?",
                                                        "criteria": {"tech": None, "billing": None}, "gold": "team"}})
    assert invoke("run", qspec, items, "-o", tmp_path / "c.jsonl").exit_code == 2
    assert invoke("run", qspec, items, "-o", tmp_path / "d.jsonl", "--gold", "").exit_code == 0


def test_a_run_of_many_labels_shows_its_most_frequent_confusions_not_a_matrix_wider_than_a_line(spec_file, tmp_path):
    labels = [f"team {c}" for c in "abcdefghijklmn"]  # 14 labels: a 14-column matrix does not fit a line
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": i, "text": t, "gold": labels[i % 14]}) + "\n" for i, t in enumerate(TEXTS)))
    result = invoke("run", spec_file(labels=labels, gold="gold"), items, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    said = result.stdout + result.stderr
    assert "most frequent confusions (14 labels" in said and "gold \\ predicted" not in said
    items.write_text("".join(json.dumps({"id": i, "text": t, "gold": labels[i % 3]}) + "\n" for i, t in enumerate(TEXTS)))
    few = invoke("run", spec_file(name="few.yaml", labels=labels[:3], gold="gold"), items, "-o", tmp_path / "few.jsonl")
    assert "gold \\ predicted" in few.stdout + few.stderr  # a matrix that fits is shown whole


def test_no_two_options_of_a_command_share_a_flag():
    import typer.main

    from prefixcache.cli.app import app

    group = typer.main.get_command(app)
    commands = [(name, cmd) for name, cmd in group.commands.items()]
    commands += [(f"{name} {sub}", c) for name, cmd in group.commands.items() for sub, c in getattr(cmd, "commands", {}).items()]
    for name, cmd in commands:
        flags = [f for p in cmd.params for f in (*p.opts, *p.secondary_opts) if f.startswith("-")]
        assert len(flags) == len(set(flags)), (name, sorted(f for f in flags if flags.count(f) > 1))
