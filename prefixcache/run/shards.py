"""Splitting one job into shards, and joining their outputs. No torch here.

A shard is a contiguous block of the input (after `--limit`): with N shards of n items, shard k
(0-based) takes items [k*n//N, (k+1)*n//N). Joining is then concatenation in shard order, and a
part's completeness is a count: its fingerprint records how many items it was given.
"""

from __future__ import annotations

import json
import logging
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .. import safefile
from ..errors import InputError, UsageError, first_line
from ..data.lock import output_lock
from ..data.output import FINGERPRINT_SUFFIX, check_distinct, fingerprint_path, read_records, write_fingerprint
from ..data.records import ids_digest, record_id
from .options import flags

if TYPE_CHECKING:
    from accelerate import PartialState

LAUNCH_TIMEOUT = 120  # seconds for every process of a launch to join

# Fingerprint fields that must agree between the parts of one job (device may differ by host):
# whatever shapes the records, or where each shard's items begin and end. The options among them
# are named in messages as the command line spells them.
OPTION_FIELDS = ("keep", "batch_size", "batch_tokens", "exact", "gold_sep", "prune")
SHARED_FIELDS = ("spec", "gold", "model", "input", "dtype", *OPTION_FIELDS, "of")
NAMES = {"of": "item count (--limit)", **{f.name: flag.name for f, flag in flags() if f.name in OPTION_FIELDS}}


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' (1-based, as users count) -> (k, n) with 0 <= k < n."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise InputError(f"--shard must look like K/N with 1 <= K <= N (e.g. 2/4), not {text!r}")
    return int(match[1]) - 1, int(match[2])


def shard_range(total: int, k: int, n: int) -> tuple[int, int]:
    return k * total // n, (k + 1) * total // n


def part_path(output: str, k: int, n: int) -> str:
    """out.jsonl -> out.part-2-of-4.jsonl (k is 0-based)."""
    path = Path(output)
    return str(path.with_name(f"{path.stem}.part-{k + 1}-of-{n}{path.suffix}"))


def _part_info(part: str) -> dict[str, Any]:
    if not Path(part).exists():
        raise InputError(f"{part}: not found")
    try:
        info = json.loads(fingerprint_path(part).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{part}: no {Path(part).name}{FINGERPRINT_SUFFIX} next to it; was it written with --shard?")
    except (OSError, json.JSONDecodeError):
        raise InputError(f"{part}: its fingerprint file is unreadable")
    if "shard" not in info:
        raise InputError(f"{part}: was not written with --shard")
    return info


def merge_parts(parts: Sequence[str], output: str) -> int:
    """Check that the parts are the complete shards of one job and write them, in shard order, to
    `output` (atomically). Returns the number of records."""
    if not parts:
        raise InputError("no parts to merge")
    if len(set(parts)) != len(parts):
        raise InputError(f"{next(p for p in parts if parts.count(p) > 1)} is given twice")
    formats = {Path(p).suffix.lower() for p in [*parts, output]}
    if len(formats) > 1:
        raise InputError(f"the parts and the output must all be .jsonl or all .csv (got {', '.join(sorted(formats))})")
    named = {f"part {part}": part for part in parts}
    check_distinct({"-o": output}, named, outputs=("-o", *named))
    infos = {part: _part_info(part) for part in parts}
    by_shard = _by_shard(infos)
    seen: dict[str, str] = {}
    with output_lock(output, "merge"):
        chunks = [_part_records(part, k, len(by_shard), infos[part], seen) for k, part in enumerate(by_shard)]
        whole = infos[by_shard[0]].get("of")
        if whole is not None and len(seen) != whole:
            raise InputError(f"the parts hold {len(seen)} of the job's {whole} items; run the missing shards again")
        _write_atomically(output, b"".join(chunks))
        first = next(iter(infos.values()))
        merged = {key: value for key, value in first.items() if key not in ("shard", "items", "ids", "of")}
        write_fingerprint(output, {**merged, "items": len(seen)})
    return len(seen)


def _by_shard(infos: dict[str, dict[str, Any]]) -> list[str]:
    """The parts in shard order, checked to be every shard of one job exactly once."""
    first_part, first = next(iter(infos.items()))
    n = parse_shard(first["shard"])[1]
    by_shard: dict[int, str] = {}
    for part, info in infos.items():
        k, n_part = parse_shard(info["shard"])
        if n_part != n:
            raise InputError(f"{part}: is shard {info['shard']}, but {first_part} is shard {first['shard']}")
        for field in SHARED_FIELDS:
            if info.get(field) != first.get(field):
                raise InputError(f"{part}: was written with a different {NAMES.get(field, field)} than {first_part} "
                                 f"({info.get(field)!r}, not {first.get(field)!r}); run every shard with the same options")
        if k in by_shard:
            raise InputError(f"{part} and {by_shard[k]} are both shard {k + 1}/{n}")
        by_shard[k] = part
    missing = [f"{k + 1}/{n}" for k in range(n) if k not in by_shard]
    if missing:
        raise InputError(f"shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing "
                         f"(expected {n} parts written with --shard K/{n})")
    return [by_shard[k] for k in range(n)]


def _part_records(part: str, k: int, n: int, info: dict[str, Any], seen: dict[str, str]) -> bytes:
    """The bytes of part `k`'s complete records (a CSV part after the first without its header),
    checked against what its fingerprint says it holds; `seen` collects the ids, by part."""
    done = read_records(part)
    expected = info.get("items")
    if expected is not None and len(done.records) != expected:
        raise InputError(f"{part}: has {len(done.records)} of its {expected} records; "
                         f"finish it with --resume before merging")
    expected_ids = info.get("ids")
    if expected_ids is not None and ids_digest(map(record_id, done.records)) != expected_ids:
        raise InputError(f"{part}: its records are not the items of shard {k + 1}/{n} in input order; "
                         f"it was changed after it was written: run the shard again with --overwrite")
    for record in done.records:
        rid = record_id(record)
        if rid in seen:
            raise InputError(f"item {rid!r} is in both {seen[rid]} and {part}")
        seen[rid] = part
    data = Path(part).read_bytes()[: done.end]
    if k > 0 and Path(part).suffix.lower() == ".csv":
        data = data.split(b"\n", 1)[1] if b"\n" in data else b""  # one header is enough
    return data


def _write_atomically(output: str, data: bytes) -> None:
    safefile.replace(output, data, what="the merged output")


def merge_launched(state: PartialState, output: str) -> int | None:
    """After every process has written its part: rank 0 checks and joins them into `output` and
    removes them, returning the record count; other ranks return None. A missing or incomplete
    part is an error and the parts stay, so --resume can finish them."""
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    parts = [part_path(output, k, state.num_processes) for k in range(state.num_processes)]
    count = merge_parts([p for p in parts if Path(p).exists()], output)
    for p in parts:
        Path(p).unlink(missing_ok=True)
        fingerprint_path(p).unlink(missing_ok=True)
    return count


def launch_state(cpu: bool = False) -> PartialState | None:
    """accelerate's view of a multi-process launch (`accelerate launch`, torchrun), or None when
    this is a single process. `cpu` (or no GPU) makes it a gloo process group on CPUs."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.strip().isdigit():
        raise UsageError(f"WORLD_SIZE is {world!r}, not a number of processes; unset it unless a launcher sets it")
    if int(world) <= 1:
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
            logging.getLogger("prefixcache").warning(
                "accelerate started this as a single process (with --cpu it starts several only through mpirun); "
                "for N processes on CPUs use `accelerate launch --multi_gpu --num_processes N` or torchrun")
        return None
    if not os.environ.get("MASTER_ADDR"):
        raise UsageError(f"WORLD_SIZE is {world} but no launcher started this process (MASTER_ADDR is not set); "
                         f"use accelerate launch or torchrun, or unset WORLD_SIZE to run one process")
    from accelerate import PartialState

    from ..model.load import pick_device

    try:  # a bounded wait: processes that never come would otherwise hang the run for half an hour
        state = PartialState(cpu=cpu or pick_device("auto") == "cpu", timeout=timedelta(seconds=LAUNCH_TIMEOUT))
    except (ValueError, RuntimeError, KeyError) as exc:
        raise UsageError(f"WORLD_SIZE is {world} but the processes of the launch did not all join within "
                         f"{LAUNCH_TIMEOUT} s ({first_line(exc)[:120]}); start them with accelerate launch or torchrun, "
                         f"or unset WORLD_SIZE to run one process")
    return state if state.num_processes > 1 else None
