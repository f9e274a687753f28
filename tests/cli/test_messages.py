"""What the command line says when it is used wrongly: one line, the right exit code, before any
model loads."""

from __future__ import annotations

import re
import subprocess
import sys
import pytest
from helpers import invoke, write_spec
from prefixcache.task.specfile import load_spec
from helpers import LABELS3, items_file, jsonl_of_ids, ticket_texts, write_texts


def test_bad_device_and_world_size_in_the_environment(spec_path, tmp_path):
    result = invoke("run", spec_path, items_file(tmp_path), env={"PREFIXCACHE_DEVICE": "gpu9"})
    assert result.exit_code == 2 and result.stderr == "error: unknown device 'gpu9'; use auto, cpu, cuda, cuda:N or mps\n"
    result = invoke("run", spec_path, items_file(tmp_path), env={"WORLD_SIZE": "two"})
    assert result.exit_code == 2
    assert result.stderr == "error: WORLD_SIZE is 'two', not a number of processes; unset it unless a launcher sets it\n"


def test_help_short_flag_and_choices():
    result = invoke("run", "-h", env={"COLUMNS": "120"})
    assert result.exit_code == 0 and "<fail|skip>" in result.stdout and "<jsonl|csv>" in result.stdout
    assert "<auto|float32|bfloat16|float16|int8>" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("--format", "csv", "--encoding", "bogus"), "no such text encoding"),
    (("--format", "csv", "--delimiter", ""), "--delimiter must be one character"),
    (("--format", "csv", "--delimiter", ";;"), "--delimiter must be one character"),
    (("--device", "cuda:7"), "cuda:7"),
])
def test_bad_reading_and_device_options_are_usage_errors(tmp_path, args, message):
    spec, items = write_spec(tmp_path, labels=LABELS3), tmp_path / "i.csv"
    items.write_text("id,text\n1,refund\n")
    result = invoke("run", spec, items, *args)
    assert result.exit_code in (2, 3) and message in result.output and "internal error" not in result.output, result.output


def test_usage_errors_and_report_paths_are_one_line_before_the_run(spec_path, tmp_path):
    src = jsonl_of_ids(tmp_path / "in.jsonl", ["x"])
    zero = invoke("run", spec_path, src, "--limit", 0)
    assert zero.exit_code == 2
    assert zero.stderr == ("error: Invalid value for '--limit' / '-n': Input should be greater than or equal to 1 "
                           "(see prefixcache run -h)\n")
    gold = write_spec(tmp_path, name="gold.yaml", model=load_spec(spec_path).model, labels=["tech", "billing"], gold="answer")
    src.write_text('{"id": 1, "text": "x", "answer": "tech"}\n')
    missing = invoke("run", gold, src, "-o", tmp_path / "o.jsonl", "--metrics", tmp_path / "no" / "m.json")
    assert missing.exit_code == 2
    assert missing.stderr == f"error: --metrics {tmp_path / 'no' / 'm.json'}: folder {tmp_path / 'no'} does not exist\n"
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_options(spec_four_labels, tmp_path):
    src = write_texts(tmp_path / "in.jsonl", ticket_texts(2))
    bad = invoke("run", spec_four_labels, src, "--on-error", "ignore")
    text = " ".join(bad.stderr.replace("│", " ").split())
    assert bad.exit_code == 2 and "'ignore' is not one of 'fail', 'skip'" in text  # the choices, as --help shows
    assert invoke("run", spec_four_labels, src, "--resume").stderr == "error: --resume needs an output file (-o)\n"
    assert invoke("run", spec_four_labels, src, "--log-level", "loud").exit_code == 2


@pytest.mark.slow
def test_spec_errors_do_not_import_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("labels: [a]\nlables: [b]\n")
    code = ("import sys; from prefixcache.cli.app import app\n"
            "try:\n    app(['run', sys.argv[1], 'x.jsonl'])\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True)
    assert out.stdout.strip() == "2 False False"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prefixcache: " + re.escape(
        f"error: {bad}: unknown key 'lables'; did you mean 'labels'?\n"), out.stderr)  # stamped: a log read later


@pytest.mark.parametrize(
    "text, message",
    [
        ("labels: [a, b\n", "{path}:2:1: YAML syntax error: expected ',' or ']', but got '<stream end>'"),
        ("labels: []\n", "{path}: 'labels' is empty"),
        ("labels: [a, a]\n", "{path}: label 'a' is listed twice"),
        ("labels: [a]\ncolor: red\n", "{path}: unknown key 'color'; known keys: model, revision, backend, system, labels, examples, template, "
                                      "id_field, format, normalize, answer_prefix, choices, score_by, gold, calibrate, threshold, trust_remote_code, multi_label, question, answers, gold_sep, questions, head"),
    ],
)
def test_bad_spec_is_one_line_and_exit_2(tmp_path, text, message):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    items = write_texts(tmp_path / "in.jsonl", ticket_texts(2))
    result = invoke("run", path, items)
    assert result.exit_code == 2
    assert result.stderr == "error: " + message.format(path=path) + "\n"

