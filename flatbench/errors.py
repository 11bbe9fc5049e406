"""User-facing errors.

A `FlatbenchError` is a problem the user can fix (a bad config key, a missing dataset, a corrupt
checkpoint). The CLI prints its message as one line on stderr and exits with code 2; anything else is a
bug and keeps its traceback.
"""


class FlatbenchError(Exception):
    """An error caused by the user's input, reported as one clear line (exit code 2)."""


class ConfigError(FlatbenchError):
    """The config file or an override is invalid."""


class DataError(FlatbenchError):
    """A dataset cannot be found, downloaded or read."""


class CheckpointError(FlatbenchError):
    """A saved model or checkpoint cannot be read."""
