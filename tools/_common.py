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
- `write_safetensors`: writes a .safetensors file one tensor at a time.
  safetensors' own `save_file` needs every tensor in memory at once; streaming
  keeps the peak at one source tensor (plus its dtype-converted copy), so a
  large model is never held twice.

The safetensors layout written here (spec: github.com/huggingface/safetensors):
an 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minispec.checkpoint import atomic_output_dir  # noqa: F401  (re-exported for the tools)
from minispec.config import read_json  # noqa: F401  (re-exported for the tools)
from minispec.errors import InputError, one_line
from minispec.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# torch dtype <-> safetensors' dtype tag
ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}


class ConversionError(InputError):
    """The source cannot be converted; the message says why and what to do."""


@dataclass
class TensorEntry:
    """One tensor to write: its output name, shape and dtype, and how to fetch its data when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]  # returns the tensor (any dtype); it is cast to `dtype` while writing


def tool_parser(description: str, src_help: str, dst_help: str, src_metavar: str | None = None,
                dst_metavar: str | None = None, dtype_default: str | None = None,
                dtype_help: str | None = None) -> argparse.ArgumentParser:
    """The tools' command line: SRC, DST, --dtype (only when `dtype_help` is given), --overwrite and --quiet."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("src", metavar=src_metavar, help=src_help)
    ap.add_argument("dst", metavar=dst_metavar, help=dst_help)
    if dtype_help is not None:
        ap.add_argument("--dtype", choices=sorted(DTYPES), default=dtype_default, help=dtype_help)
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once the new one is complete)")
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


def check_output_loads(tmp: Path, dst: Path, src: Path) -> None:
    """Load the checkpoint just written to `tmp` (config, weights, tokenizer): a ConversionError if it does not.

    Called on the temporary directory before it becomes `dst`, so a conversion never reports
    success for, or leaves, a checkpoint that minispec cannot load.
    """
    try:
        Transformer.from_pretrained(tmp, int4=False)  # loads as stored: the check, not the int4 form
    except InputError as e:
        raise ConversionError(f"the checkpoint converted from {src} does not load ({one_line(e).replace(str(tmp), str(dst))}), "
                              f"so {dst} was not written; the source is inconsistent: fix it or report it") from None


def progress(iterable, total: int, desc: str, enabled: bool):
    """A tqdm progress bar on stderr (a plain iterator when disabled or tqdm is missing)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr)


def write_safetensors(path: str | os.PathLike, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
                      show_progress: bool = False, desc: str = "writing") -> None:
    """Write `entries` to a safetensors file, loading and writing one tensor at a time."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        if e.dtype not in ST_DTYPE:
            raise ValueError(f"tensor {e.name!r}: dtype {e.dtype} cannot be written to safetensors by this tool")
        nbytes = torch.Size(e.shape).numel() * torch.empty((), dtype=e.dtype).element_size()
        header[e.name] = {"dtype": ST_DTYPE[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in progress(entries, len(entries), desc, show_progress):
            t = e.load()
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"tensor {e.name!r}: its data has shape {tuple(t.shape)}, its header says {tuple(e.shape)}")
            t = t.detach().to("cpu", dtype=e.dtype).contiguous()
            if t.numel():
                # a uint8 view is dtype-agnostic (bf16 has no numpy type); x86/ARM are little-endian like the format
                f.write(t.reshape(-1).view(torch.uint8).numpy())  # buffer protocol: no extra copy
            del t


def copy_files(src: Path, dst: Path, names) -> list[str]:
    """Copy the files in `names` that exist in `src` to `dst`; return the names copied."""
    copied = []
    for n in names:
        if (src / n).is_file():
            shutil.copyfile(src / n, dst / n)
            copied.append(n)
    return copied
