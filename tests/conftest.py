"""Fixtures: an offline byte-level BPE tokenizer trained in-process, and tiny random models of
several architectures built from transformers config classes. Nothing is downloaded. torch and
transformers are imported by the fixtures that need them, so spec and prompt tests start fast."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # several test processes share the cores: one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every test process (each worker, and each command a test starts) imports the test modules and
# the package: where PYTHONDONTWRITEBYTECODE is set (container images often set it), each compiled
# and assertion-rewritten them again, 3-4 s a process. The suite keeps its bytecode.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

def pytest_collection_modifyitems(config, items):
    """Under xdist's worksteal each worker starts on a contiguous share of the collection and,
    once done, steals from the tail of another's: a suite that ends with a minute-long test ends
    with one worker idle for that minute. So the modules holding tests marked slow or e2e are dealt
    out first, heaviest first, one share each by weight, and the other modules fill the shares (a
    module stays whole, so its fixtures are set up once, except where a share's end cuts it)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or getattr(config.option, "dist", "no") != "worksteal":
        return
    modules: dict[Any, list] = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    heavy = sorted((m for m in modules.values() if any(i.get_closest_marker("slow") or i.get_closest_marker("e2e")
                                                        for i in m)), key=len, reverse=True)
    shares: list[list] = [[] for _ in range(workers)]
    for module in heavy:
        min(shares, key=len).extend(module)
    light = [i for m in modules.values() if m not in heavy for i in m]
    remaining, ordered = len(items), []
    for n, share in enumerate(shares):  # xdist's first share is len // workers, and so on
        size = remaining // (workers - n)
        while len(share) < size and light:
            share.append(light.pop(0))
        remaining -= len(share)
        ordered += share
    items[:] = ordered + light


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NO_SYSTEM_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{{ '<turn>' + m['role'] + '\n' + m['content'] + '<end>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<turn>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<turn>", "<end>"]

CORPUS = [
    "Ticket: I was charged twice for my subscription, please refund the payment.",
    "Ticket: The app crashes when I open a project. Error 502 from the API.",
    "Ticket: I forgot my password and cannot sign in to my account.",
    "billing technical account tech technology bill billed refund invoice",
    "You are a support ticket router. Answer with exactly one of these labels:",
    "Review: great product, would buy again. positive negative neutral",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat.",
] * 3


def build_tokenizer(chat_template: str | None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:]
    )
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    return build_tokenizer(CHATML)


@pytest.fixture(scope="session")
def plain_tokenizer() -> Any:
    return build_tokenizer(None)


def tiny_model(arch: str, vocab: int, seed: int = 0, init: float = 0.2, positions: int = 1024) -> Any:
    """A 2-layer random model whose weights are large enough that context changes the scores
    by far more than the test tolerance (so a masking bug cannot hide under it)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, initializer_range=init, tie_word_embeddings=False)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=positions, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, max_position_embeddings=positions, **common)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=positions, **common)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    return model.float().eval()


def planted(model: Any, token: int, strength: float = 8.0) -> Any:
    """The model with `token` made near-certain after any token but the first of an answer: every
    embedding gets a large constant first coordinate, which survives to the final norm, and the
    output row of `token` reads it. A random model finds every label's later tokens unlikely, so
    no label is ever negligible before its end; planted, a label that ends with `token` (a chat
    answer's end of turn) is complete, for its probability, at its first tokens, as with a trained
    model, and pruning leaves labels at a bound."""
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 20.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[token, 0] = strength
    return model


ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session", params=ARCHS)
def arch_model(request, chat_tokenizer):
    return request.param, tiny_model(request.param, len(chat_tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, chat_tokenizer):
    """A tiny Llama and the chat tokenizer saved as a local model directory, for CLI tests."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", len(chat_tokenizer)).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def library_logs_reach_caplog(monkeypatch):
    """The CLI keeps prefixcache's log lines to its own stderr handler; tests read them through
    caplog, which listens on the root logger."""
    import logging

    logger = logging.getLogger("prefixcache")
    monkeypatch.setattr(logger, "propagate", True)
    level = logger.level
    logger.setLevel(logging.NOTSET)  # an earlier --quiet command set ERROR
    yield
    logger.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory) -> Path:
    """A cache folder of the tests' own, so tests never read, write or fill the user's cache: a new
    one per session (the embedded model's tokenizer and config kept in it once, by the first test
    that needs them), or PREFIXCACHE_TEST_CACHE, a folder kept for the tests across sessions. The CLI finds it through PREFIXCACHE_CACHE_DIR, as a user would set it; runs
    started from Python without a cache folder use the default, under XDG_CACHE_HOME, which points
    into the session's temporary folder too."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one cache for the session's workers: the embedded model's tokenizer parsed once
    base = shared / "xdg-cache"
    base.mkdir(exist_ok=True)
    kept = os.environ.get("PREFIXCACHE_TEST_CACHE")
    root = Path(kept) if kept else base / "prefixcache"
    root.mkdir(parents=True, exist_ok=True)
    previous = {k: os.environ.get(k) for k in ("PREFIXCACHE_CACHE_DIR", "XDG_CACHE_HOME")}
    os.environ.update(PREFIXCACHE_CACHE_DIR=str(root), XDG_CACHE_HOME=str(base))
    yield root
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
    """A tiny Llama GGUF file (F32 weights, SmolLM2's 49k-token tokenizer), written once per test
    process: tests read it, never change it."""
    from gguf_fixture import write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-F32.gguf")


@pytest.fixture(scope="session")
def gguf_parsed(gguf_file, tmp_path_factory) -> Path:
    """A cache folder holding `gguf_file`'s tokenizer and config, parsed once per test process
    (seconds for 49k tokens): read it, or copy it into a test's own cache (`seed_cache`)."""
    from prefixcache.model import load

    folder = tmp_path_factory.mktemp("gguf-parsed")
    load.load_tokenizer(load.resolve_model(str(gguf_file)), folder)
    return folder


def seed_cache(parsed: Path, cache: Path) -> Path:
    """`cache`, a new cache folder of a test's own, with the tokenizer parsed in `parsed`."""
    import shutil

    shutil.copytree(parsed, cache)
    return cache


@pytest.fixture(scope="session")
def embedded_ready(cache_dir):
    """The session's workers share its cache: the first to get here reads the embedded model once
    (its tokenizer and config parsed from the file and kept there) while the others wait for it,
    instead of each parsing the same file on the same two cores."""
    import fcntl

    from prefixcache.model.load import load_model, load_tokenizer, resolve_model

    with open(cache_dir / ".tests-embedded.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = resolve_model(None)
        load_model(source, load_tokenizer(source, cache_dir), cache_dir)


# -- a full disk -----------------------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A 48 KiB file system, mounted for the test (skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.fixture()
def spec_file(tmp_path, tiny_model_dir):
    """A factory of spec files for the tiny model: `spec_file(labels=[...], template=...)` (any
    spec keys; `name=` the file's name)."""
    from helpers import write_spec

    def make(name: str = "spec.yaml", **keys: Any) -> Path:
        return write_spec(tmp_path, name=name, model=str(tiny_model_dir), **keys)

    return make


@pytest.fixture()
def spec_path(spec_file):
    """The plainest spec: two labels, tech and billing."""
    return spec_file(labels=["tech", "billing"])


@pytest.fixture()
def spec_three_labels(spec_file):
    """Two labels that share a first token (tech, technical) and billing, no gold."""
    return spec_file(labels=["tech", "technical", "billing"], gold=None)


@pytest.fixture()
def spec_four_labels(spec_file):
    """tech, technical, billing and a two-word label."""
    return spec_file(labels=["tech", "technical", "billing", "account access"])


@pytest.fixture
def races_of_any_size(monkeypatch):
    """Pruned scoring races however few candidate tokens an item has (the tiny models' label sets
    are small; a run scores those in full, as a race would not pay)."""
    from prefixcache.scoring import scorer

    monkeypatch.setattr(scorer, "MIN_RACE_TOKENS", 0)
