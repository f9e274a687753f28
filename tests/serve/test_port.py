"""A second server on a port in use stops in one line, before any model loads."""

from __future__ import annotations

import socket

from helpers import invoke


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        result = invoke("serve", "--port", port, "-m", tmp_path / "no-such-model")  # never loaded: that would say so
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
