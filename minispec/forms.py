"""The stored forms of a weight matrix, how each is held in memory and multiplied, and what builds them from a
kept file (one home per form).

A module's `weight` is a float tensor (multiplied by `kernels.linear`) or one of these, which computes its
own product, `w(x, b)` = x @ w.T + b, each row of x computed alone (a row's result never depends on the other
rows of the pass):

- `GgmlWeight`: a GGUF's own blocks (Q4_K, Q6_K, Q5_0, Q8_0) through a compiled product, ik_llama.cpp's or
  llama.cpp's (minispec.ggml loads the libraries), the product chosen once, when the matrix is built.
- `Int4Weight`: groups of GROUP = 32 inputs, the weight scale * q + offset with q in 0..15, through PyTorch's
  CPU int4 kernel (a draft's fast form, and a kept Q4_K matrix where no compiled product is built). The sign
  convention: a form's *offset* is added; a kept file stores Q4_K's *min*, which is subtracted (offset = -min).
- `Int8Weight`: one scale a row, the weight scale * q, through PyTorch's int8 weight-only kernel.
- `RowWise`: a float matrix multiplied one row at a time (exactly a one-row pass's product).
- `Stacked`: several forms over the same input, outputs side by side (a q, k, v trio kept in different forms).
- `KeptEmbedding`: an embedding table in its stored form, the rows a lookup needs dequantized.

A kept file's matrices become these at load (`install`, from the parts minispec.quantized reads): a file's blocks
a `GgmlWeight` wherever a compiled product takes them, whatever the kernel switch says then; without one, Q4_K
becomes int4 groups (exactly) and Q6_K, Q5_0 and Q8_0 int8 rows (requantized: within half a step of a row's
scale, as the notice at first use says). `make_rows_alike` sets the rest of a kept model to compute a row alike
in every pass.

The kernel switch (`kernels.plain()`, MINISPEC_KERNELS=plain) governs every fast path here, when a product runs:
switched off, `RowWise` is one plain product and `GgmlWeight` multiplies the file's values with `F.linear`; the
int4 and int8 forms still use their kernels (a stored form, not a choice of kernel: there is no float matrix to
give `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ggml, kernels, quantized
from .quantized import GROUP
from .threads import product_threads


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


def set_weight(module: nn.Module, weight: PackedWeight) -> None:
    """Give a module a packed weight: the parameter goes, the module keeps a plain attribute, out of the
    state dict."""
    del module.weight
    module.weight = weight


class GgmlWeight(PackedWeight):
    """An (N, K) matrix as a GGUF stores it, `blocks` uint8 (N, row bytes), multiplied by ik_llama.cpp's or
    llama.cpp's kernels (`product_name`: "iqk" or "ggml", chosen at construction)."""

    __slots__ = ("blocks", "kind", "type_id", "repacked", "product_name", "lib", "_run")

    def __init__(self, kind: str, blocks: torch.Tensor, k: int, repack: bool = True):
        self.kind, self.type_id = kind, ggml.TYPES[kind][0]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != ggml.row_bytes(kind, k):
            raise ValueError(f"a {kind} matrix of {k} inputs has rows of {ggml.row_bytes(kind, k)} bytes, got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        chosen = ggml.product_library(self.type_id, k, blocks[:ggml.CHECK_ROWS])
        if chosen is None:
            raise ValueError(f"no built product multiplies {kind} here")
        self.product_name, lib = chosen
        self.lib, self.blocks, self.shape = lib, blocks.contiguous(), (blocks.shape[0], k)
        # the matrix also in the form its product runs fastest, where it has one: ik's row-interleaved form (Q4_K as
        # Q4_K_R4, four rows to a block), or llama.cpp's eight-row Q4_K on AVX2; `blocks` stays the file's form
        # (the switch-off path reads it)
        self.repacked, self._run = None, self._runner(lib.ms_matmul, self.type_id)
        if not repack:
            return
        iqk = self.product_name == "iqk"
        if not iqk and not lib.ms_repackable(self.type_id, *self.shape):
            return
        packed = torch.empty_like(self.blocks)
        run_type = lib.ms_repack(self.type_id, self.blocks.data_ptr(), *self.shape, packed.data_ptr())
        if iqk and run_type >= 0 and ggml.rows_alike(lib, run_type, packed[:ggml.CHECK_ROWS], k):
            self.repacked, self._run = packed, self._runner(lib.ms_matmul, run_type)
        elif not iqk and run_type == 0:
            self.repacked, self._run = packed, self._runner(lib.ms_matmul_repacked, self.type_id)

    def _runner(self, matmul, type_id: int) -> tuple:
        """(the product function, the type it is called with, its scratch bytes per activation row)."""
        return matmul, type_id, self.lib.ms_row_size(self.lib.ms_vec_dot_type(type_id), self.shape[1])

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        (n, k), (matmul, type_id, x_row) = self.shape, self._run
        x = rows.reshape(-1, k)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if not kernels.enabled():  # the switch off: the file's values in float, the plain product
            return F.linear(x, ggml.dequantize(self.kind, self.blocks, k))
        m, w = x.shape[0], (self.blocks if self.repacked is None else self.repacked)
        y = torch.empty(m, n)
        scratch = torch.empty(min(m, ggml.MAX_ROWS) * x_row, dtype=torch.uint8)
        threads = product_threads()
        if m <= ggml.MAX_ROWS:  # a decode step or a verify pass: one call (a step makes ~170 of them: kept short)
            matmul(type_id, w.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(), scratch.data_ptr(), threads)
            return y
        for i in range(0, m, ggml.MAX_ROWS):
            part = x[i:i + ggml.MAX_ROWS]
            matmul(type_id, w.data_ptr(), n, k, part.data_ptr(), part.shape[0], y[i:i + ggml.MAX_ROWS].data_ptr(),
                   scratch.data_ptr(), threads)
        return y


def int8_rows(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float matrix as the q8 form: one scale a row, the smallest bf16 value >= max |w| / 127 (the kernel
    computes in bf16 scales, so the stored value is the one computed), q = round(w / scale)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = (amax / 127).bfloat16()
    scale = torch.where(scale.float() * 127 < amax, torch.nextafter(scale, torch.full_like(scale, float("inf"))),
                        scale).float()
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0
    return {"q8": (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), "q8_scale": scale}


def computed_values(form: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weights as the CPU's kernels compute them: scales and offsets in bf16 (for an int4 group the kernel's
    (q - 8) * scale + zero, zero = 8 * scale - min); an int8 row's scale already is bf16."""
    if form != "q4":  # int8 rows' scales are bf16 already; ggml multiplies a file's blocks as they are
        return quantized.dequantize(form, parts)
    scale, zero = parts["q4_scale"].float(), 8 * parts["q4_scale"].float() - parts["q4_min"].float()
    q = quantized.unpack_q4(parts["q4"]).float().view(*scale.shape, GROUP) - 8
    return (q * scale.bfloat16().float()[..., None] + zero.bfloat16().float()[..., None]).flatten(-2)


def packed_weight(form: str, parts: dict[str, torch.Tensor]) -> PackedWeight:
    """A kept matrix as the product the CPU computes: a file's blocks through ggml's kernels (minispec.ggml)
    where that is built, whatever the kernel switch says at load (switched off, the product multiplies the file's
    own values: the switch chooses how a product is computed, never what it holds); else its int4 or int8 kernel
    (a file's blocks made into int4 groups, Q4_K exactly, or int8 rows: the notice `ggml.available` prints says
    so), else (a shape those kernels do not take) its dequantized values multiplied row by row."""
    if form in quantized.BLOCK_FORMS:
        blocks = parts[form]
        _, values, size = ggml.TYPES[form]
        k = blocks.shape[1] // size * values
        if ggml.available() and ggml.takes(form, k, blocks):
            return GgmlWeight(form, blocks, k)
        if form == "q4_k":
            return packed_weight("q4", quantized.q4_k_groups(blocks.reshape(-1), blocks.shape[0], k))
        return packed_weight("q8", int8_rows(quantized.decode_blocks(form, blocks)))
    n, k = parts["q4" if form == "q4" else "q8"].shape
    k *= 2 if form == "q4" else 1
    if form == "q4" and Int4Weight.fits((n, k)):
        return Int4Weight.from_groups(quantized.unpack_q4(parts["q4"]), parts["q4_scale"], -parts["q4_min"])
    if form == "q8" and Int8Weight.fits((n, k)):
        return Int8Weight(parts["q8"], parts["q8_scale"])
    return RowWise(quantized.dequantize(form, parts))


def stacked(forms: list[str], parts: list[dict[str, torch.Tensor]]) -> PackedWeight:
    """q, k and v as one product: their rows stacked into one matrix when all three have one form, else three
    products side by side."""
    if len(set(forms)) == 1:
        return packed_weight(forms[0], {suffix: torch.cat([p[suffix] for p in parts]) for suffix in parts[0]})
    return Stacked([packed_weight(f, p) for f, p in zip(forms, parts)])


class KeptEmbedding(nn.Module):
    """An embedding table kept in its stored form: the rows a lookup needs are dequantized (exactly the
    stored values), the table never is."""

    def __init__(self, form: str, parts: dict[str, torch.Tensor]):
        super().__init__()
        self.form, self.parts = form, parts
        self.num_embeddings = parts[quantized.STORED_PARTS[form][0][0]].shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.form in quantized.BLOCK_FORMS and ids.numel() and kernels.enabled() and ggml.available():
            # ggml's own dequantization of the rows: the same values (tests/test_ggml.py), in one call, where the
            # PyTorch decoding takes a few dozen small ones (a third of a millisecond a decode step)
            blocks = self.parts[self.form][ids.reshape(-1)]
            _, values, size = ggml.TYPES[self.form]
            return ggml.dequantize(self.form, blocks, blocks.shape[1] // size * values).view(*ids.shape, -1)
        return quantized.dequantize(self.form, {name: t[ids] for name, t in self.parts.items()})


def is_packed(model: nn.Module) -> bool:
    """Whether any weight of `model` is in a packed form (int4 products or a kept quantization)."""
    return isinstance(getattr(model, "embed_tokens", None), KeptEmbedding) or any(
        isinstance(getattr(m, "weight", None), PackedWeight) for m in model.modules()) or isinstance(
        getattr(model, "head_packed", None), PackedWeight)


def install(model: nn.Module, kept: dict[str, str], read, floats: dict[str, torch.Tensor]) -> None:
    """Put the kept matrices into `model` (built on the meta device, before its float tensors are loaded) in
    the form its CPU computes, reading each one's tensors with read(name) only when its turn comes (so the
    stored and the packed forms of the whole model are never held at once). `make_rows_alike` finishes the model
    once its float tensors are in. `floats`: the file's float tensors; a float q, k or v beside kept ones (a GGUF
    may quantize them differently) is taken from it into their product, multiplied row by row."""
    def parts(name: str) -> dict[str, torch.Tensor]:
        return quantized.read_parts(name, kept[name], read)
    for name, form in kept.items():
        if name == "embed_tokens.weight":
            model.embed_tokens = KeptEmbedding(form, parts(name))
            if model.lm_head is None:  # a tied head: the product from the same stored values
                model.head_packed = packed_weight(form, model.embed_tokens.parts)
        elif (part := name.rsplit(".", 2))[-2] in getattr(attn := model.get_submodule(part[0]), "PROJECTIONS", ()):
            # layers.i.self_attn's q, k and v (model.Attention names them): packed once, at its first kept one
            trio = [f"{part[0]}.{p}.weight" for p in attn.PROJECTIONS]
            if next(n for n in trio if n in kept) != name:
                continue
            if all(n in kept for n in trio):
                set_weight(attn.qkv_proj, stacked([kept[n] for n in trio], [parts(n) for n in trio]))
            else:
                set_weight(attn.qkv_proj, Stacked([packed_weight(kept[n], parts(n)) if n in kept
                                                   else RowWise(floats.pop(n).float().clone()) for n in trio]))
        else:
            set_weight(model.get_submodule(name.rsplit(".", 1)[0]), packed_weight(form, parts(name)))
    model.ggml_products = any(isinstance(w, GgmlWeight) or isinstance(w, Stacked) and any(
        isinstance(p, GgmlWeight) for p in w.parts) for w in (
        [getattr(m, "weight", None) for m in model.modules()] + [model.head_packed]))


def make_rows_alike(model: nn.Module) -> None:
    """Make every pass of a kept model compute a position exactly as a one-token pass does: float matrices (a
    GGUF's F16 or F32 ones) multiplied row by row, and the model's one mode, `rows_alike`, for its norms and
    attention."""
    model.rows_alike = True
    for m in model.modules():
        if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor):
            set_weight(m, RowWise(m.weight.detach()))
    if model.lm_head is None and model.head_packed is None and not isinstance(model.embed_tokens, KeptEmbedding):
        model.head_packed = RowWise(model.embed_tokens.weight.detach())
