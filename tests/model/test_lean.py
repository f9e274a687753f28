"""Converted weights read straight into their dtype (model/lean.py): the same model as
`from_pretrained` gives, tensor for tensor, at the memory of the weights in that dtype."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model

from prefixcache.model.lean import load_lean

pytestmark = pytest.mark.slow  # the quick tier (-m "not slow and not e2e") leaves it out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lean_load_is_from_pretrained_s_model_tensor_for_tensor(arch, dtype, chat_tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from prefixcache.model import lean

    monkeypatch.setattr(lean, "CHUNK_BYTES", 1000)  # many chunks a tensor, one ending mid-row
    tiny_model(arch, len(chat_tokenizer)).save_pretrained(tmp_path, safe_serialization=True)
    got = load_lean(tmp_path, dtype)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype).eval()
    assert got is not None and got.config._attn_implementation == want.config._attn_implementation
    mine, theirs = got.state_dict(), want.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {k: v.dtype for k, v in got.named_buffers()} == {k: v.dtype for k, v in want.named_buffers()}
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_tied_embeddings_stay_tied(chat_tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(chat_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    model = load_lean(tmp_path, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"


def test_a_folder_whose_tensors_are_not_the_model_s_is_left_to_from_pretrained(chat_tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("llama", len(chat_tokenizer)).save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors", {"format": "pt"})
    assert load_lean(tmp_path, torch.float32) is None
    tensors.pop("lm_head.weight")
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    assert load_lean(tmp_path, torch.float32) is None


PEAK = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    from prefixcache.model.lean import load_lean

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights():  # the modelling code imported (about 170 MB), not counted
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from what is resident now
    before = status("VmRSS")
    if sys.argv[2] == "lean":
        model = load_lean(Path(sys.argv[1]), torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    print(json.dumps({"grew_mb": (status("VmHWM") - before) / 1024}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc")
def test_the_loader_s_peak_is_the_weights_in_their_dtype(tmp_path):
    """A model of 40M parameters kept in float32 (160 MB) read into bfloat16 (80 MB): the process
    grows by the bfloat16 weights and a chunk, where from_pretrained also holds the float32 ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    bf16_mb = sum(p.numel() for p in model.parameters()) * 2 / 2**20
    model.save_pretrained(tmp_path, safe_serialization=True)
    del model

    def grew(how):
        done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path), how], capture_output=True, text=True,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])["grew_mb"]

    lean = grew("lean")
    assert lean < bf16_mb * 1.15 + 40, (lean, bf16_mb)
    assert grew("from_pretrained") > lean + bf16_mb * 0.5  # what it saves: the check can fail


@pytest.fixture(scope="module")
def tiny_gguf(gguf_file, gguf_parsed):
    """A tiny F32 GGUF file and its tokenizer."""
    from prefixcache.model import load

    source = load.resolve_model(str(gguf_file))
    return source, load.load_tokenizer(source, gguf_parsed)


@pytest.mark.parametrize("kept", [True, False])
def test_a_gguf_file_s_first_run_is_its_later_runs_model(kept, tiny_gguf, tmp_path, monkeypatch):
    """The run that converts a GGUF file (what one read without its weights kept runs on) and the
    runs that read the kept copy compute with the same model in bfloat16: the same parameters,
    and rotary frequencies left in float32 (rounded frequencies moved the 0.5B model's scores by
    0.01 nats). Kept or not (a cache that cannot take the copy converts in memory every time)."""
    from prefixcache.model import load

    source, tokenizer = tiny_gguf
    cache = tmp_path / "cache"
    if not kept:
        monkeypatch.setattr(load, "keep_converted", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    first = load.load_model(source, tokenizer, cache, "cpu", torch.bfloat16, keep=False)
    load.forget_verified()
    later = load.load_model(source, tokenizer, cache, "cpu", torch.bfloat16, keep=False)
    a, b = dict(first.named_parameters()), dict(later.named_parameters())
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    buffers = {k: v for k, v in first.named_buffers()}
    assert buffers and all(v.dtype == torch.float32 for k, v in buffers.items() if v.is_floating_point())
    assert all(torch.equal(v, buffers[k]) for k, v in later.named_buffers())
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, later(ids).logits)


def test_a_damaged_converted_model_is_rebuilt_with_a_warning(tiny_gguf, tmp_path, caplog):
    """A converted copy (what a GGUF file read without its weights kept runs on: int8, an
    architecture not read that way) torn as a full disk leaves it is not used, said, and made
    again, the user's alone under the loosest umask."""
    import os

    from prefixcache.model import load

    source, tokenizer = tiny_gguf
    cache = tmp_path / "cache"
    load.load_model(source, tokenizer, cache, "cpu", torch.float32, keep=False)
    converted = load.converted_dir(source, cache)
    weights = next(converted.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    load.forget_verified()
    old = os.umask(0)
    try:
        model = load.load_model(source, tokenizer, cache, "cpu", torch.float32, keep=False)
    finally:
        os.umask(old)
    assert "are not used" in caplog.text and "converting again" in caplog.text
    assert weights.stat().st_size > 1000  # made again
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o700 if p.is_dir() else 0o600) for p in converted.rglob("*"))
    with torch.no_grad():
        assert model(torch.tensor([[1, 5, 9]])).logits.isfinite().all()


def test_int8_layers_quantised_as_they_load_are_the_whole_model_quantised_after(chat_tokenizer, tmp_path):
    """int8 quantises each layer as it is read (never a float32 copy of the whole model): the
    same model as a float32 load quantised afterwards, to the last bit of its logits."""
    from transformers import AutoModelForCausalLM

    from prefixcache.model import int8

    if not int8.installed():
        pytest.skip("needs torchao")
    tiny_model("qwen2", len(chat_tokenizer)).save_pretrained(tmp_path, safe_serialization=True)
    each = int8.LayerQuantiser()
    got = load_lean(tmp_path, torch.float32, each)
    assert each.finish(got) and int8.precision_of(got) == "int8" and each.count == 14  # 7 a layer, not the head
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    int8.quantise(want)
    assert type(got.lm_head.weight) is type(want.lm_head.weight) is torch.nn.Parameter  # the head stays float32
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 2]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
