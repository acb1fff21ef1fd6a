"""Writing a checkpoint directory piece by piece: a safetensors file one tensor at a time, the tokenizer files copied.

`write_safetensors` streams: safetensors' own `save_file` needs every tensor in memory at once, while
here each tensor is fetched only when its turn comes, so the peak is one source tensor (plus its
dtype-converted copy) and a large model is never held twice. The Hugging Face export
(minispec.hf_export) and the converters in tools/ write their weights with it.

The layout (spec: github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded
with spaces to a multiple of 8, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# torch dtype <-> safetensors' dtype tag
ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}


@dataclass
class TensorEntry:
    """One tensor to write: its output name, shape and dtype, and how to fetch its data when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]  # returns the tensor (any dtype); it is cast to `dtype` while writing


def progress(iterable, total: int, desc: str, enabled: bool):
    """A tqdm progress bar on stderr (a plain iterator when disabled or tqdm is missing)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr)


def _header(entries: list[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    """The JSON header with every tensor's dtype, shape and byte range, padded to a multiple of 8 bytes."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        if e.dtype not in ST_DTYPE:
            raise ValueError(f"tensor {e.name!r}: dtype {e.dtype} cannot be written to safetensors by this tool")
        nbytes = torch.Size(e.shape).numel() * torch.empty((), dtype=e.dtype).element_size()
        header[e.name] = {"dtype": ST_DTYPE[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it


def write_safetensors(path: str | os.PathLike, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
                      show_progress: bool = False, desc: str = "writing") -> None:
    """Write `entries` to a safetensors file, loading and writing one tensor at a time."""
    raw = _header(entries, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in progress(entries, len(entries), desc, show_progress):
            t = e.load()
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"tensor {e.name!r}: its data has shape {tuple(t.shape)}, "
                                 f"its header says {tuple(e.shape)}")
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
