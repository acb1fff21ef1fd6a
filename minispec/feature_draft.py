"""A feature draft: one decoder layer that drafts from the target's own hidden states (in the spirit of EAGLE).

After Li et al. 2024 (EAGLE: the draft reads the target's last hidden state and the next token's embedding,
and predicts the next hidden state) and EAGLE-3 (a draft vocabulary of the most frequent tokens). At
position i the draft reads the target's final hidden state f_i (which predicts token i+1) and the target's
embedding of token i+1 (frozen, borrowed from the target), and predicts f_{i+1}; its head scores the
predicted state over its own vocabulary (`head_ids`, target ids), so q is zero outside those tokens and the
acceptance rule stays exact. Drafting further feeds the predicted state back in place of the target's.

`FeatureDraft` is the module (what training fits), `FeatureDrafter` the `Drafter` that speculate drives:
the verify pass hands it the target's hidden states through `Drafter.see_hidden` (drafters.py), so drafting
costs no extra target work. A draft directory holds config.json (`"kind": "feature-draft"`, the layer's
config, the target's width, vocabulary and tokenizer fingerprint) and model.safetensors; the target's
embedding is not stored. `minispec.draft_loader.load_draft` reads it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ggml, kernels, passes
from .cache import PagedKVCache
from .checkpoint import CheckpointError
from .config import ModelConfig
from .drafters import Drafter, add_picks, as_proposal, draw_exact, draw_step
from .errors import GenerationError, is_int, show
from .forms import GgmlWeight, Int4Weight, int4_supported, set_weight
from .model import Block, RMSNorm, Transformer
from .threads import caller_threads, products_at

KIND = "feature-draft"  # config.json's "kind" for a feature draft directory


class FeatureDraft(nn.Module):
    """fc(cat(norm(f_i), norm(embed(x_{i+1})))) -> one decoder layer -> the predicted f_{i+1} (target_dim wide)
    -> lm_head over head_ids. `config` is the layer's (its dim the draft's width, at most the target's); a
    narrower draft maps its output back to the target's width with `up`."""

    def __init__(self, config: ModelConfig, target_dim: int):
        super().__init__()
        if config.dim > target_dim:
            raise ValueError(f"a feature draft's width ({config.dim}) cannot exceed the target's ({target_dim})")
        if config.head_vocab_size is None:
            raise ValueError("a feature draft needs head_vocab_size (its draft vocabulary)")
        self.config, self.target_dim = config, target_dim
        d, eps = config.dim, config.norm_eps
        self.feature_norm = RMSNorm(target_dim, eps)
        self.embed_norm = RMSNorm(target_dim, eps)
        self.fc = nn.Linear(2 * target_dim, d, bias=True)
        self.layer = Block(config)
        self.up = nn.Linear(d, target_dim, bias=False) if d != target_dim else None
        self.lm_head = nn.Linear(target_dim, config.head_vocab_size, bias=False)
        self.register_buffer("head_ids", torch.arange(config.head_vocab_size))  # row -> target token id
        self.init_rope()
        self.eval()

    # the RoPE tables and their lookup are the Transformer's own methods (same fields, same maths)
    init_rope, _rope_tables, _rope = Transformer.init_rope, Transformer._rope_tables, Transformer._rope

    @property
    def device(self) -> torch.device:
        return self.feature_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.feature_norm.weight.dtype

    def forward_states(self, states: torch.Tensor, embeds: torch.Tensor, pool=None, meta=None,
                       positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """states, embeds (B, T, target_dim) -> predicted next states (B, T, target_dim). With no cache (pool None)
        a full pass (training): causal from position 0, or at `positions` under a boolean (T, T) `attn_mask`;
        else over the cache's slots as Transformer.step does."""
        x = kernels.linear(torch.cat((self.feature_norm(states), self.embed_norm(embeds)), -1), self.fc.weight,
                           self.fc.bias)
        if positions is None:
            B, T = states.shape[:2]
            positions = torch.arange(T, device=states.device).expand(B, T)
        cos, sin = self._rope(positions, None if meta is None else meta.read_slots.shape[1])
        x = self.layer(x, cos, sin, pool, meta, attn_mask=attn_mask)
        return x if self.up is None else kernels.linear(x, self.up.weight)

    def head_logits(self, pred: torch.Tensor) -> torch.Tensor:
        """Predicted states (..., target_dim) -> logits over the draft vocabulary (..., head_vocab_size)."""
        return kernels.linear(pred, self.lm_head.weight)

    def logits(self, pred: torch.Tensor) -> torch.Tensor:
        """Predicted states -> fp32 logits over the target's vocabulary: -inf outside head_ids."""
        out = pred.new_full((*pred.shape[:-1], self.config.vocab_size), float("-inf"), dtype=torch.float32)
        return out.index_copy_(-1, self.head_ids, self.head_logits(pred).float())

    def new_cache(self, block_size: int = 16) -> PagedKVCache:
        c = self.config
        return PagedKVCache(1, c.n_kv_heads, c.head_dim, block_size=block_size, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def step(self, cache: PagedKVCache, seqs: list[int], states: list[torch.Tensor],
             embeds: list[torch.Tensor]) -> torch.Tensor:
        """Append entries (states[b], embeds[b]: (n_b, target_dim)) to each sequence's cache; returns the
        predicted state at each sequence's last new entry (B, target_dim)."""
        n_new = [len(s) for s in states]
        T, D = max(n_new), self.target_dim
        pad = lambda rows: torch.stack([F.pad(r.to(self.dtype), (0, 0, 0, T - len(r))) for r in rows])  # noqa: E731
        meta = passes.prepare(cache, seqs, n_new)
        if meta.mask is not None:  # additive, as Transformer.step makes it
            meta.mask = torch.zeros(meta.mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~meta.mask, float("-inf"))
        # with compiled products (to_blocks): they run on their own threads and PyTorch at one meanwhile
        blocks = caller_threads() if getattr(self, "blocks", None) else None
        with kernels.resolved(), products_at(blocks):
            pred = self.forward_states(pad(states).view(-1, T, D), pad(embeds).view(-1, T, D), cache.kv[0], meta,
                                       meta.positions)
        return pred[torch.arange(len(seqs)), torch.tensor(n_new) - 1]

    def to_int4(self) -> FeatureDraft:
        """Every product whose shape the int4 kernel takes in int4 (Int4Weight, on a CPU): a draft's precision is
        free (speculation is exact with respect to the target alone). In place; returns self."""
        if not int4_supported(self.device):
            raise ValueError(f"int4 products need PyTorch's CPU int4 kernel; this draft is on {self.device}")
        for m in self.modules():
            if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor) and Int4Weight.fits(m.weight.shape):
                set_weight(m, Int4Weight(m.weight.float()))
        self.int4 = True
        return self.to(torch.float32)

    def to_blocks(self, kind: str = "q8_0") -> FeatureDraft:
        """Every product a compiled product takes as `kind` blocks (minispec.ggml's quantizer, Q8_0 by default: an
        int8 value and one fp16 scale a block of 32, a quarter of fp32's bytes), multiplied like a kept target's
        matrices; the rest stay float. In place, on a CPU where a product library is built; returns self. A draft's
        precision is free: speculation stays exact with respect to the target alone."""
        if self.device.type != "cpu" or not ggml.available():
            raise ValueError("block products need a built product library (python tools/build_ggml.py) and a CPU")
        for m in self.modules():
            w = getattr(m, "weight", None) if isinstance(m, nn.Linear) else None
            if isinstance(w, torch.Tensor) and w.shape[1] % ggml.TYPES[kind][1] == 0 and ggml.takes(kind, w.shape[1]):
                set_weight(m, GgmlWeight(kind, ggml.quantize(kind, w), w.shape[1]))
        self.blocks = kind
        return self.to(torch.float32)

    # ---- files

    def save(self, path: str | os.PathLike, tokenizer_fingerprint: str | None, dtype: torch.dtype = torch.bfloat16,
             meta: dict | None = None) -> None:
        """config.json and model.safetensors (in `dtype`) into the directory `path`, each written whole."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v if k == "head_ids" else v.to(dtype)).contiguous() for k, v in self.state_dict().items()}
        tmp = path / "model.safetensors.tmp"
        save_file(tensors, str(tmp))
        os.chmod(tmp, 0o644)  # the writer's private mode would keep a committed or shared draft from its readers
        os.replace(tmp, path / "model.safetensors")
        config = {"kind": KIND, "layer": self.config.to_dict(), "target_dim": self.target_dim,
                  "tokenizer_fingerprint": tokenizer_fingerprint, **({"training": meta} if meta else {})}
        (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(path / "config.json.tmp", path / "config.json")


def build_feature_draft(target, head_ids: torch.Tensor, dim: int | None = None, n_heads: int | None = None,
                        n_kv_heads: int | None = None, ffn_dim: int | None = None, seed: int = 0) -> FeatureDraft:
    """A new feature draft for `target`: its head the target's own head rows for head_ids (so a draft that
    predicted the target's state exactly would score those tokens exactly as the target does), its layer random
    (seeded). Width, heads and SwiGLU width default to the target's (ffn_dim: a sixth of it)."""
    tc = target.config
    dim = dim or tc.dim
    config = ModelConfig(vocab_size=tc.vocab_size, dim=dim, n_layers=1, n_heads=n_heads or tc.n_heads,
                         n_kv_heads=n_kv_heads or tc.n_kv_heads, head_dim=None if dim != tc.dim else tc.head_dim,
                         ffn_dim=ffn_dim or max(256, tc.ffn_dim // 6), norm_eps=tc.norm_eps, rope_theta=tc.rope_theta,
                         rope_scaling=tc.rope_scaling, max_seq_len=tc.max_seq_len, tie_embeddings=False,
                         head_vocab_size=len(head_ids), qkv_bias=tc.qkv_bias, sampled_vocab_size=tc.sampled_vocab_size,
                         bos_id=tc.bos_id, eos_id=tc.eos_id)
    with torch.random.fork_rng():  # the caller's RNG is left as it was
        torch.manual_seed(seed)
        draft = FeatureDraft(config, tc.dim)
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
    with torch.no_grad():
        draft.head_ids.copy_(head_ids)
        draft.lm_head.weight.copy_(target_head_rows(target, head_ids))
    return draft


@torch.no_grad()
def target_head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows for `ids` as fp32 (through its logits on the unit vectors when the head is packed)."""
    w = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    if isinstance(w, torch.Tensor) and target.head_packed is None:
        return w[ids].float()
    eye = torch.eye(target.config.dim, dtype=torch.float32)
    full = torch.cat([target.logits(eye[i:i + 256]) for i in range(0, len(eye), 256)])  # (dim, vocab): W^T
    return full[:, ids].T.contiguous()


class FeatureDrafter(Drafter):
    """Drafts with a FeatureDraft from the target's hidden states (speculate hands them over: see_hidden).

    Per row it keeps the draft's cache of entries (f_i, embed(x_{i+1})) and the target's states not yet
    entered. A round enters the states the target computed for committed tokens, then drafts: d_1 from the
    last true entry, d_j from the state the draft predicted for d_{j-1}. Entries from predicted states are
    rolled back at the next round. `draw` is the step's draw (replaceable only for the negative controls).
    """

    reads_hidden = True

    def __init__(self, draft: FeatureDraft, target, draw=draw_exact):
        self.model, self.target, self.draw = draft, target, draw
        self.cache: PagedKVCache | None = None

    def start(self, prompts, params, block_size, vocab_size) -> None:
        self.params = params
        self.cache = self.model.new_cache(block_size)
        self.seq = {r: self.cache.new_sequence() for r in prompts}
        self.length = {r: len(p) for r, p in prompts.items()}  # committed tokens
        self.entered = {r: 0 for r in prompts}  # cache entries made from the target's own states
        self.states = {r: [] for r in prompts}  # the target's states at positions entered, entered + 1, ...

    def see_hidden(self, rows, states) -> None:
        for r, s in zip(rows, states):
            if r in self.seq:
                self.states[r].append(s)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        """The target's embedding of the tokens (frozen: the draft reads the target's, never its own)."""
        return self.target.embed_tokens(torch.tensor(tokens, dtype=torch.long, device=self.model.device))

    def propose(self, rows, ks, contexts, gens):
        tokens = {r: [] for r in rows}
        qs = {r: [] for r in rows}
        feed_states, feed_tokens = {}, {}
        for r, k in zip(rows, ks):
            s = torch.cat(self.states[r]) if self.states[r] else None
            n = self.length[r] - 1 - self.entered[r]  # entries whose state and next token are both committed
            if k > 0 and n > 0 and s is not None and len(s) >= n:
                self.cache.truncate(self.seq[r], self.entered[r])  # drop entries from predicted states
                feed_states[r] = s[:n]
                feed_tokens[r] = contexts[r][self.entered[r] + 1:self.length[r]]
                self.entered[r] += n
                self.states[r] = [s[n:]]
        ks = {r: (k if r in feed_states else 0) for r, k in zip(rows, ks)}
        self.steps = max(ks.values(), default=0)
        for j in range(self.steps):
            live = [r for r in feed_states if ks[r] > j]
            if j > 0:  # d_{j+1} from the state predicted for d_j and d_j's embedding
                feed_states = {r: feed_states[r] for r in live}
                feed_tokens = {r: tokens[r][-1:] for r in live}
            pred = self.model.step(self.cache, [self.seq[r] for r in live], [feed_states[r] for r in live],
                                   [self.embed(feed_tokens[r]) for r in live])
            add_picks(live, *self.draw_ids(pred, [gens[r] for r in live]), tokens, qs)
            feed_states.update({r: pred[b:b + 1] for b, r in enumerate(live)})
        return as_proposal(rows, tokens, qs, self.model.config.vocab_size)

    def draw_ids(self, pred: torch.Tensor, gens: list) -> tuple[list[int], torch.Tensor | None]:
        """A step's draw over the draft vocabulary alone, as target ids with q over the full vocabulary (zero
        outside head_ids): the same law as drawing from the full logits (-inf outside), at a fraction of the work."""
        picks, q = draw_step(self.model.head_logits(pred).float(), self.params, gens, self.draw)
        ids = self.model.head_ids
        if q is not None:
            q = torch.zeros(len(picks), self.model.config.vocab_size, dtype=torch.float64).index_copy_(
                1, ids.cpu(), q.double())
        return ids[picks].tolist(), q

    def commit(self, row, tokens):
        if row in self.seq:
            self.length[row] += len(tokens)
            keep = self.length[row] - 1 - self.entered[row]  # the target's states of committed tokens, but the last
            s = torch.cat(self.states[row]) if self.states[row] else None
            self.states[row] = [s[:keep]] if s is not None else []

    def finish(self, row, keep=False):
        if row in self.seq and not keep:
            self.cache.free(self.seq.pop(row))


def check_feature_draft(config: dict, target, where: str) -> None:
    """A feature draft's config.json: its fields present and typed (a CheckpointError naming the field), then
    against the target: width, vocabulary, tokenizer (a GenerationError). One line each."""
    tc = target.config
    layer = config.get("layer")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}/config.json: \"layer\" must be an object (the draft layer's config), got "
                              f"{'nothing' if layer is None else show(layer)}")
    fields = {"target_dim": config.get("target_dim"), "layer.vocab_size": layer.get("vocab_size"),
              "layer.n_layers": layer.get("n_layers")}
    for name, v in fields.items():
        if v is None:
            raise CheckpointError(f"{where}/config.json has no {name}")
        if not is_int(v):  # "576" would print as the width it is compared with and still differ
            raise CheckpointError(f"{where}/config.json: {name} must be an integer, got {show(v)}")
    if fields["layer.n_layers"] != 1:
        raise CheckpointError(f"{where}/config.json: layer.n_layers is {fields['layer.n_layers']}; a feature draft "
                              "is one decoder layer")
    if "tokenizer_fingerprint" not in config:
        raise CheckpointError(f"{where}/config.json has no tokenizer_fingerprint (null for a target without one)")
    if config["target_dim"] != tc.dim:
        raise GenerationError(f"{where} was trained for a target of width {config['target_dim']}; this "
                              f"target's is {tc.dim}")
    if layer["vocab_size"] != tc.vocab_size:
        raise GenerationError(f"{where} drafts over {layer['vocab_size']} token ids; this target has "
                              f"{tc.vocab_size}")
    fp = getattr(getattr(target, "tokenizer", None), "fingerprint", None)
    if config["tokenizer_fingerprint"] != fp:
        raise GenerationError(f"{where} was trained for a target whose tokenizer fingerprint is "
                              f"{show(config['tokenizer_fingerprint'], 100)}; this target's is {fp!r}")
