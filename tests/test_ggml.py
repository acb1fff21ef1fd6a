"""The quantized products through llama.cpp's kernels (native/ggml_shim.c) and ik_llama.cpp's row-tiled ones
(native/iqk_shim.c), minispec.ggml; each test runs for every product built here (`product`).

- ggml's own dequantization equals gguf-py's on random valid Q4_K and Q6_K blocks (and on Q5_0 / Q8_0
  blocks gguf-py quantizes), so the products multiply the file's values.
- Each product against the float product of those values: activations are quantized first (Q8_K or Q8_0 for
  llama.cpp's, Q8_2_X4 or Q8_0_X4 for ik's, int8 per 256 values for minispec's own 16-row tiles), so it is not
  the float product; the bound per type, stated below, is measured.
- Every type, every row count from 1 to 16: each row's output identical to that row computed alone, and at 1
  and 2 threads identical; more rows than one pass takes likewise.
- The product is chosen at load (MINISPEC_PRODUCT, else ik's where it is built); without either library one
  line says so, once, and the model computes in PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minispec import forms, ggml

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_quantized import random_blocks  # noqa: E402

needs_library = pytest.mark.skipif(not ggml.available(), reason="the quantized product is not built "
                                   "(python tools/build_ggml.py)")
BUILT = {"ggml": ggml._library() is not None, "iqk": ggml._iqk_library() is not None}


@pytest.fixture(params=list(BUILT))
def product(request, monkeypatch):
    """Each built product in turn, chosen as a user does (MINISPEC_PRODUCT, read when a matrix is loaded)."""
    if not BUILT[request.param]:
        pytest.skip(f"the {request.param} product is not built (python tools/build_ggml.py)")
    monkeypatch.setenv("MINISPEC_PRODUCT", request.param)
    return request.param
KINDS = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q5_0": Q.Q5_0, "q8_0": Q.Q8_0}
# |product - float product| <= BOUND * sum_i |w_i x_i| over a row: Q8_K rounds each activation to within half
# a step of 127 steps of its 256-value block's max (1/254 of it), Q8_0 likewise over 32 values with an fp16
# scale; measured on these random blocks: 0.54 of the bound (Q4_K), 0.40 (Q6_K), 0.18 (Q5_0, Q8_0)
BOUND = {"q4_k": 1 / 254, "q6_k": 1 / 254, "q5_0": 1 / 200, "q8_0": 1 / 200}


def blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    if kind in ("q4_k", "q6_k"):  # gguf-py has no K-quantizer: random valid blocks
        return random_blocks(KINDS[kind], n, k, 0.01, seed)
    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    return gguf.quants.quantize(w, KINDS[kind])


def values(raw: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, KINDS[kind]), dtype=np.float32).reshape(n, k))


@needs_library
@pytest.mark.parametrize("kind", list(KINDS))
def test_ggml_reads_the_file_values_gguf_reads(kind, monkeypatch):
    n, k = 24, 512
    raw = blocks(kind, n, k, 1)
    for name, lib in (("ggml", ggml._library()), ("iqk", ggml._iqk_library())):  # each library's own copy
        if lib is not None:
            monkeypatch.setattr(ggml, "_library", lambda lib=lib: lib)
            assert torch.equal(ggml.dequantize(kind, torch.from_numpy(raw), k), values(raw, kind, n, k)), name


@needs_library
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("repack", [True, False])
def test_product_within_the_activation_rounding_of_the_float_product(kind, repack, product):
    n, k = 40, 1024
    raw = blocks(kind, n, k, 2)
    w = forms.GgmlWeight(kind, torch.from_numpy(raw), k, repack=repack)
    assert w.product_name == product
    exact = values(raw, kind, n, k).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    got, want = w(x).double(), x.double() @ exact.T
    scale = x.double().abs() @ exact.abs().T
    err = (got - want).abs() / scale
    assert (err <= BOUND[kind]).all(), err.max()
    assert err.max() > 0  # the activations are rounded: not the float product


@needs_library
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("repack", [True, False])
def test_a_rows_bits_do_not_depend_on_the_pass_or_the_threads(kind, repack, product):
    # an output count no thread split divides evenly: 17 tiles of llama.cpp's 8 rows, 9 of ik's 16-row interleaved
    # forms (which take whole multiples of 16)
    n, k = (136 if product == "ggml" else 144), 768
    w = forms.GgmlWeight(kind, torch.from_numpy(blocks(kind, n, k, 4)), k, repack=repack)
    assert w.product_name == product
    if product == "iqk" and kind in ("q4_k", "q6_k"):  # interleaved (16-row tiles or Q4_K_R4, Q6_K_R4), rows alike
        assert (w.repacked is not None) == repack
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([w(x[i:i + 1]) for i in range(16)])
        for rows in range(1, 17):
            assert torch.equal(w(x[:rows]), alone[:rows]), rows
        torch.set_num_threads(2)
        for rows in range(1, 17):
            assert torch.equal(w(x[:rows]), alone[:rows]), rows
        # more rows than one pass takes: the rest in further passes, each row still its own product
        many = torch.randn(ggml.MAX_ROWS + 3, k, generator=torch.Generator().manual_seed(6))
        assert torch.equal(w(many)[-3:], torch.cat([w(many[i:i + 1]) for i in range(ggml.MAX_ROWS, len(many))]))
    finally:
        torch.set_num_threads(before)
    # the negative control: a row computed with other weights differs (the comparison can fail)
    other = forms.GgmlWeight(kind, torch.from_numpy(blocks(kind, n, k, 7)), k)
    assert not torch.equal(other(x[:1]), alone[:1])


@pytest.mark.skipif(not BUILT["ggml"], reason="llama.cpp's product is not built (python tools/build_ggml.py)")
def test_q4_k_is_repacked_where_ggml_repacks_it_and_agrees_with_the_file_form(monkeypatch):
    monkeypatch.setenv("MINISPEC_PRODUCT", "ggml")
    n, k = 64, 512
    raw = torch.from_numpy(blocks("q4_k", n, k, 10))
    packed, plain = forms.GgmlWeight("q4_k", raw, k), forms.GgmlWeight("q4_k", raw, k, repack=False)
    assert plain.repacked is None
    assert (packed.repacked is not None) == bool(ggml._library().ms_repackable(12, n, k))
    if packed.repacked is None:
        pytest.skip("no repacked Q4_K product on this CPU (llama.cpp repacks Q4_K for AVX2)")
    assert not torch.equal(packed.repacked, raw)  # another layout, the same bytes
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(11))
    a, b = packed(x), plain(x)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # the same products, summed in another order
    # the switch off reads the file's blocks, not the repacked ones
    from minispec import kernels
    with kernels.plain():
        assert torch.equal(packed(x), torch.nn.functional.linear(x, values(raw.numpy(), "q4_k", n, k)))
    assert forms.GgmlWeight("q4_k", raw[:60], k).repacked is None  # 60 rows: not eight to a tile


TILES = {"q4_k": 1012, "q6_k": 1014}  # native/ms_rows.h's type ids for minispec's 16-row tiles
TILES_BUILT = BUILT["iqk"] and bool(ggml._iqk_library().ms_rows_built())


@pytest.mark.skipif(not TILES_BUILT, reason="minispec's 16-row tiles need AVX-512 VNNI (and the iqk library)")
@pytest.mark.parametrize("kind", list(TILES))
def test_minispec_tiles_multiply_the_file_values_every_row_alone(kind, monkeypatch):
    monkeypatch.setenv("MINISPEC_PRODUCT", "iqk")
    n, k = 48, 768  # three tiles: no thread split of two divides them evenly
    raw = blocks(kind, n, k, 12)
    w = forms.GgmlWeight(kind, torch.from_numpy(raw), k)
    assert w._run[1] == TILES[kind] and w.repacked.shape == w.blocks.shape  # the same bytes, interleaved
    exact = values(raw, kind, n, k).double()
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(13))  # past the 64 rows one pass over a tile keeps
    err = (w(x).double() - x.double() @ exact.T).abs() / (x.double().abs() @ exact.abs().T)
    assert (err <= BOUND[kind]).all() and err.max() > 0, err.max()
    # a call of 100 rows (as the compiled blocks make for a prefill) against each row alone, at 1 and 2 threads
    lib, (matmul, type_id, x_row) = w.lib, w._run
    scratch = torch.empty(100 * x_row, dtype=torch.uint8)

    def call(rows: torch.Tensor, threads: int) -> torch.Tensor:
        y = torch.empty(rows.shape[0], n)
        assert matmul(type_id, w.repacked.data_ptr(), n, k, rows.data_ptr(), rows.shape[0], y.data_ptr(),
                      scratch.data_ptr(), threads) == 0
        return y
    alone = torch.cat([call(x[i:i + 1], 1) for i in range(100)])
    assert torch.equal(call(x, 1), alone) and torch.equal(call(x, 2), alone) and torch.equal(call(x[:9], 2), alone[:9])
    assert lib.ms_vec_dot_type(type_id) == 1015 and x_row == lib.ms_row_size(1015, k)
    # the control: ik's interleaved form, asked for at load, computes the same values with other activations
    monkeypatch.setenv("MINISPEC_FORM", "ik")
    ik = forms.GgmlWeight(kind, torch.from_numpy(raw), k)
    assert ik._run[1] != TILES[kind]
    other = ik(x[:4])
    assert not torch.equal(other, alone[:4]) and (other - alone[:4]).abs().max() <= 1e-5 * alone[:4].abs().max()


@needs_library
def test_wrong_block_bytes_are_one_line_errors():
    with pytest.raises(ValueError, match="rows of 288 bytes") as e:
        forms.GgmlWeight("q4_k", torch.zeros(4, 287, dtype=torch.uint8), 512)
    assert "\n" not in str(e.value)


def test_without_the_library_one_line_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(ggml, "_library", lambda: None)
    monkeypatch.setattr(ggml, "_iqk_library", lambda: None)
    monkeypatch.setattr(ggml, "_told", False)
    assert not ggml.available() and not ggml.available()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not built" in err


class StandIn:
    """A stand-in library whose product scales a row by 1 + skew in a pass of several rows: skew 0 gives every row
    its bits alone; a skew gives it others (as ik's one-row shortcuts did), what the load-time check must refuse."""

    def __init__(self, skew: float):
        self.skew, self._handle = skew, id(self)

    def ms_vec_dot_type(self, type_id):
        return 0

    def ms_row_size(self, type_id, k):
        return 4 * k

    def ms_matmul(self, type_id, w, n, k, x, rows, y, scratch, threads):
        import ctypes
        xs = torch.frombuffer((ctypes.c_float * (rows * k)).from_address(x), dtype=torch.float32).view(rows, k)
        ys = torch.frombuffer((ctypes.c_float * (rows * n)).from_address(y), dtype=torch.float32).view(rows, n)
        ys.copy_(xs[:, :1].expand(rows, n) * (1 + self.skew * (rows > 1)))
        return 0


def test_the_load_time_check_refuses_a_form_whose_rows_depend_on_the_pass(monkeypatch):
    monkeypatch.setattr(ggml, "_alike", {})
    blocks = torch.zeros(32, 16, dtype=torch.uint8)
    skewed, honest = StandIn(1e-6), StandIn(0.0)  # both alive: the finding is kept per library handle
    assert not ggml.rows_alike(skewed, 12, blocks, 64)
    assert ggml.rows_alike(honest, 12, blocks, 64)


@needs_library
def test_the_product_is_chosen_at_load_and_falls_back_where_ik_has_none(monkeypatch):
    raw = torch.from_numpy(blocks("q4_k", 16, 512, 8))
    monkeypatch.delenv("MINISPEC_PRODUCT", raising=False)
    assert forms.GgmlWeight("q4_k", raw, 512).product_name == ("iqk" if BUILT["iqk"] else "ggml")
    monkeypatch.setenv("MINISPEC_PRODUCT", "fastest")
    with pytest.raises(ValueError, match="MINISPEC_PRODUCT must be one of iqk, ggml") as e:
        forms.GgmlWeight("q4_k", raw, 512)
    assert "\n" not in str(e.value)
    monkeypatch.delenv("MINISPEC_PRODUCT")
    # ik's activation rows are whole groups of 128 values: a Q8_0 matrix of 96 inputs goes to llama.cpp's product
    q8 = torch.from_numpy(blocks("q8_0", 16, 96, 9))
    assert ggml.takes("q8_0", 96) == BUILT["ggml"]
    if BUILT["ggml"]:
        assert forms.GgmlWeight("q8_0", q8, 96).product_name == "ggml"


@needs_library
def test_the_switch_off_multiplies_the_file_values_plainly(product):
    from minispec import kernels
    n, k = 16, 512
    raw = blocks("q4_k", n, k, 8)
    w = forms.GgmlWeight("q4_k", torch.from_numpy(raw), k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    with kernels.plain():
        got = w(x)
    assert torch.equal(got, torch.nn.functional.linear(x, values(raw, "q4_k", n, k)))
    assert not torch.equal(got, w(x))  # on: the activations rounded to Q8_K, another result


@needs_library
def test_a_step_runs_the_products_on_their_threads_and_pytorch_at_one(tmp_path):
    from minispec import threads

    from helpers import kept_blocks, peaked_model
    float_model = peaked_model(seed=3, vocab_size=64, dim=64)
    kept = kept_blocks(float_model, tmp_path / "kept")
    assert kept.ggml_products and not float_model.ggml_products  # the flag the step reads, set at load
    seen = []
    real = forms.GgmlWeight.product

    def product(self, rows):
        seen.append((torch.get_num_threads(), threads._local.threads))
        return real(self, rows)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads.products_at(2):
            assert torch.get_num_threads() == 1 and threads._local.threads == 2
        assert torch.get_num_threads() == 2 and threads._local.threads is None  # the caller's count set back
        with threads.products_at(None):  # a model without ggml's matrices: PyTorch keeps its count
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), threads.products_at(2):
            raise RuntimeError("a failed step")
        forms.GgmlWeight.product = product
        try:
            kept.generate([1, 2, 3], max_new_tokens=2)
        finally:
            forms.GgmlWeight.product = real
        assert seen and all(torch_n == 1 and own >= 1 for torch_n, own in seen)  # PyTorch at one in every step
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@needs_library
@pytest.mark.parametrize("kind", ["q8_0", "q5_0"])
def test_quantize_writes_blocks_that_gguf_reads_back_within_their_step(kind):
    """ggml.quantize (a feature draft's Q8_0 products): each block's values within half its step of the input, the
    blocks as gguf's own dequantizer reads them."""
    n, k = 48, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    blocks = ggml.quantize(kind, w)
    assert blocks.shape == (n, ggml.row_bytes(kind, k)) and blocks.dtype == torch.uint8
    back = torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType,
                                                                                    kind.upper())))).reshape(n, k)
    levels = 127 if kind == "q8_0" else 16  # q8_0: d = amax / 127, q in -127..127; q5_0: d = amax / 16, q in -16..15
    step = w.view(n, -1, 32).abs().amax(-1, keepdim=True) / levels
    # half a step (q5_0: a whole one, its range -16..15 a step short on one side), plus d rounded to fp16 (2^-11 of
    # it) times the largest |q|
    err = (back.view(n, -1, 32) - w.view(n, -1, 32)).abs()
    assert (err <= step * ((0.5 if kind == "q8_0" else 1.0) + levels * 2.0 ** -11)).all()
    assert (err > step * 0.25).any()  # the bound is not vacuous: values do round
    with pytest.raises(ValueError, match="quantizes"):
        ggml.quantize("q8_0", torch.randn(4, 100))  # not whole blocks
    with pytest.raises(ValueError, match="quantizes"):
        ggml.quantize("q4_k", w)  # a type that would need more than the plain quantizer
