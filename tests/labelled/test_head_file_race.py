"""A head file is checked and read through one open file: while another process exchanges it, in
a loop, with a head anyone may write, every load gives the checked head or refuses; never the
other one (the check and the read used to be two lookups of the path)."""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import sys
import time

import numpy as np
import pytest

from prefixcache.errors import SpecError
from prefixcache.task.head import Readout, head_bytes, load_head

RENAME_EXCHANGE = 2
FP = {"model": "m" * 32, "prefix": "p" * 32, "template": "t" * 32, "questions": "q" * 32}


def _head(order):
    coef = np.eye(3, 4)[order]
    return head_bytes([Readout("label", ("a", "b", "c"), False, "state", np.zeros((1, 4)), np.ones((1, 4)), coef,
                               np.zeros(3))], FP, "final", {})


def _exchange(folder: str, started, stop, seconds: float) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(folder, os.O_RDONLY)
    end = time.monotonic() + seconds
    started.set()
    while not stop.is_set() and time.monotonic() < end:  # bounded in time, whatever the test does
        libc.renameat2(fd, b"head.safetensors", fd, b"other.safetensors", RENAME_EXCHANGE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_a_head_exchanged_while_it_is_loaded_is_never_the_other(tmp_path):
    good, evil = _head([0, 1, 2]), _head([2, 1, 0])
    (tmp_path / "head.safetensors").write_bytes(good)
    os.chmod(tmp_path / "head.safetensors", 0o644)
    (tmp_path / "other.safetensors").write_bytes(evil)
    os.chmod(tmp_path / "other.safetensors", 0o666)  # anyone may write it: never to be read as a head
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("this C library has no renameat2")
    context = multiprocessing.get_context("spawn")
    started, stop = context.Event(), context.Event()
    swapper = context.Process(target=_exchange, args=(str(tmp_path), started, stop, 600.0))
    swapper.start()
    try:
        assert started.wait(300), "the exchanging process did not start"
        seen = {"good": 0, "refused": 0, "evil": 0}
        want, end = hashlib.sha256(good).hexdigest(), time.monotonic() + 300
        for _ in range(200_000):  # bounded in count and in time; done once the exchange raced the loads both ways
            if time.monotonic() > end or (seen["good"] >= 20 and seen["refused"] >= 20):
                break
            try:
                head = load_head(str(tmp_path / "head.safetensors"), tmp_path / "spec.yaml")
                seen["good" if head.digest == want else "evil"] += 1
            except SpecError:
                seen["refused"] += 1
    finally:
        stop.set()
        swapper.join(60)
        if swapper.is_alive():
            swapper.kill()
            swapper.join()
    assert seen["evil"] == 0, seen
    assert seen["good"] > 0 and seen["refused"] > 0, seen  # the exchange did race the loads
