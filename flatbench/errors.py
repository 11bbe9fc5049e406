"""User-facing errors.

A `FlatbenchError` is a problem the user can fix (a bad config key, a missing dataset, a corrupt
checkpoint). The CLI prints its message as one line on stderr and exits with code 2; anything else is a
bug and keeps its traceback. `Echo` is how the stages print their progress lines (the CLI's echo to stdout,
a worker's list of lines, or nothing in tests).
"""

import difflib
import warnings
from typing import Any, Callable

Echo = Callable[[str], None]
"""Where a stage's progress and outcome lines go."""


def silence_library_noise() -> None:
    """Hide warnings our users can do nothing about: torch's own vmap decompositions call the deprecated
    torch.jit.script. Installed by the CLI and by every worker process it spawns."""
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*is deprecated", category=FutureWarning)


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or '' when none is close: the one suggestion
    rule of every unknown-name error (config keys, measure names, datasets, models)."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def one_line(text: str) -> str:
    """`text` as one printable line: newlines and other control characters escaped (an error message may
    quote a file name, a key or a value given by the user)."""
    return "".join(c if c >= " " or c == "\t" else repr(c)[1:-1] for c in str(text))


def printable(text: str) -> str:
    """`text` with its lines kept and every other control character escaped (a plugin's description or a
    setting's help holding terminal escape sequences is shown, never obeyed by the terminal)."""
    return "\n".join(one_line(line) for line in str(text).split("\n"))


class FlatbenchError(Exception):
    """An error caused by the user's input, reported as one clear line (exit code 2)."""


class ConfigError(FlatbenchError):
    """The config file or an override is invalid."""


class DataError(FlatbenchError):
    """A dataset cannot be found, downloaded or read."""


class CheckpointError(FlatbenchError):
    """A saved model or checkpoint cannot be read."""
