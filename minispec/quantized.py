"""A GGUF file's quantized weights kept as shipped: the kept forms' tensors, their checks, and their values.

`tools/convert_gguf.py --keep-quant` stores each quantized matrix of a GGUF as one or a few tensors
under the matrix's own name (NAME = e.g. `layers.0.mlp.up_proj.weight`):

- **the file's blocks** (`q4_k`, `q6_k`, `q5_0`, `q8_0`: `BLOCK_FORMS`): `NAME.q4_k` (etc.) uint8 (N, bytes
  a row), the GGUF's own blocks, byte for byte. What --keep-quant writes for those four types
  (`decode_blocks` reads their values as ggml does).

Files written before kept the two forms below, which still load:

- **int4 groups** (`q4`): `NAME.q4` uint8 (N, K/2), two 4-bit values q a byte (input 2i in the low
  nibble, 2i+1 in the high), `NAME.q4_scale` and `NAME.q4_min` float32 (N, K/32): the weight is
  `scale * q - min` over each group of 32 inputs. This is Q4_K exactly: its super-blocks of 256 hold 8
  sub-blocks of 32, each with a 6-bit scale and min times the block's fp16 d and dmin, products float32
  holds without rounding.
- **int8 rows** (`q8`): `NAME.q8` int8 (N, K), `NAME.q8_scale` float32 (N,): the weight is `scale * q`,
  the scale a bf16 value, |error| <= scale / 2 a row (docs/design.md, "Quantized targets").

This module reads: which tensors a form has (`STORED_PARTS`), a file's kept matrices checked before anything is
built (`split_kept`), their tensors read one at a time (`FileReader`, `read_parts`: a non-finite scale or min is
refused when read, naming the tensor) and their values (`dequantize`). minispec.forms makes them into the
products a model computes (`forms.install`).
"""

from __future__ import annotations

import json
import struct

import torch

from . import ggml
from .errors import InputError

GROUP = 32  # inputs per int4 group (Q4_K's sub-block)


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) uint8 -> (..., K) uint8 values 0..15, input 2i from the low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """(..., K) values 0..15 -> (..., K/2) uint8, the inverse of unpack_q4."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


# form -> its tensors: (suffix, safetensors dtype, shape from the matrix's (N, K))
STORED_PARTS = {
    "q4": (("q4", "U8", lambda n, k: (n, k // 2)), ("q4_scale", "F32", lambda n, k: (n, k // GROUP)),
           ("q4_min", "F32", lambda n, k: (n, k // GROUP))),
    "q8": (("q8", "I8", lambda n, k: (n, k)), ("q8_scale", "F32", lambda n, k: (n,))),
}
# a GGUF's own blocks, one uint8 row of blocks per output, under the type's name (NAME.q4_k, ...): what
# --keep-quant writes for the types this module can also decode without the compiled product
BLOCK_FORMS = ("q4_k", "q6_k", "q5_0", "q8_0")
STORED_PARTS.update({kind: ((kind, "U8", lambda n, k, kind=kind: (n, ggml.row_bytes(kind, k))),)
                     for kind in BLOCK_FORMS})
_SUFFIX = {suffix: form for form, parts in STORED_PARTS.items() for suffix, _, _ in parts}


class QuantizedCheckpointError(InputError):
    """A checkpoint's kept-quantization tensors are incomplete or of the wrong size, type or shape."""


def matrix_shape(form: str, parts: dict[str, tuple[int, ...]], name: str, source: str) -> tuple[int, int]:
    """The (N, K) matrix a kept form's tensor shapes describe; every part checked against it."""
    first = parts[STORED_PARTS[form][0][0]]
    if len(first) != 2 or first[0] < 1 or first[1] < 1:
        raise QuantizedCheckpointError(f"{source}: {name}.{STORED_PARTS[form][0][0]} has shape {first}; a kept matrix "
                                       "is 2-D and non-empty")
    n, k = first[0], first[1] * (2 if form == "q4" else 1)
    if form in BLOCK_FORMS:
        _, values, size = ggml.TYPES[form]
        if first[1] % size:
            raise QuantizedCheckpointError(f"{source}: {name}.{form} has rows of {first[1]} bytes, not whole "
                                           f"{form} blocks of {size}")
        k = first[1] // size * values
    if form == "q4" and k % GROUP:
        raise QuantizedCheckpointError(f"{source}: {name}.q4 holds {k} inputs a row, not a multiple of {GROUP}")
    for suffix, _, shape in STORED_PARTS[form]:
        if parts[suffix] != shape(n, k):
            raise QuantizedCheckpointError(f"{source}: {name}.{suffix} has shape {parts[suffix]}, expected "
                                           f"{shape(n, k)} for a {n} x {k} matrix")
    return n, k


def split_kept(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], source: str
               ) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A file's tensors as the model's: (every name -> shape, a kept matrix under its own name with its
    (N, K)), and kept matrix name -> form. Incomplete sets, wrong dtypes and inconsistent shapes are
    refused, before anything is read or built."""
    plain, groups = {}, {}
    for name, shape in shapes.items():
        base, _, suffix = name.rpartition(".")
        if suffix in _SUFFIX and base.endswith(".weight"):
            groups.setdefault(base, {})[suffix] = shape
        else:
            plain[name] = shape
    kept = {}
    for base, parts in groups.items():
        form = _SUFFIX[next(iter(parts))]
        want = {suffix for suffix, _, _ in STORED_PARTS[form]}
        if set(parts) != want:
            raise QuantizedCheckpointError(f"{source}: {base} has tensors {sorted(parts)}, expected the {form} form's "
                                           f"{sorted(want)}")
        for suffix, dtype, _ in STORED_PARTS[form]:
            if dtypes[f"{base}.{suffix}"] != dtype:
                raise QuantizedCheckpointError(f"{source}: {base}.{suffix} has dtype {dtypes[f'{base}.{suffix}']}, "
                                               f"expected {dtype}")
        if base in plain:
            raise QuantizedCheckpointError(f"{source}: {base} is stored both as floats and in the {form} form")
        plain[base] = matrix_shape(form, parts, base, source)
        kept[base] = form
    return plain, kept


Q4_K_BLOCK = ggml.TYPES["q4_k"][2]  # a super-block's 144 bytes: fp16 d and dmin, 12 of 6-bit scales and mins, 128 of q
Q4_K_VALUES = 256  # weights a super-block holds


def q4_k_groups(raw: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """An (n, k) matrix's Q4_K blocks (uint8, row-major, k / 256 blocks a row) as the q4 form, exactly: the
    weight of input i in sub-block j of a block is d * scale_j * q_i - dmin * min_j (ggml's dequantize_row_q4_K)."""
    if n < 1 or k < 1 or k % Q4_K_VALUES:
        raise ValueError(f"a Q4_K matrix has rows of a multiple of {Q4_K_VALUES} values, not {n} x {k}")
    blocks = n * k // Q4_K_VALUES
    if raw.dtype != torch.uint8 or raw.numel() != blocks * Q4_K_BLOCK:
        raise ValueError(f"a {n} x {k} Q4_K matrix is {blocks * Q4_K_BLOCK} bytes, got {raw.numel()} "
                         f"{raw.dtype} values")
    b = raw.reshape(blocks, Q4_K_BLOCK)
    d, dmin = b[:, 0:4].contiguous().view(torch.float16).float().unbind(-1)
    s = b[:, 4:16].int()
    # 8 six-bit scales and mins: the first four in the low bits of bytes 0-3 and 4-7, the last four split
    # between the nibbles of bytes 8-11 and the top two bits of bytes 0-3 (scales) and 4-7 (mins)
    scales = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    mins = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    qs = b[:, 16:].reshape(blocks, 4, 1, 32)  # 4 chunks of 64 values: sub-block 2c low nibbles, 2c+1 high
    q = torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, k)
    return {"q4": pack_q4(q), "q4_scale": (d[:, None] * scales).reshape(n, k // GROUP),
            "q4_min": (dmin[:, None] * mins).reshape(n, k // GROUP)}


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian fp16 values -> (...) float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


# where each block type keeps its fp16 scales (d, and Q4_K's dmin): the bytes a non-finite check reads
SCALE_BYTES = {"q4_k": ((0, 4),), "q6_k": ((208, 210),), "q5_0": ((0, 2),), "q8_0": ((0, 2),)}


def block_scales(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Every fp16 scale of a (..., row bytes) uint8 tensor of `kind` blocks, as float32 (flat)."""
    b = blocks.reshape(-1, ggml.TYPES[kind][2])
    return torch.cat([_fp16(b[:, i:j].reshape(-1, 2)).reshape(-1) for i, j in SCALE_BYTES[kind]])


def decode_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """(..., row bytes) uint8 GGUF blocks of `kind` -> (..., K) float32, the values ggml's dequantize_row_*
    gives (computed in its order, so bit for bit; tested against gguf's)."""
    _, values, size = ggml.TYPES[kind]
    lead, k = blocks.shape[:-1], blocks.shape[-1] // size * values
    b = blocks.reshape(-1, size)
    if kind == "q4_k":
        return dequantize("q4", q4_k_groups(b.reshape(-1), b.shape[0] * size // blocks.shape[-1], k)).reshape(
            *lead, k)
    if kind == "q8_0":  # fp16 d, 32 int8 q: d * q
        q = b[:, 2:].view(torch.int8).float()
        out = q * _fp16(b[:, 0:2])[:, None]
    elif kind == "q5_0":  # fp16 d, 32 high bits, 16 bytes of low nibbles: (q - 16) * d
        qh = b[:, 2:6].long()
        qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
        bits = (qh[:, None] >> torch.arange(32)) & 1
        qs = b[:, 6:].long()
        q = torch.cat((qs & 15, qs >> 4), dim=1) | (bits << 4)
        out = (q - 16).float() * _fp16(b[:, 0:2])[:, None]
    else:  # q6_k: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d; (d * scale) * (q - 32)
        ql, qh = b[:, :128].long().view(-1, 2, 64), b[:, 128:192].long().view(-1, 2, 1, 32)
        lo, hi = ql[..., None, :32], ql[..., None, 32:]
        q = torch.cat((lo & 15, hi & 15, lo >> 4, hi >> 4), dim=2) | (((qh >> torch.tensor([0, 2, 4, 6])[:, None]) & 3)
                                                                      << 4)
        scale = b[:, 192:208].view(torch.int8).float().view(-1, 2, 4, 2).repeat_interleave(16, dim=-1)
        out = (_fp16(b[:, 208:210])[:, None, None, None] * scale) * (q - 32).float()
    return out.reshape(*lead, k)


def dequantize(form: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A kept matrix's (or some of its rows') float32 values, as stored: scale * q - min, or scale * q, or the
    GGUF blocks' own values."""
    if form in BLOCK_FORMS:
        return decode_blocks(form, parts[form])
    if form == "q4":
        q = unpack_q4(parts["q4"]).float()
        g = q.view(*q.shape[:-1], -1, GROUP)
        return (g * parts["q4_scale"].float()[..., None] - parts["q4_min"].float()[..., None]).flatten(-2)
    return parts["q8"].float() * parts["q8_scale"].float()[..., None]


_ST_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "F32": torch.float32}


class FileReader:
    """Reads a safetensors file's tensors one at a time with plain file reads into fresh, aligned tensors, no
    memory mapping: a mapped file's pages count as the process's resident memory once touched, so packing a
    model out of a mapping holds the whole file besides the packed copy. For a file whose header a
    safetensors reader has already accepted (its offsets lie inside the file)."""

    def __init__(self, path):
        self.file = open(path, "rb")  # noqa: SIM115 - closed by close() / the with-block
        (n,) = struct.unpack("<Q", self.file.read(8))
        self.header, self.start = json.loads(self.file.read(n)), 8 + n

    def __call__(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        out = torch.empty(end - begin, dtype=torch.uint8)
        self.file.seek(self.start + begin)
        if self.file.readinto(memoryview(out.numpy())) != end - begin:
            raise QuantizedCheckpointError(f"{name} is cut short: the file is truncated")  # the caller names it
        return out.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def part_names(kept: dict[str, str]) -> set[str]:
    """The file's tensor names that make up the kept matrices (NAME.q4, NAME.q4_scale, ...)."""
    return {f"{name}.{suffix}" for name, form in kept.items() for suffix, _, _ in STORED_PARTS[form]}


def read_parts(name: str, form: str, read) -> dict[str, torch.Tensor]:
    """A kept matrix's tensors by suffix, each read with read(tensor name); a non-finite scale or min is refused
    here, naming the tensor, since every value it scales would be NaN or inf when the model runs."""
    parts = {suffix: read(f"{name}.{suffix}") for suffix, _, _ in STORED_PARTS[form]}
    for suffix, t in parts.items():
        if (t.is_floating_point() and not bool(torch.isfinite(t).all())) or (
                form in BLOCK_FORMS and not bool(torch.isfinite(block_scales(form, t)).all())):
            raise QuantizedCheckpointError(f"tensor {name}.{suffix} holds NaN or inf: the matrix's weights would be "
                                           "too; the file is corrupt: convert its GGUF again")
    return parts


def dequantized(kept: dict[str, str], read) -> dict[str, torch.Tensor]:
    """The kept matrices as float32 tensors under their own names, their parts read with read(name) (a device
    or a request without the kernels)."""
    return {name: dequantize(form, read_parts(name, form, read)) for name, form in kept.items()}
