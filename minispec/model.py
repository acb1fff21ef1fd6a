"""A Llama-family decoder-only transformer, written from scratch.

RMSNorm, rotary position embeddings (rotate-half, as in Hugging Face's Llama), grouped-query attention,
SwiGLU feed-forward, tied or untied lm_head. Module names follow the Hugging Face checkpoint names
(without the "model." prefix), so converting a checkpoint is a rename, not a reshuffle. `model(tokens)`
is a full causal forward that keeps no state; `model.step(cache, seqs, new_tokens)` appends ragged new
tokens to the sequences' paged KV cache (prefill and decode). The data flow: docs/design.md.

The maths is here; how a CPU computes each product, attention and norm fastest is in minispec.kernels
(`kernels.linear`, `kernels.attention`, `kernels.rms_norm`), which one switch turns off.

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoFormer), Ainslie et al. 2023 (GQA),
Shazeer 2020 (GLU variants), Kwon et al. 2023 (PagedAttention).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fused, kernels, passes
from .cache import PagedKVCache
from .checkpoint import load_pretrained, save_pretrained
from .config import DTYPES, ModelConfig
from .errors import check_token_ids, resolve_device, resolve_dtype
from .forms import Int4Weight, KeptEmbedding, PackedWeight, int4_supported, set_weight
from .generate import generate
from .passes import AttentionMetadata
from .speculative import speculate
from .threads import product_threads, products_at, tuned


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), over the last axis (normalised in fp32: kernels.rms_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, rows_alike: bool = False) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, rows_alike)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama-3 style scaling when configured."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    llama3 = cfg.llama3_rope()
    if llama3 is not None:
        factor, lo, hi, old_len = llama3
        wavelen = 2 * math.pi / inv_freq
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (B, T, H, D); cos, signed_sin: (B, T, 1, D).

    Hugging Face writes x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Here the sign
    lives in the table (signed_sin = cat(-sin, sin)), so rotate_half is a roll by D/2: 3 kernels, not 6.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def fuse_projections(module: nn.Module, fused: str, parts: tuple[str, ...], sizes: list[int]) -> None:
    """Keep the linear layers `parts` (same input, no bias or all biases) as one nn.Linear `fused`.

    One matrix-vector product instead of several in every decode step. The rows of `module.<fused>` are
    the parts' rows, stacked in order (`sizes` rows each), and state_dict() / load_state_dict() still use
    the part names (the Hugging Face names), so checkpoints and converters never see the fusion.
    """
    def split(mod, state_dict, prefix, local_metadata) -> None:
        items = list(state_dict.items())
        state_dict.clear()
        for name, t in items:
            if not name.startswith(f"{prefix}{fused}."):
                state_dict[name] = t
                continue
            kind = name[len(f"{prefix}{fused}."):]
            for part, piece in zip(parts, t.split(sizes)):
                state_dict[f"{prefix}{part}.{kind}"] = piece.clone()  # own storage: safetensors refuses shared tensors

    def fuse(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for kind in ("weight", "bias"):
            names = [f"{prefix}{part}.{kind}" for part in parts]
            if all(n in state_dict for n in names):
                pieces = [state_dict.pop(n) for n in names]
                if all(t.dim() == pieces[0].dim() and t.shape[1:] == pieces[0].shape[1:] for t in pieces):
                    state_dict[f"{prefix}{fused}.{kind}"] = torch.cat(pieces)
                else:  # let load_state_dict report the mismatch under the fused name
                    error_msgs.append(f"{prefix}{'/'.join(parts)}.{kind} shapes {[tuple(t.shape) for t in pieces]} "
                                      "cannot be stacked into one projection")

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(fuse)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache (or, with no cache, plain causal attention).

    q, k and v come from one fused projection `qkv_proj` (rows: the H query heads, then the
    Hkv key heads, then the Hkv value heads); checkpoints keep q_proj / k_proj / v_proj.
    """

    PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # the checkpoint's names of qkv_proj's parts, in its row order

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.dim, (H + 2 * Hkv) * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.dim, bias=False)
        fuse_projections(self, "qkv_proj", self.PROJECTIONS, [H * D, Hkv * D, Hkv * D])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pool: torch.Tensor | None, meta: AttentionMetadata | None, rows_alike: bool = False,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attn_mask: with no cache only, a boolean (T, T) mask (True: attend) in place of the causal one."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).view(B, T, H + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :, :H + Hkv], cos, sin)  # queries and keys rotated together: (B, T, H+Hkv, D)
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
        if pool is None:  # full forward over exactly these tokens: causal, or as attn_mask says
            k, v = qk[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)  # (B, Hkv, T, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                                 enable_gqa=H != Hkv)
        else:
            # write the valid new tokens' K and V (side by side: (.., 2*Hkv, D)) into their pool
            # slots (pool: (num_slots, 2*Hkv, D), this layer's), then read each sequence's whole context
            k_new, v_new = qk[:, :, H:], qkv[:, :, H + Hkv:]  # (B, T, Hkv, D) each
            if meta.read_range is not None:  # one sequence in consecutive slots, the new tokens last: views only
                first, end = meta.read_range
                torch.cat((k_new[0], v_new[0]), dim=1, out=pool[end - T:end])  # straight into its slots (and dtype)
                ctx = pool[first:end].unsqueeze(0)
            else:
                kv = torch.cat((k_new, v_new), dim=2)  # (B, T, 2*Hkv, D); the pool's dtype on assignment
                pool[meta.write_slots] = kv[:, 0] if T == 1 else kv[meta.valid]
                ctx = pool.index_select(0, meta.read_slots.view(-1)).view(B, -1, 2 * Hkv, D)
            ctx = ctx.to(q.dtype).transpose(1, 2)  # (B, 2*Hkv, L, D)
            # rows computed alone: a kept quantization's, and a tree's on the row-wise path (each over its own keys)
            alone = rows_alike or meta.keys is not None and kernels.attends_row_wise(q)
            out = kernels.attention(q, ctx, meta.mask, Hkv, meta.row_ends() if alone else None)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return kernels.linear(out, self.o_proj.weight)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)).

    gate and up stay two products: fusing them like q/k/v would copy their weights out of the memory-mapped
    checkpoint (whose pages stay resident too) for no measured speed-up (docs/benchmarks.md, "Product forms").
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(kernels.linear(x, self.gate_proj.weight)) * kernels.linear(x, self.up_proj.weight)
        return kernels.linear(h, self.down_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, pool, meta, rows_alike: bool = False, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x, rows_alike), cos, sin, pool, meta, rows_alike, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x, rows_alike))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        device, dtype = resolve_device(device), resolve_dtype(dtype, DTYPES)  # before any weight is made
        self.config = cfg = config
        self.tokenizer = None  # attached by from_pretrained when the checkpoint has one
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        head = cfg.head_vocab_size or cfg.vocab_size
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, head, bias=False)
        # a subset head scores only head_ids; every other token gets probability 0, which keeps speculation exact
        self.register_buffer("head_ids", torch.arange(head) if cfg.head_vocab_size else None)
        # a tied head's packed form (to_int4, or a kept quantization: minispec.quantized); the lookup keeps its own
        self.head_packed: PackedWeight | None = None
        # every pass computes a position exactly as a one-token pass does: norms and attention row by row (the
        # products' forms do their part: minispec.forms.make_rows_alike sets this for a kept model)
        self.rows_alike = False
        self.ggml_products = False  # some matrices multiplied by ggml's kernels (forms.install sets it)
        self._fused: fused.Blocks | None | bool = False  # the blocks as one compiled call, built at the first pass
        self.apply(self._init_weights)
        self.init_rope()
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self.eval()

    def to_int4(self) -> Transformer:
        """Every product in int4 (Int4Weight, on a CPU), everything else in fp32: a draft's fastest form on a
        CPU. In place, one matrix at a time (a matrix of a shape the kernel does not take stays float); returns
        self. Such a model is not saved: save the checkpoint it came from, with int4 set in its config.json."""
        if not int4_supported(self.device):
            raise ValueError(f"int4 products need PyTorch's CPU int4 kernel; this model is on {self.device}")
        linears = [m for layer in self.layers for m in layer.modules() if isinstance(m, nn.Linear)]
        for m in linears + ([self.lm_head] if self.lm_head is not None else []):
            if isinstance(m.weight, torch.Tensor) and Int4Weight.fits(m.weight.shape):
                set_weight(m, Int4Weight(m.weight))
        embedding = getattr(self.embed_tokens, "weight", None)
        if self.lm_head is None and self.head_packed is None and isinstance(embedding, torch.Tensor) and \
                Int4Weight.fits(embedding.shape):  # tied: the lookup stays float
            self.head_packed = Int4Weight(embedding)
        self.config.int4 = True
        return self.to(torch.float32)

    def weight_count(self) -> int:
        """How many values the weights hold, whatever their form: float parameters (each tensor once), a packed
        matrix (int4, int8, row-wise, stacked: `to_int4` or a kept quantization) by its shape, a kept embedding
        table by its rows times the width. A tied head's packed form is the embedding's, counted once."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        n += sum(math.prod(m.weight.shape) for m in self.modules() if isinstance(getattr(m, "weight", None),
                                                                                 PackedWeight))
        return n + sum(m.num_embeddings * self.config.dim for m in self.modules() if isinstance(m, KeptEmbedding))

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)set the RoPE cos/sin tables: empty buffers (never saved) that grow with use, to the longest
        sequence seen so far, not max_seq_len (a config may allow millions of positions: gigabytes of table)."""
        empty = torch.empty(0, self.config.head_dim, device=device)
        self.register_buffer("rope_cos", empty, persistent=False)  # (S, D): rotate-half layout
        self.register_buffer("rope_sin", empty.clone(), persistent=False)  # signed: see apply_rope

    def _rope_tables(self, end: int) -> None:
        """Make the RoPE tables cover positions [0, end): rebuilt for at least twice their length, at most
        max_seq_len."""
        have = self.rope_cos.shape[0]
        if end <= have:
            return
        if end > self.config.max_seq_len:
            raise ValueError(f"position {end - 1} is past max_seq_len={self.config.max_seq_len}")
        n = min(max(end, 2 * have, 64), self.config.max_seq_len)
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable outside inference mode too
            # fp32 angles on the CPU, their cos/sin in fp64 rounded to fp32: a position's values depend on neither
            # the table's length nor the device (regrowing changes no row); then the model's device and dtype
            angles = torch.outer(torch.arange(n, dtype=torch.float32), rope_frequencies(self.config))  # (S, D/2)
            angles = angles.double()
            cos, sin = angles.cos().float(), angles.sin().float()
            like = dict(device=self.rope_cos.device, dtype=self.rope_cos.dtype)
            self.rope_cos = torch.cat((cos, cos), dim=-1).to(**like)
            self.rope_sin = torch.cat((-sin, sin), dim=-1).to(**like)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # the final norm: a float parameter in every form of the model

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def _rope(self, positions: torch.Tensor, end: int | None = None):
        # positions: (B, T) -> cos, sin: (B, T, 1, D) in the activations' dtype. end: a bound on the
        # positions when the caller knows it (no read of the positions back from the device)
        self._rope_tables(int(positions.max()) + 1 if end is None and positions.numel() else end or 0)
        cos = self.rope_cos[positions].unsqueeze(2).to(self.dtype)
        sin = self.rope_sin[positions].unsqueeze(2).to(self.dtype)
        return cos, sin

    def _trunk(self, tokens, positions, kv: torch.Tensor | None = None, meta: AttentionMetadata | None = None):
        """Tokens (B, T) at `positions` -> final hidden states (B, T, dim).

        kv: the cache's pool (n_layers, num_slots, 2*Hkv, D), meta: where to write and read in it (both None:
        a full causal forward)."""
        x = self.embed_tokens(tokens)  # (B, T, dim)
        # read_slots: (B, L), and L is past every position
        cos, sin = self._rope(positions, None if meta is None else meta.read_slots.shape[1])
        if kv is not None and self.rows_alike and kernels.enabled():
            if self._fused is False:  # a kept model's blocks are final by its first pass (minispec.fused)
                self._fused = fused.Blocks.build(self)
            if self._fused is not None and self._fused.takes(x, kv):
                return self.norm(self._fused.run(x, cos, sin, kv, meta, product_threads()), self.rows_alike)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if kv is None else kv[i], meta, self.rows_alike)
        return self.norm(x, self.rows_alike)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (..., dim) -> logits (..., vocab); padding ids (config.sampled_vocab_size) get -inf."""
        w = self.head_packed or (self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        out = kernels.linear(h, w)
        if self.head_ids is not None:  # a subset head: every other id gets -inf
            out = h.new_full((*h.shape[:-1], self.config.vocab_size), float("-inf")).index_copy_(-1, self.head_ids, out)
        if (n := self.config.sampled_vocab_size) is not None:
            out[..., n:] = float("-inf")  # rows that are no token: probability 0, in the target and the draft alike
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full causal forward: tokens (B, T) -> logits (B, T, vocab). Keeps no state."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.config.max_seq_len}")
        check_token_ids(tokens, self.config.vocab_size)
        tokens = tokens.to(self.device)
        positions = torch.arange(T, device=self.device).expand(tokens.shape[0], T)
        with kernels.resolved():
            return self.logits(self._trunk(tokens, positions)).float()

    def new_cache(self, num_blocks: int | None = None, block_size: int = 16, memory_bytes: int | None = None,
                  dtype: torch.dtype | None = None, max_blocks: int | None = None) -> PagedKVCache:
        """A paged cache for this model: a fixed pool (num_blocks, or as many as memory_bytes holds) or, given
        neither, one that grows by blocks as its sequences do (up to max_blocks when given)."""
        c = self.config
        return PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, num_blocks=num_blocks, block_size=block_size,
                            memory_bytes=memory_bytes, dtype=dtype or self.dtype, device=self.device,
                            max_blocks=max_blocks)

    @torch.inference_mode()
    def step(self, cache: PagedKVCache, seqs: list[int], new_tokens: list[list[int]],
             all_logits: bool = False, hidden: bool = False, parents: list[list[int] | None] | None = None
             ) -> torch.Tensor:
        """Append new_tokens[b] to sequence seqs[b] in `cache` and run them through the model (prefill: the
        whole prompt). Returns fp32 logits: (B, vocab) for each sequence's last new token, or with all_logits
        (B, T, vocab) for every new token (right-padded to T = max length); with hidden, the final (normed)
        hidden states (B, T, dim), for a caller that applies `logits()` only where it needs them. parents (a tree
        round): each new token's parent index in its sequence (passes.prepare): it attends its ancestors
        only, at the position of its depth."""
        n_new = [len(t) for t in new_tokens]
        if min(n_new) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        for s, n in zip(seqs, n_new):
            if cache.length(s) + n > self.config.max_seq_len:
                raise ValueError(f"sequence {s} would reach {cache.length(s) + n} tokens, "
                                 f"past max_seq_len={self.config.max_seq_len}")
        T = max(n_new)
        padded = torch.tensor([list(t) + [0] * (T - len(t)) for t in new_tokens], dtype=torch.long)  # (B, T)
        check_token_ids(padded, self.config.vocab_size)
        meta = passes.prepare(cache, seqs, n_new, parents)
        if meta.mask is not None:  # additive, in the activations' dtype: built once here, not in every layer
            meta.mask = torch.zeros(meta.mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~meta.mask, float("-inf"))
        # the thread count is chosen per kind of step by its measured times, within the caller's (minispec.threads)
        kind = (self.config.dim, self.config.n_layers, self.config.int4, self.rows_alike, len(seqs), T)
        with tuned(kind, self.device) as n, kernels.resolved(), products_at(n if self.ggml_products else None):
            h = self._trunk(padded.to(self.device), meta.positions, cache.kv, meta)  # (B, T, dim)
            if hidden:
                return h
            if all_logits:
                return self.logits(h).float()
            if min(n_new) == T:  # every sequence's last new token is in the last column
                return self.logits(h[:, -1]).float()  # (B, vocab)
            last = torch.tensor(n_new, device=h.device) - 1
            return self.logits(h[torch.arange(len(seqs), device=h.device), last]).float()  # (B, vocab)

    # checkpoints and generation live in their own modules: the functions are the methods

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None, int4: bool | None = None) -> Transformer:
        """checkpoint.load_pretrained, with `device` and `dtype` checked (resolve_device, resolve_dtype) first."""
        return load_pretrained(cls, path, device=resolve_device(device), dtype=resolve_dtype(dtype, DTYPES), int4=int4)

    save_pretrained = save_pretrained  # model.save_pretrained(dir, dtype=None)
    generate = generate  # model.generate(prompts, max_new_tokens=64, temperature=0.0, ...)
    speculate = speculate  # model.speculate(draft, prompts, k=4, ...)
