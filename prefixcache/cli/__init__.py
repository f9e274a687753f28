"""The command line: the `prefixcache` commands, their options, and what the terminal shows.

Owns: the commands (app.py; `cache list|clear` in cache.py), parsing options (options.py builds
them from the run's option table), turning the library's typed errors into one `error:` line and
an exit code (terminal.py), the progress bar and log lines on stderr, and the Rich tables printed
after a command (show.py). Data goes to stdout,
everything else to stderr.

May import every other layer; nothing imports it.
"""

from .app import app, main

__all__ = ["app", "main"]
