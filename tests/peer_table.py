"""The precision and engine table of docs/performance.md, measured again on this machine.

Runs `prefixcache run` once per way of running a GGUF file (transformers in float32, what a run
with no option picks, bfloat16, bfloat16 with --exact, int8; the llama.cpp engine, with each
llama.cpp build given) on the same
items, each in a process of its own after an untimed warm-up run (conversions, prefixes and --exact
bounds kept in the cache), and `prefixcache bench --backend llama.cpp` for llama.cpp's own
first-token path. Prints a Markdown table: ms an item as `run` measures it (scoring only, wall),
the process's peak resident memory, and how many labels equal the float32 run's.

    python tests/peer_table.py configs/support-tickets.yaml data/samples/tickets.jsonl MODEL.gguf \\
        --llama portable=/path/to/site-packages-of-one-build --llama tuned=/path/to/another

A `--llama NAME=DIR` puts DIR first on PYTHONPATH, so that `llama_cpp` is imported from there
(`pip install --no-deps --target DIR llama-cpp-python` with the CMAKE_ARGS of that build);
without any, the installed build runs as "installed". Nothing here is shipped with the package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PATHS = (("transformers, float32", ["--dtype", "float32"]),
         ("the default (no option)", []),
         ("transformers, bfloat16", ["--dtype", "bfloat16"]),
         ("transformers, bfloat16 --exact", ["--dtype", "bfloat16", "--exact"]),
         ("transformers, int8", ["--dtype", "int8"]))


def run_once(args: list[str], env: dict[str, str]) -> tuple[int, str, float, float]:
    """A command's exit status, its stderr, its peak resident memory in MB and the CPU seconds
    it took (user and system)."""
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        err.seek(0)
        return (os.waitstatus_to_exitcode(status), err.read().decode(errors="replace"), usage.ru_maxrss / 1024,
                usage.ru_utime + usage.ru_stime)


SHORT = 4  # items of the short run whose CPU time is taken from the whole run's


def measure(spec: str, items: str, model: str, extra: list[str], env: dict[str, str], out: Path) -> dict:
    """`run`'s own ms/item (wall, scoring), the marginal CPU ms an item (the whole run's CPU time
    less a run of SHORT items', over the other items: loading and the prefix cancel out), peak
    resident memory and the labels."""
    base = [sys.executable, "-m", "prefixcache", "run", spec, items, "-m", model, *extra]
    run_once([*base, "--limit", str(SHORT), "-o", str(out.with_suffix(".warm.jsonl"))], env)  # conversions, bounds
    _, _, _, short_cpu = run_once([*base, "--limit", str(SHORT), "-o", str(out.with_suffix(".short.jsonl"))], env)
    code, err, peak, cpu = run_once([*base, "-o", str(out)], env)
    if code not in (0, 5):
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {code}"}
    found = re.search(r"([0-9.]+) ms/item", err)
    labels = [json.loads(line).get("label") for line in out.read_text().splitlines()]
    marginal = (cpu - short_cpu) * 1000 / (len(labels) - SHORT) if len(labels) > SHORT else None
    return {"ms": float(found.group(1)) if found else None, "cpu_ms": marginal, "peak_mb": peak, "labels": labels}


def llama_floor(spec: str, items: str, model: str, env: dict[str, str], limit: int) -> dict:
    """llama.cpp's own first-token path and the batched floor, from `bench --backend llama.cpp`."""
    done = subprocess.run([sys.executable, "-m", "prefixcache", "bench", spec, items, "-m", model, "--backend",
                           "llama.cpp", "--limit", str(limit), "--json"], capture_output=True, text=True, env=env)
    if done.returncode:
        return {}
    report = json.loads(done.stdout)
    pipeline = report["modes"][-1]["ms_per_item"]
    first = report.get("first_token") or {}
    return {"first_token_ms": first.get("ms_per_item"), "batched_floor_ms": pipeline / report["option_cost_ratio"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("items")
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--llama", action="append", default=[], metavar="NAME=DIR",
                        help="a llama.cpp build: its llama_cpp package's folder (repeatable)")
    parser.add_argument("--bench-limit", type=int, default=8, help="items bench times llama.cpp's own path on")
    parser.add_argument("--cache-dir", default=None, help="PREFIXCACHE_CACHE_DIR for every run (default: a new one)")
    o = parser.parse_args()
    cache = o.cache_dir or tempfile.mkdtemp(prefix="peer-table-")
    work = Path(tempfile.mkdtemp(prefix="peer-runs-"))
    env = {**os.environ, "PREFIXCACHE_CACHE_DIR": cache}
    rows = [(name, measure(o.spec, o.items, o.model, extra, env, work / f"{n}.jsonl"))
            for n, (name, extra) in enumerate(PATHS)]
    builds = [b.split("=", 1) for b in o.llama] or [("installed", "")]
    floors = []
    for name, folder in builds:
        build_env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (folder, env.get("PYTHONPATH", "")) if p)}
        rows.append((f"llama.cpp engine ({name} build)",
                     measure(o.spec, o.items, o.model, ["--backend", "llama.cpp"], build_env, work / f"ll-{name}.jsonl")))
        floors.append((name, llama_floor(o.spec, o.items, o.model, build_env, o.bench_limit)))
    want = rows[0][1].get("labels") or []
    print("| path | ms/item (wall) | CPU ms/item | peak RSS | labels = float32's |")
    print("|---|---|---|---|---|")
    for name, got in rows:
        if "error" in got:
            print(f"| {name} | {got['error'][:80]} | | | |")
            continue
        same = sum(a == b for a, b in zip(got["labels"], want, strict=True))
        cpu = f"{got['cpu_ms']:.1f}" if got["cpu_ms"] is not None else "-"
        print(f"| {name} | {got['ms']:.1f} | {cpu} | {got['peak_mb']:,.0f} MB | {same}/{len(want)} |")
    for name, floor in floors:
        if floor:
            print(f"| llama.cpp's own first token, one prompt at a time ({name} build, {o.bench_limit} items) | "
                  f"{floor['first_token_ms']:.1f} | | | |")
            print(f"| llama.cpp batched first-token floor ({name} build) | {floor['batched_floor_ms']:.1f} | | | |")


if __name__ == "__main__":
    main()
