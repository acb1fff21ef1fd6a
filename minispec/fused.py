"""A kept model's transformer blocks in one compiled call a pass (native/ms_layer.h, in each product library).

In a decode step of a kept 1.5B, about a third of the time went to the work between its products: a few hundred
PyTorch calls a layer (norms, RoPE, the cache write, attention, SwiGLU, the residuals), each with its dispatch
cost, and a ctypes call a product. `Blocks` hands the whole trunk to `ms_blocks_forward`, which computes the same
maths (model.py states it) with the products of the matrices' own libraries and attention row by row over each
row's key list, every row alone: a row's bits depend neither on the other rows of the pass nor on the thread
count, so a verify pass still gives every position what a decode step gives it (tests/test_fused.py).

It is used only where it computes what the model asks: fast paths on, a kept model (`rows_alike`) whose every
block multiplies through one library's compiled products (q, k and v stacked or side by side), fp32 activations
and an fp32 cache on the CPU; `Blocks.build` returns None otherwise and the model runs its PyTorch blocks. One
library: each has its own thread pool, whose workers spin a while after its work, and two pools taking turns
within a pass fight for the cores (a decode step took 7x as long).
"""

from __future__ import annotations

import ctypes

import torch

from . import forms
from .forms import Stacked

i64, f32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)


class _Product(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("w", ctypes.c_void_p), ("n", i64), ("k", i64), ("x_row", i64),
                ("type", ctypes.c_int32)]


class _Block(ctypes.Structure):
    _fields_ = [("dim", i64), ("n_heads", i64), ("n_kv_heads", i64), ("head_dim", i64), ("ffn", i64),
                ("eps", ctypes.c_float), ("n_qkv", ctypes.c_int32), ("norm1", ctypes.c_void_p),
                ("norm2", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("qkv", _Product * 3), ("o", _Product),
                ("gate", _Product), ("up", _Product), ("down", _Product)]


class _Pass(ctypes.Structure):
    _fields_ = [("rows", i64), ("threads", ctypes.c_int32), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("pool", ctypes.c_void_p), ("pool_stride", i64), ("write_slot", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("key_start", ctypes.c_void_p), ("key_count", ctypes.c_void_p),
                ("x", ctypes.c_void_p)]


def _library(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """`lib` (the library every block's products come from) where it has the compiled blocks, else None."""
    if not hasattr(lib, "ms_blocks_forward"):
        return None
    lib.ms_blocks_forward.argtypes = [ctypes.c_void_p, i64, ctypes.POINTER(_Pass)]
    return lib


def _product(w) -> _Product | None:
    if not isinstance(w, forms.GgmlWeight):
        return None
    matmul, type_id, x_row = w._run
    blocks = w.blocks if w.repacked is None else w.repacked
    return _Product(ctypes.cast(matmul, ctypes.c_void_p).value, blocks.data_ptr(), w.shape[0], w.shape[1], x_row,
                    type_id)


def _matrices(layer) -> list:
    """A block's matrices, q, k and v apart."""
    qkv = layer.self_attn.qkv_proj.weight
    return (qkv.parts if isinstance(qkv, Stacked) else [qkv]) + [
        layer.self_attn.o_proj.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]


def _float(t: torch.Tensor | None) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
                         and t.device.type == "cpu")


class Blocks:
    """A model's blocks as `ms_blocks_forward` takes them (built once, by `build`); `run` computes a pass."""

    def __init__(self, lib: ctypes.CDLL, blocks, keep: list):
        self.lib, self.blocks, self._keep = lib, blocks, keep

    @classmethod
    def build(cls, model) -> Blocks | None:
        """The model's blocks for the compiled call, or None where it cannot compute them all (see the module)."""
        cfg = model.config
        if not model.rows_alike or not model.ggml_products or cfg.n_heads % cfg.n_kv_heads:
            return None
        blocks, keep, libs = (_Block * len(model.layers))(), [], {}
        for block, layer in zip(blocks, model.layers):
            matrices, attn = _matrices(layer), layer.self_attn
            parts, products = matrices[:-4], [_product(w) for w in matrices]
            floats = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qkv_proj.bias]
            if None in products or len(parts) not in (1, 3) or not all(_float(t) for t in floats):
                return None
            block.dim, block.n_heads, block.n_kv_heads = cfg.dim, cfg.n_heads, cfg.n_kv_heads
            block.head_dim, block.ffn, block.eps, block.n_qkv = cfg.head_dim, cfg.ffn_dim, cfg.norm_eps, len(parts)
            block.norm1, block.norm2 = floats[0].data_ptr(), floats[1].data_ptr()
            block.qkv_bias = None if floats[2] is None else floats[2].data_ptr()
            for i, p in enumerate(products[:len(parts)]):
                block.qkv[i] = p
            block.o, block.gate, block.up, block.down = products[len(parts):]
            keep += matrices + floats  # the pointers' owners stay alive with the blocks
            libs.update((id(w.lib), w.lib) for w in matrices)
        # one library for every product and the blocks' own work: each library has its own thread pool, whose
        # workers spin a while after its work, so two pools taking turns within a pass would fight for the cores
        lib = _library(next(iter(libs.values()))) if len(libs) == 1 else None
        return None if lib is None else cls(lib, blocks, keep)

    @staticmethod
    def takes(x: torch.Tensor, kv: torch.Tensor) -> bool:
        """Whether a pass with activations x over the cache pool kv is one the compiled blocks compute."""
        return (x.dtype == torch.float32 and kv.dtype == torch.float32 and kv.device.type == "cpu"
                and kv.is_contiguous())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, meta, threads: int
            ) -> torch.Tensor:
        """Every block over x (B, T, dim) at the positions whose RoPE rows are cos, sin (B, T, 1, D), reading and
        writing the pool kv (n_layers, slots, 2 Hkv, D) where meta says; returns the residual stream after them."""
        B, T, dim = x.shape
        x = x.reshape(B * T, dim).contiguous().clone()
        cos, sin = cos.reshape(B * T, -1).contiguous(), sin.reshape(B * T, -1).contiguous()
        write = torch.full((B * T,), -1, dtype=torch.int64)
        write[meta.valid.reshape(-1)] = meta.write_slots.to(torch.int64)
        read = meta.read_slots.to(torch.int64).contiguous()
        L = read.shape[1]
        start = (torch.arange(B, dtype=torch.int64) * L).repeat_interleave(T)
        ends = meta.row_ends()
        if meta.keys is None:  # every row a chain token: its first n slots
            count = torch.tensor(ends, dtype=torch.int64).reshape(-1)
            keys = read.reshape(-1)
        else:  # a tree token's slots gathered after the table
            count, extra, at = [], [read.reshape(-1)], B * L
            for b, row in enumerate(ends):
                for t, n in enumerate(row):
                    if isinstance(n, torch.Tensor):
                        extra.append(read[b, n.to(read.device)])
                        start[b * T + t] = at
                        at += len(n)
                        count.append(len(n))
                    else:
                        count.append(n)
            count, keys = torch.tensor(count, dtype=torch.int64), torch.cat(extra)
        p = _Pass(B * T, threads, cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), kv[0].numel() if len(kv) else 0,
                  write.data_ptr(), keys.data_ptr(), start.data_ptr(), count.data_ptr(), x.data_ptr())
        rc = self.lib.ms_blocks_forward(ctypes.addressof(self.blocks), len(self.blocks), ctypes.byref(p))
        if rc:
            raise MemoryError("the compiled blocks could not allocate a pass's buffers") if rc == -1 else \
                RuntimeError("a compiled product refused its matrix's type")
        return x.view(B, T, dim)
