"""`prefixcache cache list|clear`: the stored prefixes and converted models."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..model.load import converted_models
from .options import CLEAR_MODELS_OPT, DEBUG_OPT, JSON_LINES_OPT, run_options
from .show import print_cache
from .terminal import Command, Commands, err, errors


cache_app = typer.Typer(cls=Commands, help="Inspect or clear the prefix store and converted models.", no_args_is_help=True)


@cache_app.command("list", cls=Command)
@run_options("cache_dir")
def cache_list(as_json: bool = JSON_LINES_OPT, debug: bool = DEBUG_OPT, *, cache_dir: Path) -> None:
    """List the stored prefixes (fingerprint, model, prefix tokens, size, last used) and converted models.

    Example:

        prefixcache cache list
    """
    from ..model.store import PrefixStore, describe  # torch: only for this command

    with errors(debug):
        root = cache_dir
        store = PrefixStore(root / "prefixes")
        prefixes = [describe(e) for e in sorted(store.entries(), key=lambda e: -e.last_used)]
        models = converted_models(root)
        if as_json:
            for row in prefixes:
                print(json.dumps({"kind": "prefix", **row}))
            for row in models:
                print(json.dumps({"kind": "model", **row}))
        else:
            print_cache(store.root, prefixes, models)


@cache_app.command("clear", cls=Command)
@run_options("cache_dir")
def cache_clear(models: bool = CLEAR_MODELS_OPT, debug: bool = DEBUG_OPT, *, cache_dir: Path) -> None:
    """Delete every stored prefix (and with --models the converted models).

    Example:

        prefixcache cache clear --models
    """
    from ..model.store import clear_cache  # torch: only for this command

    with errors(debug):
        removed, models_removed = clear_cache(cache_dir, models)
        err.print(f"removed {removed} stored prefixes" + (" and the converted models" if models_removed else ""),
                  markup=False)
