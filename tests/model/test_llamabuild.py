"""The CMAKE_ARGS that build llama.cpp for the CPU it runs on: each extension it has by name, AMX never."""

from __future__ import annotations

import subprocess
import sys

from prefixcache.model.llamabuild import cmake_args

SAPPHIRE_RAPIDS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512cd", "avx512vl",
                   "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                   "amx_bf16"}


def _options(args: str) -> dict[str, str]:
    return dict(word.removeprefix("-D").split("=") for word in args.split())


def test_an_avx512_cpu_with_amx_gets_avx512_and_never_amx():
    got = _options(cmake_args(SAPPHIRE_RAPIDS, "x86_64"))
    assert got["GGML_NATIVE"] == "OFF"
    assert {got[o] for o in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI")} == {"ON"}
    assert {got[o] for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"OFF"}


def test_an_avx2_cpu_gets_avx2_alone_and_avx512_needs_every_part():
    avx2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    got = _options(cmake_args(avx2, "x86_64"))
    assert got["GGML_AVX2"] == got["GGML_FMA"] == "ON" and got["GGML_AVX512"] == got["GGML_AVX_VNNI"] == "OFF"
    assert _options(cmake_args(avx2 | {"avx512f", "avx512bw"}, "x86_64"))["GGML_AVX512"] == "OFF"  # no vl, dq, cd


def test_elsewhere_the_native_build_and_without_flags_the_portable_one():
    assert cmake_args(set(), "aarch64") == "-DGGML_NATIVE=ON"
    assert _options(cmake_args(set(), "x86_64"))["GGML_AVX2"] == "ON"  # /proc/cpuinfo unreadable


def test_it_runs_as_a_module_before_anything_heavy_is_installed():
    done = subprocess.run([sys.executable, "-c", "import sys; import prefixcache.model.llamabuild as b; "
                           "print(b.cmake_args()); print('torch' in sys.modules)"], capture_output=True, text=True,
                          check=True)
    args, torch_loaded = done.stdout.split("\n")[:2]
    assert args.startswith("-DGGML_NATIVE=") and torch_loaded == "False"
