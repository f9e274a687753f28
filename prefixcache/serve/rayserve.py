"""Ray Serve: the decisions server as N replicas behind Ray Serve's HTTP proxy.

    serve run prefixcache.serve.rayserve:app num_replicas=2 model=./model.gguf

or from Python:

    from ray import serve
    from prefixcache.serve.rayserve import deployment

    serve.run(deployment(num_replicas=2), route_prefix="/")

Each replica is what `prefixcache serve` runs: one `Decider` whose model works in one worker thread
(the requests that reach a replica together share a forward pass) and the same app (routes,
bodies, auth, errors, access log). Ray Serve spreads requests over the replicas and drains them
on shutdown. Needs Ray Serve (pip install 'prefixcache[rayserve]'); importing this module imports
Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ray import serve

from ..errors import UsageError
from ..scoring.options import ScoringOptions
from . import api_key
from ..task.head import load_head
from .app import served_app
from .defaults import BATCH_WAIT_MS, MAX_BATCH, Limits

OPTIONS = ("model", "num_replicas", "api_key_env", "batch_wait_ms", "max_batch", "device", "dtype", "heads")


@serve.deployment(name="prefixcache-decisions", max_ongoing_requests=64, graceful_shutdown_timeout_s=60)
@serve.ingress()
class Decisions:
    """One replica: `prefixcache serve`'s app over its own model, built once the replica starts.
    The API key is read from the replica's environment, never passed through Ray's own state."""

    def __init__(self, model: Optional[str] = None, api_key_env: Optional[str] = None, batch_wait_ms: float = BATCH_WAIT_MS,
                 max_batch: int = MAX_BATCH, device: str = "auto", dtype: str = "auto", heads: Sequence[str] = ()):
        key = None if api_key_env is None else api_key(api_key_env, f"api_key_env {api_key_env} (where the replica runs)")
        options = ScoringOptions.from_environment(device=device, dtype=dtype)
        found = [load_head(h, Path("heads")) for h in heads]  # read where the replica runs
        # not `self.app`: Ray's ingress wrapper has a read-only `app` of its own
        # behind Ray Serve's proxy: the Host is the cluster's, whatever it is (Origins are still checked)
        self._served, self.batcher = served_app(model, options, key, batch_wait_ms, max_batch, found,
                                                limits=Limits(hosts=("*",)))

    def __serve_build_asgi_app__(self) -> Any:
        return self._served

    def __del__(self) -> None:  # Ray Serve's shutdown: the asks queued are answered first
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close()


def deployment(model: Optional[str] = None, *, num_replicas: int = 1, api_key_env: Optional[str] = None,
               batch_wait_ms: float = BATCH_WAIT_MS, max_batch: int = MAX_BATCH, device: str = "auto", dtype: str = "auto",
               ray_actor_options: Optional[dict] = None, heads: Sequence[str] = ()) -> Any:
    """The application to `serve.run`: `num_replicas` replicas of the server over `model` (None:
    the embedded default), each with the options `prefixcache serve` takes; `ray_actor_options`
    (for example `{"num_gpus": 1}`) what each replica reserves (Ray Serve's default: one CPU);
    `heads`: paths of head files (prefixcache fit), read where each replica runs."""
    if num_replicas < 1 or max_batch < 1 or batch_wait_ms < 0:
        raise UsageError("num_replicas and max_batch must be 1 or more, batch_wait_ms 0 or more")
    deployment: Any = Decisions  # serve.deployment made the class a Deployment
    placed = deployment.options(num_replicas=num_replicas, **({"ray_actor_options": ray_actor_options}
                                                              if ray_actor_options else {}))
    return placed.bind(model, api_key_env, batch_wait_ms, max_batch, device, dtype, tuple(str(h) for h in heads))


def app(args: Mapping[str, str]) -> Any:
    """The application builder `serve run prefixcache.serve.rayserve:app key=value ...` calls,
    with the keys of `deployment` as text (`heads`: head files separated by commas)."""
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r}; known: {', '.join(OPTIONS)}")
    try:
        return deployment(args.get("model") or None, num_replicas=int(args.get("num_replicas", 1)),
                          api_key_env=args.get("api_key_env"), batch_wait_ms=float(args.get("batch_wait_ms", BATCH_WAIT_MS)),
                          max_batch=int(args.get("max_batch", MAX_BATCH)), device=args.get("device", "auto"),
                          dtype=args.get("dtype", "auto"),
                          heads=[h for h in args.get("heads", "").split(",") if h.strip()])
    except ValueError as exc:
        raise UsageError(f"num_replicas, max_batch and batch_wait_ms are numbers: {exc}") from exc
