"""How a CPU computes the model's products, attention and norms: the fast paths, apart from the maths.

model.py states the maths and calls three functions here, each of which computes exactly that maths
(up to rounding) by whatever path this CPU runs fastest:

- `linear(x, w, b)`, x @ w.T + b: an fp32 product takes the form a one-off probe found fastest on
  this CPU (`product_forms`: one form for a decode step, one for 2-512 rows, a verify pass or a batch;
  docs/benchmarks.md, "Product forms"); a bf16 product of one row is computed as two (see below); an
  fp16 product over many rows is computed in fp32 (CPUs lack fast fp16 matrix products); under
  autograd (distillation trains through it) and off the CPU it is `F.linear`.
- `attention(q, ctx, mask, n_kv_heads)`: a bf16 CPU pass over several tokens of one sequence attends
  row by row (`row_wise_attention`); everything else is one `F.scaled_dot_product_attention` call.
- `rms_norm(x, weight, eps)`: one fp32 row outside autograd (a decode step) takes a shortcut of fewer
  kernels; everything else the formula.

A weight in a stored form (minispec.forms: int4 groups, int8 rows, a GGUF's blocks, ...) computes its own
product; `linear` hands it the rows.

One switch turns every fast path off. `MINISPEC_KERNELS=plain` in the environment (read when used;
"fast", the default, turns them on; any other value raises ValueError at the first use), or, in a
program, `set_enabled(False)` or `with minispec.kernels.plain(): ...` (which take precedence over the
environment; `set_enabled(None)` hands the choice back to it). Switched off, every product is
`F.linear`, every attention one SDPA call, every RMSNorm the formula, and the product-form probe never
runs; the stored forms follow the switch as minispec.forms says.

What switching off gives up: in bf16 on a CPU, a decode step and a verify pass give a position the
same bits only because a one-row product is computed as two and a pass over several tokens attends
row by row (docs/benchmarks.md, "bf16 target"). With the switch off that guarantee is off for bf16
CPU models: greedy speculation can then differ from greedy generation at near-ties. The exactness
of speculative sampling in fp32 is a property of the distributions and holds either way.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .threads import at_threads

# ---------------------------------------------------------------------------
# the switch
# ---------------------------------------------------------------------------

_override: bool | None = None  # set_enabled / plain(); None: MINISPEC_KERNELS decides
_in_pass: bool | None = None  # the setting read once for the model pass under way (resolved)


def _from_env() -> bool:
    value = os.environ.get("MINISPEC_KERNELS", "").strip()
    if value in ("", "fast"):
        return True
    if value == "plain":
        return False
    raise ValueError(f"MINISPEC_KERNELS must be 'plain' (no fast paths) or 'fast' (the default), got {value!r}")


def enabled() -> bool:
    """Whether the fast paths are on: set_enabled's setting, else MINISPEC_KERNELS (on unless it says plain)."""
    if _in_pass is not None:
        return _in_pass
    return _override if _override is not None else _from_env()


def set_enabled(flag: bool | None) -> None:
    """True: the fast paths; False: plain F.linear, SDPA and the RMSNorm formula; None: MINISPEC_KERNELS decides."""
    global _override
    _override = flag


@contextmanager
def plain():
    """Every fast path off inside the block; the earlier setting is restored after it."""
    global _override
    before = _override
    _override = False
    try:
        yield
    finally:
        _override = before


@contextmanager
def resolved():
    """Read the switch once for a whole model pass, not in each of its hundreds of kernel calls (an
    environment lookup in every product and norm adds up over a step)."""
    global _in_pass
    if _in_pass is not None:  # already inside a pass
        yield
        return
    _in_pass = enabled()
    try:
        yield
    finally:
        _in_pass = None


# ---------------------------------------------------------------------------
# products
# ---------------------------------------------------------------------------

def _transposed(x, w, b):
    xt = x.reshape(-1, x.shape[-1]).contiguous().t()  # x contiguous: the thin kernel (a transposed x is slower)
    return (torch.mm(w, xt) if b is None else torch.addmm(b.unsqueeze(1), w, xt)).t().reshape(*x.shape[:-1], -1)


# the forms an fp32 CPU product x @ w.T + b can take; PyTorch's own kernels, each picked by shape in its library
PRODUCTS = {"aten": F.linear,  # MKL's GEMM / GEMV
            "transposed": _transposed,  # (w @ x.T).T: MKL's kernel for a thin right-hand side
            "onednn": lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")}


@functools.cache
def product_forms() -> tuple[str, str]:
    """The fastest form of an fp32 product on this CPU for one row and for 2-512 rows, measured once.

    The libraries pick kernels by shape, and which form wins differs from CPU to CPU (docs/benchmarks.md,
    "Product forms"). Timed once per process on an 8192 x 1536 weight (larger than any cache, as a
    model's are), best of 5 each, at one thread: a timing at several threads measures the machine's load
    as much as the kernels (beside a busy process the threads wait on each other), while at one thread
    the ranking is the quiet one."""
    g = torch.Generator().manual_seed(0)  # its own: the caller's global RNG state is left alone
    w, b = torch.randn(8192, 1536, generator=g), torch.randn(8192, generator=g)
    forms = [f for f in PRODUCTS if f != "onednn" or torch.backends.mkldnn.is_available()]

    def best(form: str, rows: int) -> float:
        x, times = torch.randn(rows, 1536, generator=g), []
        for _ in range(6):
            t0 = time.perf_counter()
            PRODUCTS[form](x, w, b)
            times.append(time.perf_counter() - t0)
        return min(times[1:])
    with at_threads(1, torch.get_num_threads()), torch.inference_mode():
        return (min((f for f in forms if f != "transposed"), key=lambda f: best(f, 1)),
                min(forms, key=lambda f: best(f, 4)))


def _one_row_as_two(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A bf16 product of one row, computed as a product of two: oneDNN's bf16 kernel gives a row the same
    bits in any product of 2 rows or more (a verify pass, a prefill), not alone, so a decode step then
    computes what a verify pass does (docs/benchmarks.md, "bf16 target")."""
    return F.linear(x.reshape(1, -1).repeat(2, 1), w, b)[:1].view(*x.shape[:-1], -1)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b, by the path this CPU runs fastest (see the module's docstring); `F.linear` when the
    switch is off, off the CPU or under autograd. A PackedWeight always computes its own product."""
    if not isinstance(w, torch.Tensor):  # a stored form (minispec.forms) computes its own product
        return w(x, b)
    if not enabled() or x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return F.linear(x, w, b)  # on the weights directly: an nn.Linear module call costs more, in every product
    rows = x.numel() // x.shape[-1]
    if x.dtype == torch.float16 and rows > 8:  # CPUs lack fast fp16 matrix products: in fp32 (a draft's prefill)
        return linear(x.float(), w.float(), None if b is None else b.float()).half()
    if x.dtype == torch.bfloat16:
        return _one_row_as_two(x, w, b) if rows == 1 else F.linear(x, w, b)
    if x.dtype != torch.float32:
        return F.linear(x, w, b)
    form = product_forms()[rows > 1]
    return PRODUCTS["aten" if form == "transposed" and rows > 512 else form](x, w, b)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------

def row_wise_attention(q: torch.Tensor, ctx: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """One sequence's attention, each query row as its own call over the keys it sees, exactly the call a
    decode step makes for that position: q (1, H, T, D), ctx (1, 2*Hkv, L, D) with the T new tokens last.

    SDPA's result for a row depends on how many rows it is computed with (a one-query call and a row of a
    verify pass round differently), and in bf16 such a difference is a whole unit of the 8-bit mantissa:
    greedy speculation would then drift from greedy generation at near-ties. Row by row, a verify pass (or a
    prefill) computes for each position what a decode step computes (the products agree already: `linear`
    computes one bf16 row as two). T calls instead of one: a prefill of a long prompt pays for it."""
    T, L = q.shape[2], ctx.shape[2]
    return each_row_alone(q, ctx, n_kv_heads, [[L - T + t + 1 for t in range(T)]])


def each_row_alone(q: torch.Tensor, ctx: torch.Tensor, n_kv_heads: int, ends: list[list[int]]) -> torch.Tensor:
    """A batch's attention with each query row of each sequence as its own call over its own keys, the call a
    one-sequence decode step makes for that position: ends[b][t] keys for row t of sequence b (0: padding, left
    zero), the first n, or a tree token's key indices (a tensor: its context and ancestors, gathered in order, so
    the call is the one a chain of those tokens makes). Batched, SDPA's result for a row depends on the other
    sequences' lengths (the padding it masks)."""
    Hkv, out = n_kv_heads, q.new_zeros(q.shape)
    for b, row_ends in enumerate(ends):
        for t, n in enumerate(row_ends):
            if isinstance(n, torch.Tensor) or n:
                kv = ctx[b:b + 1, :, n] if isinstance(n, torch.Tensor) else ctx[b:b + 1, :, :n]
                out[b:b + 1, :, t:t + 1] = F.scaled_dot_product_attention(
                    q[b:b + 1, :, t:t + 1], kv[:, :Hkv], kv[:, Hkv:], enable_gqa=q.shape[1] != Hkv)
    return out


def attends_row_wise(q: torch.Tensor) -> bool:
    """Whether attention over q (B, H, T, D) goes row by row (`row_wise_attention`): a bf16 pass over several
    tokens of one sequence on a CPU, fast paths on."""
    return (q.device.type == "cpu" and enabled() and q.shape[0] == 1 and q.shape[2] > 1
            and q.dtype == torch.bfloat16)


def attention(q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, n_kv_heads: int,
              ends: list[list[int]] | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v for q (B, H, T, D) over ctx (B, 2*Hkv, L, D) (keys in the first Hkv
    rows, values in the rest; mask additive, (B, 1, T, L), or None). On a CPU: a bf16 pass over several tokens
    of one sequence row by row (`row_wise_attention`); given `ends` (each row's key count, from a model whose
    passes must agree row by row: minispec.quantized), a batch's rows each alone (`each_row_alone`); else one
    SDPA call."""
    B, H, T = q.shape[:3]
    if q.device.type == "cpu" and enabled() and ends is not None and B * T > 1:
        return each_row_alone(q, ctx, n_kv_heads, ends)
    if attends_row_wise(q):
        return row_wise_attention(q, ctx, n_kv_heads)
    return F.scaled_dot_product_attention(q, ctx[:, :n_kv_heads], ctx[:, n_kv_heads:], attn_mask=mask,
                                          enable_gqa=H != n_kv_heads)


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------

def _rms_norm_row(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fp32 row: its sum of squares is one dot product and the scale a Python float (so inference
    only), 3 kernels instead of 7, twice in every layer of a decode step."""
    v = x.reshape(-1)
    return torch.mul(x, weight).mul_((float(torch.dot(v, v)) / v.shape[0] + eps) ** -0.5)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows_alike: bool = False) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last axis, normalised in fp32 as Hugging Face does and
    cast back before the scale (F.rms_norm is more kernels on a CPU, no faster). rows_alike: no one-row
    shortcut, so a row comes out the same alone or among others."""
    if (x.dtype == torch.float32 and x.numel() == x.shape[-1] and not torch.is_grad_enabled() and enabled()
            and not rows_alike):
        return _rms_norm_row(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(eps))
    return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))
