"""The CPU fast paths (minispec.kernels): each computes what the plain formula does, and one switch turns them off."""

import pytest
import torch
import torch.nn.functional as F

from minispec import ModelConfig, Transformer, forms, kernels
from minispec.forms import Int4Weight
from minispec.kernels import PRODUCTS, linear, product_forms

from helpers import tiny_model


def test_rmsnorm_single_row_path_matches_and_keeps_gradients():
    # a single fp32 row takes a shortcut (one dot product, a Python-float scale) when no gradient is
    # recorded; it must equal the general formula, and training (grad enabled) must not take it
    from minispec.model import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 1, 24) * 3
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    with torch.inference_mode():
        assert torch.allclose(norm(x), ref, atol=1e-6, rtol=1e-6)
    xg = x.clone().requires_grad_()
    norm(xg).sum().backward()
    xr = x.clone().requires_grad_()
    (norm.weight * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5))).sum().backward()
    assert torch.allclose(xg.grad, xr.grad, atol=1e-6)


@pytest.mark.parametrize("forms", [("aten", "aten"), ("aten", "transposed"), ("onednn", "onednn"),
                                   ("onednn", "transposed")])
def test_linear_equals_f_linear_in_every_product_form(monkeypatch, forms):
    # the product forms are chosen by a probe of the CPU (kernels.product_forms); every one must agree
    if "onednn" in forms and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this build")
    monkeypatch.setattr(kernels, "product_forms", lambda: forms)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for shape in [(1, 64), (2, 64), (3, 5, 64), (1, 512, 64), (513, 64), (2, 300, 64)]:
        x = torch.randn(*shape, generator=g)
        for bias in (None, b):
            got, want = linear(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64, generator=g).t().contiguous().t()  # a column-major input: the same values out
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    wg = w.clone().requires_grad_()  # under autograd (distillation) every form leaves it to F.linear
    linear(torch.randn(3, 64, generator=g), wg, b).sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


def test_the_product_form_probe_answers_once():
    one, few = product_forms()
    assert one in PRODUCTS and one != "transposed" and few in PRODUCTS
    assert product_forms.cache_info().currsize == 1


def test_the_product_forms_are_timed_at_one_thread(monkeypatch):
    # two threads beside a busy process wait on each other: a timing there ranks the forms by the load
    seen = []
    for name, form in list(PRODUCTS.items()):
        monkeypatch.setitem(PRODUCTS, name, lambda x, w, b, form=form: seen.append(torch.get_num_threads())
                            or form(x, w, b))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        product_forms.__wrapped__()
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_a_float16_product_over_many_rows_is_computed_in_float32():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g).half(), torch.randn(96, generator=g).half()
    for rows in (1, 2, 8, 9, 40):
        x = torch.randn(rows, 64, generator=g).half()
        got = linear(x, w, b)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-3, atol=2e-2)


def _int4_reference(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Asymmetric 4-bit rounding per group of `group` inputs, dequantized: what Int4Weight's kernel multiplies by."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (((g - lo) / s).round().clamp(0, 15) * s + lo).reshape(n, k)


def test_int4_product_is_the_product_with_the_rounded_matrix():
    torch.manual_seed(0)
    w, x, b = torch.randn(48, 96), torch.randn(2, 3, 96), torch.randn(48)
    q = Int4Weight(w)
    got = linear(x, q, b)
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32
    want = x @ _int4_reference(w).T + b
    assert (got - want).norm() / want.norm() < 2e-2  # bf16 activations, scales and offsets
    exact = x @ w.T + b
    assert 0.02 < (got - exact).norm() / exact.norm() < 0.2  # 4 bits are not 32: the rounding is there
    assert not Int4Weight.fits((40, 64)) and not Int4Weight.fits((48, 40))
    with kernels.plain():  # a stored form, not a choice: its kernel runs with the switch off too
        assert torch.equal(linear(x, q, b), got)


# ---------------------------------------------------------------------------
# the switch
# ---------------------------------------------------------------------------

def _boom(*args, **kwargs):
    raise AssertionError("a fast path ran with the kernels switched off")


def _every_fast_path_raises(monkeypatch) -> dict:
    """Make every fast path (and the product-form probe) raise; count the plain F.linear and SDPA calls."""
    for name in ("product_forms", "_transposed", "_one_row_as_two", "row_wise_attention", "each_row_alone",
                 "_rms_norm_row"):
        monkeypatch.setattr(kernels, name, _boom)
    for name in list(PRODUCTS):
        monkeypatch.setitem(PRODUCTS, name, _boom)
    calls = {"linear": 0, "sdpa": 0}
    f_linear, sdpa = F.linear, F.scaled_dot_product_attention

    def counted_linear(*a, **kw):
        calls["linear"] += 1
        return f_linear(*a, **kw)

    def counted_sdpa(*a, **kw):
        calls["sdpa"] += 1
        return sdpa(*a, **kw)
    monkeypatch.setattr(F, "linear", counted_linear)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
    return calls


def _run(model: Transformer, tokens: list[int]) -> list[torch.Tensor]:
    """Logits of a full forward, a prefill, a decode step and a verify-style pass over 3 tokens."""
    cache = model.new_cache(num_blocks=16, block_size=4)
    s = cache.new_sequence()
    return [model(torch.tensor([tokens]))[0], model.step(cache, [s], [tokens[:5]], all_logits=True)[0],
            model.step(cache, [s], [tokens[5:6]])[0], model.step(cache, [s], [tokens[6:9]], all_logits=True)[0]]


@pytest.mark.parametrize("how", ["environment", "context manager", "set_enabled"])
def test_switched_off_the_model_runs_on_f_linear_and_sdpa_alone(monkeypatch, how):
    model = tiny_model(seed=4, scale=2.0)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    fast = _run(model, tokens)
    fast_gen = model.generate(tokens[:4], max_new_tokens=6)
    calls = _every_fast_path_raises(monkeypatch)
    with pytest.raises(AssertionError, match="switched off"):  # on, the fast paths are taken
        _run(model, tokens)
    if how == "environment":
        monkeypatch.setenv("MINISPEC_KERNELS", "plain")
        off = _run(model, tokens)
        gen = model.generate(tokens[:4], max_new_tokens=6)
    elif how == "context manager":
        with kernels.plain():
            off = _run(model, tokens)
            gen = model.generate(tokens[:4], max_new_tokens=6)
        assert kernels.enabled()  # restored on leaving the block
    else:
        kernels.set_enabled(False)
        try:
            off = _run(model, tokens)
            gen = model.generate(tokens[:4], max_new_tokens=6)
        finally:
            kernels.set_enabled(None)
    assert calls["linear"] > 0 and calls["sdpa"] > 0
    for a, b in zip(fast, off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert gen == fast_gen


def test_switched_off_a_bfloat16_model_attends_in_one_call_and_int4_keeps_its_kernel(monkeypatch):
    torch.manual_seed(3)
    bf16 = Transformer(ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
                       dtype=torch.bfloat16)
    int4 = tiny_model(seed=5, dim=64, vocab_size=64)
    if forms.int4_supported("cpu"):
        int4.to_int4()
    tokens = [5, 17, 3, 40, 41, 8, 8, 60, 2, 33]
    fast = [_run(bf16, tokens), _run(int4, tokens)]
    _every_fast_path_raises(monkeypatch)
    with kernels.plain():
        off = [_run(bf16, tokens), _run(int4, tokens)]
    for a, b in zip(fast[0], off[0]):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # bf16: the rounding differs, not the maths
    for a, b in zip(fast[1], off[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_switch_is_read_when_used_and_a_bad_value_says_what_it_takes(monkeypatch):
    monkeypatch.setenv("MINISPEC_KERNELS", "fast")
    assert kernels.enabled()
    monkeypatch.setenv("MINISPEC_KERNELS", "plain")
    assert not kernels.enabled()
    kernels.set_enabled(True)  # a program's setting wins over the environment
    try:
        assert kernels.enabled()
        with kernels.plain():
            assert not kernels.enabled()
        assert kernels.enabled()
    finally:
        kernels.set_enabled(None)
    assert not kernels.enabled()
    monkeypatch.setenv("MINISPEC_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MINISPEC_KERNELS must be 'plain'"):
        linear(torch.ones(1, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="MINISPEC_KERNELS"):
        tiny_model()(torch.tensor([[1, 2]]))


def test_the_switch_governs_the_row_by_row_product(monkeypatch):
    """RowWise multiplies row by row only with the fast paths on; off, it is the one plain product."""
    from minispec.forms import RowWise
    torch.manual_seed(0)
    w, x = torch.randn(24, 40), torch.randn(5, 40)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    RowWise(w)(x)
    assert calls == [1] * 5
    calls.clear()
    with kernels.plain():
        out = RowWise(w)(x)
    assert calls == [5] and torch.equal(out, real(x, w))
