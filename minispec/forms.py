"""The stored forms of a weight matrix: how each is held in memory and multiplied (one home per fact).

A module's `weight` is a float tensor (multiplied by `kernels.linear`) or one of these, which computes its
own product, `w(x, b)` = x @ w.T + b, each row of x computed alone (a row's result never depends on the other
rows of the pass):

- `Int4Weight`: groups of GROUP = 32 inputs, the weight scale * q + offset with q in 0..15, through PyTorch's
  CPU int4 kernel (a draft's fast form, and a kept Q4_K matrix where ggml's product is not built). The sign
  convention: a form's *offset* is added; a kept file stores Q4_K's *min*, which is subtracted (offset = -min).
- `Int8Weight`: one scale a row, the weight scale * q, through PyTorch's int8 weight-only kernel.
- `RowWise`: a float matrix multiplied one row at a time (exactly a one-row pass's product).
- `Stacked`: several forms over the same input, outputs side by side (a q, k, v trio kept in different forms).
- `minispec.ggml.GgmlWeight`: a GGUF's own blocks through llama.cpp's kernels (its own module: it needs the
  compiled library).

The kernel switch (`kernels.plain()`, MINISPEC_KERNELS=plain) governs every fast path here: switched off,
`RowWise` is one plain product and `GgmlWeight` multiplies the file's values with `F.linear`; the int4 and int8
forms still use their kernels (a stored form, not a choice of kernel: there is no float matrix to give
`F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels

GROUP = 32  # inputs per int4 group (Q4_K's sub-block)


class PackedWeight:
    """A weight matrix in a form `F.linear` cannot take, which computes its own product: `w(x, b)` is
    x @ w.T + b, each row of x computed alone (a row's result does not depend on the others)."""

    __slots__ = ("shape",)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.product(rows).to(x.dtype).view(*x.shape[:-1], self.shape[0])
        return out if b is None else out + b

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def int4_groups(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float matrix (N, K) quantized to 4 bits in groups of `group` inputs: q (N, K) uint8 in 0..15, scale and
    offset (N, K / group) with the weight ~ scale * q + offset (each group's range in 15 even steps)."""
    w = w.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = torch.aminmax(g, dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = (g - lo[..., None]).mul_((1 / scale)[..., None]).round_().clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return q, scale, lo


class Int4Weight(PackedWeight):
    """A weight matrix in int4: groups of 32 inputs per row, each with its own scale and offset (the weight is
    scale * q + offset, q in 0..15), packed for PyTorch's int4 weight-only product (`_weight_int4pack_mm_for_cpu`,
    bf16 activations, scales and offsets, unpacked in the kernel). An eighth of fp32's bytes, so a decode step,
    which reads every weight once, costs far less. `Int4Weight(w)` quantizes a float matrix (a draft's fast form:
    not exact, and it need not be, a draft only proposes); `from_groups` takes a file's own integers and scales
    (minispec.quantized)."""

    GROUP = GROUP
    CHUNK = 4096  # rows packed at a time (a multiple of the kernel's 64-row tiles): a bounded int32 temporary
    __slots__ = ("packed", "scales")

    def __init__(self, w: torch.Tensor):
        self._set(*int4_groups(w, self.GROUP))

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4Weight:
        """q (N, K) in 0..15, scale and offset (N, K/32): the weight scale * q + offset."""
        self = cls.__new__(cls)
        self._set(q, scale.float(), offset.float())
        return self

    def _set(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        self.shape = tuple(q.shape)
        # the packing reads its input as contiguous whatever its strides: a row-permuted q must be copied
        self.packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + self.CHUNK].to(
            torch.int32).contiguous(), 2) for i in range(0, q.shape[0], self.CHUNK)])
        # the kernel's weight is (q - 8) * scale + zero, scales and zeros (k / GROUP, n, 2)
        self.scales = torch.stack((scale, offset + 8 * scale), -1).transpose(0, 1).contiguous().bfloat16()

    @classmethod
    def fits(cls, shape) -> bool:
        """The kernel's shapes: output rows a multiple of 16, inputs of the group."""
        return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % cls.GROUP == 0

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.bfloat16(), self.packed, self.GROUP, self.scales)


class Int8Weight(PackedWeight):
    """A weight matrix in int8 with one scale a row (the weight is scale * q), multiplied by PyTorch's int8
    weight-only product (`_weight_int8pack_mm`, bf16 activations and scales): a quarter of fp32's bytes."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.shape = tuple(q.shape)
        # a copy: the kernel's vector loads fault on a tensor at an unaligned address (as a file's tensors may be)
        self.q, self.scale = q.to(torch.int8, copy=True, memory_format=torch.contiguous_format), scale.bfloat16()

    @classmethod
    def fits(cls, shape) -> bool:
        return len(shape) == 2

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows.bfloat16(), self.q, self.scale)


class RowWise(PackedWeight):
    """A float matrix multiplied one row at a time, each row exactly the product a one-row pass makes (for a
    matrix of a shape the packed kernels do not take, in a model whose passes must agree row by row)."""

    __slots__ = ("w",)

    def __init__(self, w: torch.Tensor):
        self.shape, self.w = tuple(w.shape), w

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.w.dtype)
        if not kernels.enabled():  # the switch off: the plain product, whatever it gives a row among others
            return F.linear(rows, self.w)
        return torch.cat([F.linear(rows[i:i + 1], self.w) for i in range(rows.shape[0])])


class Stacked(PackedWeight):
    """Several matrices over the same input as one product: their outputs side by side (q, k and v kept in
    different forms)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[PackedWeight]):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.product(rows).to(rows.dtype) for p in self.parts], dim=-1)


def int4_supported(device: torch.device | str) -> bool:
    """Int4Weight's kernel runs on CPUs."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) uint8 -> (..., K) uint8 values 0..15, input 2i from the low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """(..., K) values 0..15 -> (..., K/2) uint8, the inverse of unpack_q4."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def set_weight(module: nn.Module, weight: PackedWeight) -> None:
    """Give a module a packed weight: the parameter goes, the module keeps a plain attribute, out of the
    state dict."""
    del module.weight
    module.weight = weight
