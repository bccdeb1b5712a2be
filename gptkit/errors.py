"""Errors a user can cause: GptkitError and its subclasses (ConfigError for a bad config value;
training's NonFiniteLossError). And Interrupted: a Ctrl-C with the line that says what was kept.

A `GptkitError` message says what was wrong and what to do about it, on one line. The CLI prints
it without a traceback and exits with status 2 (set GPTKIT_DEBUG=1 to see the traceback).
"""


class GptkitError(Exception):
    """A user-caused error: a bad config, path, data file, checkpoint or prompt."""


class ConfigError(GptkitError):
    """An invalid configuration value or combination."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with one line that says what was kept and how to continue (prepare: the complete shards). The
    CLI prints that line instead of its plain "interrupted" and exits with 130."""
