"""The CMAKE_ARGS that build llama.cpp (the llama extra, llama-cpp-python) for the CPU it runs on.

llama-cpp-python compiles llama.cpp when it is installed. Its portable x86-64 build (AVX2) ran
1.3-1.6x slower than one built for an AVX-512 CPU on the same file. `GGML_NATIVE` (-march=native)
builds for the CPU, but on a CPU that has AMX it also compiles llama.cpp's AMX kernels, which
crashed where they were tried; so each x86 extension this CPU has is turned on by name instead,
and AMX is left off. Elsewhere (ARM) the native build is used as it is.

A library built this way runs on CPUs with the same extensions only: build it on the machine
that runs it (a copied virtual environment may stop with "illegal instruction" elsewhere).

Usage (pip keeps a wheel it built and reuses it whatever CMAKE_ARGS say: hence --no-cache-dir):

    CMAKE_ARGS="$(python -m prefixcache.model.llamabuild)" \\
        pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python
"""

from __future__ import annotations

import platform

from .. import compat

# GGML's option, and the /proc/cpuinfo flags it needs, in the order GGML's CMake reads them
X86_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # their kernels crashed: left off
PORTABLE = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"  # any x86-64 CPU with AVX2


def cmake_args(flags: set[str] | None = None, machine: str | None = None) -> str:
    """The CMAKE_ARGS for a CPU with `flags` (its /proc/cpuinfo words; default: this one's) of
    architecture `machine` (default: this one's)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return "-DGGML_NATIVE=ON"
    flags = compat.cpu_flags() if flags is None else flags
    if not flags:  # nothing can be told: the portable build
        return PORTABLE
    words = ["-DGGML_NATIVE=OFF"]
    words += [f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}" for option, needs in X86_OPTIONS]
    words += [f"-D{option}=OFF" for option in NEVER]
    return " ".join(words)


if __name__ == "__main__":
    print(cmake_args())
