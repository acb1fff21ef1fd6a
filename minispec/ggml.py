"""The compiled products that multiply a GGUF's quantized matrices as stored, by llama.cpp's or ik_llama.cpp's CPU
kernels: the two small libraries (tools/build_ggml.py builds them into this package), loaded here, and the
choice between them for a matrix (`product_library`). `forms.GgmlWeight` holds an (N, K) matrix as the file's
blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...: one uint8 row of blocks per output) and computes x @ w.T through one of
them, chosen once, when the matrix is loaded:

- `libminispec_iqk.so` (native/iqk_shim.c): ik_llama.cpp's row-tiled product, iqk_mul_mat, which unpacks each
  weight block once for a tile of up to 8 activation rows (a verify pass's rows nearly share one decode step's
  cost); each activation row quantized alone to the type its kernel takes (Q8_2_X4 for the K-quants on x86).
  The default wherever it is built and takes the matrix's type. On a CPU with AVX-512 VNNI its Q4_K and Q6_K
  matrices are interleaved at load into minispec's own 16-row tiles instead (native/ms_rows.h: one 512-bit
  register holds four values of each of 16 weight rows, multiplied by vpmaddubsw / vpmaddwd against an
  activation row's int8 values broadcast); `MINISPEC_FORM=ik` at load keeps ik's interleaved forms, to compare.
- `libminispec_ggml.so` (native/ggml_shim.c): llama.cpp's ggml, every output one `vec_dot` of one weight row
  with one activation row (Q8_K for the K-quants), Q4_K repacked as llama.cpp does on AVX2.

Either way a row's bits never depend on how many rows share the pass or on the thread count
(tests/test_ggml.py checks both, and `rows_alike` ik's forms at load), so a verify pass gives every position the
bits a decode step gives it.
`MINISPEC_PRODUCT=ggml` (or `iqk`) picks a library for the matrices loaded after it is set; unset, iqk where it
can. `available()` says whether either library loads; when neither does (no compiler or source at install time,
another CPU architecture), a one-line notice says so at first use, and the kept matrices compute in PyTorch
instead (minispec.forms).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "libminispec_ggml.so"
IQK_LIBRARY = LIBRARY.with_name("libminispec_iqk.so")
PRODUCTS = ("iqk", "ggml")  # MINISPEC_PRODUCT's values, in the order an unset one tries them

# ggml's type ids (ggml.h's enum ggml_type, the ids a GGUF stores) for the types a kept matrix may have:
# name -> (id, values a block, bytes a block)
TYPES = {"q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "q8_0": (8, 32, 34),
         "q2_k": (10, 256, 84), "q3_k": (11, 256, 110), "q4_k": (12, 256, 144), "q5_k": (13, 256, 176),
         "q6_k": (14, 256, 210)}
MAX_ROWS = 64  # rows a pass multiplies against the weight at once; more go in further passes (a prefill)


@functools.cache
def _load(path: Path) -> ctypes.CDLL | None:
    if sys.platform != "linux" or not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ms_vec_dot_type.argtypes = [ctypes.c_int]
    lib.ms_row_size.argtypes, lib.ms_row_size.restype = [ctypes.c_int, i64], ctypes.c_size_t
    lib.ms_matmul.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, p, ctypes.c_int]
    lib.ms_repack.argtypes = [ctypes.c_int, p, i64, i64, p]
    lib.ms_dequantize.argtypes = [ctypes.c_int, p, i64, i64, p]
    if hasattr(lib, "ms_quantize"):
        lib.ms_quantize.argtypes = [ctypes.c_int, p, i64, i64, p]
    if hasattr(lib, "ms_rows_built"):  # ik's library: minispec's own tiles compiled in or not
        lib.ms_rows_built.restype = ctypes.c_int
    if hasattr(lib, "ms_repackable"):  # llama.cpp's: its repacked Q4_K product
        lib.ms_repackable.argtypes = [ctypes.c_int, i64, i64]
        lib.ms_matmul_repacked.argtypes = lib.ms_matmul.argtypes
    lib.ms_init()
    return lib


def _library() -> ctypes.CDLL | None:
    """llama.cpp's product (libminispec_ggml.so), or None where it is not built or does not load."""
    return _load(LIBRARY)


def _iqk_library() -> ctypes.CDLL | None:
    """ik_llama.cpp's row-tiled product (libminispec_iqk.so), or None where it is not built or does not load."""
    return _load(IQK_LIBRARY)


def product_library(type_id: int, k: int, sample: torch.Tensor | None = None) -> tuple[str, ctypes.CDLL] | None:
    """The library that multiplies a matrix of ggml type `type_id` and k inputs here, with its name: the one
    MINISPEC_PRODUCT names, else the first of PRODUCTS that is built and has a product for it; None if none.
    ik's product is taken only where its rows are seen to be independent on this CPU (`rows_alike`, on `sample`,
    some of the matrix's own rows, when given)."""
    want = os.environ.get("MINISPEC_PRODUCT", "").strip()
    if want and want not in PRODUCTS:
        raise ValueError(f"MINISPEC_PRODUCT must be one of {', '.join(PRODUCTS)} (or unset), got {want!r}")
    for name in (want,) if want else PRODUCTS:
        lib = _iqk_library() if name == "iqk" else _library()
        if lib is None or lib.ms_vec_dot_type(type_id) < 0:
            continue
        # ik's x86 activation types group four blocks of 32: rows of whole groups only
        if name == "iqk" and (k % 128 or sample is not None and not rows_alike(lib, type_id, sample, k)):
            continue
        return name, lib
    return None


CHECK_ROWS = 32  # weight rows the load-time check multiplies (a whole number of every interleaved form's rows)
_alike: dict[tuple[int, int], bool] = {}  # (library handle, ggml type) -> rows_alike's finding, once a process


def rows_alike(lib: ctypes.CDLL, type_id: int, blocks: torch.Tensor, k: int) -> bool:
    """Whether `lib`'s product of type `type_id` gives each row of a pass of 2 to 16 rows the bits that row gets
    alone, found once a process on `blocks` (some rows of a real matrix of that type, in the form the product
    takes). ik's kernels take other code for some row counts on some CPUs (its one-row shortcuts, its wider kernels
    on AVX-512): a form that fails here is not used, so a verify pass always computes what decode steps compute."""
    key = (lib._handle, type_id)
    if key not in _alike:
        n, blocks = blocks.shape[0], blocks.contiguous()
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(0))
        scratch = torch.empty(16 * lib.ms_row_size(lib.ms_vec_dot_type(type_id), k), dtype=torch.uint8)

        def product(rows: torch.Tensor) -> torch.Tensor:
            y = torch.empty(rows.shape[0], n)
            lib.ms_matmul(type_id, blocks.data_ptr(), n, k, rows.data_ptr(), rows.shape[0], y.data_ptr(),
                          scratch.data_ptr(), 1)
            return y
        alone = torch.cat([product(x[r:r + 1]) for r in range(16)])
        _alike[key] = all(torch.equal(product(x[:rows]), alone[:rows]) for rows in range(2, 17))
    return _alike[key]


_told = False


def available() -> bool:
    """Whether a compiled product loads here; the first time none does, one line on stderr says so."""
    global _told
    lib = _iqk_library() or _library()
    if lib is None and not _told:
        _told = True
        print(f"minispec: the quantized products ({IQK_LIBRARY.name}, {LIBRARY.name}) are not built or do not "
              "load here; kept matrices compute in PyTorch, slower, Q4_K exactly but Q6_K, Q5_0 and Q8_0 "
              "requantized to int8 rows (within half a step of a row's scale; `python tools/build_ggml.py` builds "
              "them)", file=sys.stderr)
    return lib is not None


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of k values of type `kind`."""
    _, values, size = TYPES[kind]
    return k // values * size


def takes(kind: str, k: int, blocks: torch.Tensor | None = None) -> bool:
    """Whether a built product multiplies a `kind` matrix of k inputs here (given its `blocks`, as `GgmlWeight` would
    choose for them: ik's product only where its rows are alike on this CPU)."""
    return product_library(TYPES[kind][0], k, None if blocks is None else blocks[:CHECK_ROWS]) is not None


def dequantize(kind: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """ggml's own dequantization of an (N, row bytes) block matrix, by whichever library is built (the same
    values: tests/test_ggml.py checks both against gguf's), for tests and the switch-off path."""
    lib = _library() or _iqk_library()
    out = torch.empty(blocks.shape[0], k)
    if lib is None or lib.ms_dequantize(TYPES[kind][0], blocks.contiguous().data_ptr(), blocks.shape[0], k,
                                        out.data_ptr()) != 0:
        raise ValueError(f"ggml cannot dequantize {kind} here")
    return out


def quantize(kind: str, w: torch.Tensor) -> torch.Tensor:
    """A float matrix (N, K) as N rows of `kind` blocks (uint8, N x row bytes), by ggml's own quantizer (Q8_0, Q4_0
    or Q5_0: the block types that need no importance matrix), for a draft whose products should go through the
    compiled product; ValueError where no built library quantizes it."""
    lib = _iqk_library() or _library()
    n, k = w.shape
    out = torch.empty(n, row_bytes(kind, k), dtype=torch.uint8)
    x = w.detach().to(torch.float32).contiguous()
    if lib is None or not hasattr(lib, "ms_quantize") or lib.ms_quantize(TYPES[kind][0], x.data_ptr(), n, k,
                                                                         out.data_ptr()) != 0:
        raise ValueError(f"no built library quantizes a {n} x {k} matrix to {kind} here")
    return out
