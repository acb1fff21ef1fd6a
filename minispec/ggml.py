"""A GGUF's quantized matrices multiplied as stored, by llama.cpp's own ggml CPU kernels.

`GgmlWeight` holds an (N, K) matrix as the file's blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...: one uint8 row of
blocks per output) and computes x @ w.T through a small compiled library (native/ggml_shim.c, built by
tools/build_ggml.py into this package as `libminispec_ggml.so`): each activation row is quantized to the
kernel's activation type (Q8_K for the K-quants, Q8_0 for Q5_0 and Q8_0, as llama.cpp does) and every output
is one ggml `vec_dot` of one weight row with one activation row. So a row's bits never depend on how many rows
share the pass or on the thread count, and a pass of 1 to 16 rows reads each weight row from memory once.

`available()` says whether the library is built and loads; when it is not (no compiler or source at install
time, another CPU architecture), `available()` is False, a one-line notice says so at first use, and the kept
matrices compute in PyTorch instead (minispec.quantized).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from . import kernels
from .forms import PackedWeight

LIBRARY = Path(__file__).resolve().parent / "libminispec_ggml.so"

# ggml's type ids (ggml.h's enum ggml_type, the ids a GGUF stores) for the types a kept matrix may have:
# name -> (id, values a block, bytes a block)
TYPES = {"q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "q8_0": (8, 32, 34),
         "q2_k": (10, 256, 84), "q3_k": (11, 256, 110), "q4_k": (12, 256, 144), "q5_k": (13, 256, 176),
         "q6_k": (14, 256, 210)}
MAX_ROWS = 64  # rows a pass multiplies against the weight at once; more go in further passes (a prefill)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if sys.platform != "linux" or not LIBRARY.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:
        return None
    lib.ms_vec_dot_type.argtypes = [ctypes.c_int]
    lib.ms_row_size.argtypes, lib.ms_row_size.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_size_t
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ms_matmul.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, p, ctypes.c_int]
    lib.ms_dequantize.argtypes = [ctypes.c_int, p, i64, i64, p]
    lib.ms_repackable.argtypes = [ctypes.c_int, i64, i64]
    lib.ms_repack.argtypes = [ctypes.c_int, p, i64, i64, p]
    lib.ms_matmul_repacked.argtypes = lib.ms_matmul.argtypes
    lib.ms_init()
    return lib


_told = False
_local = threading.local()  # the product's own thread count inside a model step (`threads_for`), per caller thread


@contextlib.contextmanager
def threads_for(n: int | None):
    """A step, at n threads, of a model whose matrices are (some of them) ggml's: the products run on their own
    n threads and PyTorch at one thread meanwhile (PyTorch's OpenMP threads spin between regions on the very
    cores the products' threads need: 2.8x slower steps measured at two and two), then PyTorch's count is set
    back. n None: nothing changes."""
    if n is None:
        yield
        return
    caller, before = torch.get_num_threads(), getattr(_local, "threads", None)
    _local.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(caller)
        _local.threads = before


def available() -> bool:
    """Whether the compiled product loads here; the first time it does not, one line on stderr says so."""
    global _told
    lib = _library()
    if lib is None and not _told:
        _told = True
        print(f"minispec: the quantized product ({LIBRARY.name}) is not built or does not load here; kept "
              "matrices compute in PyTorch (slower; `python tools/build_ggml.py` builds it)", file=sys.stderr)
    return lib is not None


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of k values of type `kind`."""
    _, values, size = TYPES[kind]
    return k // values * size


class GgmlWeight(PackedWeight):
    """An (N, K) matrix as a GGUF stores it, `blocks` uint8 (N, row bytes), multiplied by ggml's kernels."""

    __slots__ = ("blocks", "kind", "type_id", "repacked")

    def __init__(self, kind: str, blocks: torch.Tensor, k: int, repack: bool = True):
        lib = _library()
        if lib is None:
            raise RuntimeError(f"{LIBRARY.name} is not built")
        self.kind, self.type_id = kind, TYPES[kind][0]
        if lib.ms_vec_dot_type(self.type_id) < 0:
            raise ValueError(f"ggml has no CPU product for {kind}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(kind, k):
            raise ValueError(f"a {kind} matrix of {k} inputs has rows of {row_bytes(kind, k)} bytes, got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        self.blocks, self.shape = blocks.contiguous(), (blocks.shape[0], k)
        # a Q4_K matrix on AVX2: also in the form llama.cpp repacks it to there (eight rows interleaved), whose
        # one-row product is faster; `blocks` stays the file's form (the switch-off path reads it)
        self.repacked = None
        if repack and lib.ms_repackable(self.type_id, *self.shape):
            packed = torch.empty_like(self.blocks)
            if lib.ms_repack(self.type_id, self.blocks.data_ptr(), *self.shape, packed.data_ptr()) == 0:
                self.repacked = packed

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        lib, (n, k) = _library(), self.shape
        x = rows.reshape(-1, k).to(torch.float32).contiguous()
        if not kernels.enabled():  # the switch off: the file's values in float, the plain product
            return F.linear(x, dequantize(self.kind, self.blocks, k))
        y = torch.empty(x.shape[0], n)
        scratch = torch.empty(min(x.shape[0], MAX_ROWS) * lib.ms_row_size(lib.ms_vec_dot_type(self.type_id), k),
                              dtype=torch.uint8)
        threads = getattr(_local, "threads", None) or torch.get_num_threads()
        matmul, w = (lib.ms_matmul, self.blocks) if self.repacked is None else (lib.ms_matmul_repacked, self.repacked)
        for i in range(0, x.shape[0], MAX_ROWS):
            part = x[i:i + MAX_ROWS]
            matmul(self.type_id, w.data_ptr(), n, k, part.data_ptr(), part.shape[0], y[i:i + MAX_ROWS].data_ptr(),
                   scratch.data_ptr(), threads)
        return y


def dequantize(kind: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """ggml's own dequantization of an (N, row bytes) block matrix (for tests; the library must be built)."""
    out = torch.empty(blocks.shape[0], k)
    if _library().ms_dequantize(TYPES[kind][0], blocks.contiguous().data_ptr(), blocks.shape[0], k,
                                out.data_ptr()) != 0:
        raise ValueError(f"ggml cannot dequantize {kind}")
    return out
