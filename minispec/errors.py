"""The one base class of the errors minispec raises for input it refuses.

minispec reads files that come from strangers (checkpoints, GGUF files, tokenizers, chat
templates) and settings that come from users. Everything it refuses raises an `InputError`:
a ValueError whose one-line message names the file, field, tensor, setting or argument and
says what to do. Each area has its own subclass (ConfigError, CheckpointError,
TokenizerError, SamplingError, the converters' ConversionError), so a caller can catch one
area or all of them; an exception of any other type escaping a loader is a bug in minispec.
"""

from __future__ import annotations


class InputError(ValueError):
    """A file, field, tensor, setting or argument that minispec refuses; the message says which and what to do."""


def show(value, limit: int = 60) -> str:
    """A short repr of `value` for an error message (a 10 MB string or a 4000-digit number stays one short line)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str() (Python's 4300-digit limit)
        text = f"<int of about {value.bit_length() * 3 // 10} digits>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(e: BaseException) -> str:
    """An error's message on one line, as the command line prints it (some libraries' messages span several)."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def is_int(v) -> bool:
    """A true integer: not a bool (True is 1 in Python), not a float, not a string."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v, lo: int, hi: int | None = None) -> int:
    """`v` if it is an integer (not a bool) in [lo, hi]; else an InputError (a ValueError) naming `name`."""
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise InputError(f"{name} must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {v!r}")
    return v
