"""Helpers shared by the checkpoint tools (convert_hf.py, convert_gguf.py, export_hf.py).

- `atomic_output_dir` (from minispec.checkpoint, which save_pretrained uses too):
  the output is built in a temporary directory beside the destination and
  renamed into place only when complete, so a failed or interrupted run never
  leaves a half-written checkpoint under DST.
- `tool_parser` and `run_tool`: the command line the tools share (SRC DST
  [--dtype] [--overwrite] [--quiet]) and its exit codes (0, 1 with one line
  `error: ...` for every user error: minispec's InputError and its subclasses, a
  destination that exists, a file that cannot be read or written).
- `ConversionError`: what the tools raise for a source they cannot convert.
- `check_output_loads`: a converted checkpoint is loaded before it is put in place,
  so a conversion never reports success for a checkpoint that does not load.
- `write_safetensors`, `TensorEntry` and `copy_files` (from minispec.safetensors_writer, which the
  library's Hugging Face export uses too): a .safetensors file written one tensor at a time, so a large
  model is never held twice, and the tokenizer files copied beside it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from minispec.checkpoint import atomic_output_dir  # noqa: F401  (re-exported for the tools)
from minispec.config import DTYPES, read_json  # noqa: F401  (read_json: re-exported for the tools)
from minispec.errors import InputError, one_line
from minispec.model import Transformer

# the safetensors writer, re-exported for the tools
from minispec.safetensors_writer import TORCH_DTYPE, TensorEntry, copy_files, write_safetensors  # noqa: F401


class ConversionError(InputError):
    """The source cannot be converted; the message says why and what to do."""


def tool_parser(description: str, src_help: str, dst_help: str, src_metavar: str | None = None,
                dst_metavar: str | None = None, dtype_default: str | None = None,
                dtype_help: str | None = None) -> argparse.ArgumentParser:
    """The tools' command line: SRC, DST, --dtype (only when `dtype_help` is given), --overwrite and --quiet."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("src", metavar=src_metavar, help=src_help)
    ap.add_argument("dst", metavar=dst_metavar, help=dst_help)
    if dtype_help is not None:
        ap.add_argument("--dtype", choices=sorted(DTYPES), default=dtype_default, help=dtype_help)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace DST if it exists (only once the new one is complete)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def run_tool(job: Callable[[], str], errors: tuple[type[Exception], ...] = ()) -> int:
    """Print the line job() returns and return 0; on a user error print one line `error: ...` to stderr, return 1.

    User errors: minispec's InputError (ConversionError, CheckpointError, ConfigError, TokenizerError, ...),
    OSError (a missing, unreadable or unwritable file, an existing destination) and `errors`. Anything
    else is a bug and keeps its traceback.
    """
    try:
        line = job()
    except (InputError, OSError, *errors) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(line)
    return 0


def check_output_loads(tmp: Path, dst: Path, src: Path, int4: bool | None = False) -> None:
    """Load the checkpoint just written to `tmp` (config, weights, tokenizer): a ConversionError if it does not.

    Called on the temporary directory before it becomes `dst`, so a conversion never reports
    success for, or leaves, a checkpoint that minispec cannot load. int4: as from_pretrained's (False: as
    stored, not the int4 form a config asks for; None: as a user loads it, e.g. a kept quantization packed).
    """
    try:
        Transformer.from_pretrained(tmp, int4=int4)
    except InputError as e:
        why = one_line(e).replace(str(tmp), str(dst))
        raise ConversionError(f"the checkpoint converted from {src} does not load ({why}), "
                              f"so {dst} was not written; the source is inconsistent: fix it or report it") from None
