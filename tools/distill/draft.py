"""The draft model: a small `Transformer` of the target's family with a subset head.

Same vocabulary, RoPE, special ids and context length as the target; its
lm_head scores only the `head_vocab` most frequent target tokens (every other
token gets probability 0, which keeps speculation exact). It starts from the
target's embedding projected on its principal directions, and is exported as a
bf16 checkpoint with the target's tokenizer files so the fingerprints match.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from minispec import ModelConfig, Transformer
from minispec.errors import check_compatible

from .data import Example


def make_draft_config(target_cfg: ModelConfig, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                      ffn_dim: int | None, head_vocab: int) -> ModelConfig:
    """A small config of the target's family: same vocab, RoPE, special ids and context length."""
    return ModelConfig(vocab_size=target_cfg.vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, norm_eps=target_cfg.norm_eps,
                       rope_theta=target_cfg.rope_theta, rope_scaling=target_cfg.rope_scaling,
                       max_seq_len=target_cfg.max_seq_len, tie_embeddings=False, head_vocab_size=head_vocab,
                       bos_id=target_cfg.bos_id, eos_id=target_cfg.eos_id)


def frequent_tokens(examples: list[Example], n: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The n most frequent target tokens in the examples' responses and soft labels (plus `always`), sorted."""
    if n > vocab_size:
        raise ValueError(f"head_vocab={n} exceeds the vocabulary ({vocab_size} ids)")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for e in examples:
        np.add.at(counts, e.tokens[e.prompt_len:], 1)
        np.add.at(counts, e.label_ids[:, :4].astype(np.int64).ravel(), 1)  # tokens the target nearly chose
    for t in always:
        counts[t] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(top)).long()


@torch.no_grad()
def init_draft_from_target(draft: Transformer, target_embed: torch.Tensor, weights: torch.Tensor | None = None) -> None:
    """Embeddings = the target's, projected on its top `dim` principal directions; lm_head rows = the same rows.

    The target ties its lm_head to its embedding, so projected rows start the
    draft with the target's notion of which tokens are alike, in both places.
    `weights` (vocab,) weighs rows by token frequency when finding the directions.
    """
    E = target_embed.float()  # (V, D_target)
    if draft.config.dim > E.shape[1]:
        raise ValueError(f"draft dim {draft.config.dim} exceeds the target's {E.shape[1]}: "
                         "cannot project the embedding")
    w = torch.ones(E.shape[0]) if weights is None else weights.float()
    mean = (E * w[:, None]).sum(0) / w.sum()
    X = (E - mean) * w.sqrt()[:, None]
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)  # Vh: (D_target, D_target), rows = directions
    P = Vh[: draft.config.dim].T  # (D_target, dim)
    proj = (E - mean) @ P  # (V, dim)
    proj = proj / proj.std() * 0.02 * math.sqrt(draft.config.dim / 16)  # a modest scale; RMSNorm follows anyway
    draft.embed_tokens.weight.copy_(proj)
    # scaled down: at init the residual stream is mostly the input embedding, and full-size output rows
    # would confidently predict "the same token again"
    draft.lm_head.weight.copy_(0.1 * proj[draft.head_ids])


def build_draft(target_path: str, train_examples: list[Example], seed: int, dim: int, n_layers: int, n_heads: int,
                n_kv_heads: int, ffn_dim: int | None, head_vocab: int) -> Transformer:
    """A new draft of the target's family (`make_draft_config`): its head the most frequent tokens of the train
    examples, its embedding the target's projected (`init_draft_from_target`), its tokenizer the target's."""
    target = Transformer.from_pretrained(target_path)
    head_ids = frequent_tokens(train_examples, head_vocab, target.config.vocab_size, target.config.stop_ids)
    config = make_draft_config(target.config, dim, n_layers, n_heads, n_kv_heads, ffn_dim, head_vocab)
    torch.manual_seed(seed)
    draft = Transformer(config)
    draft.head_ids.copy_(head_ids)
    counts = torch.zeros(target.config.vocab_size)
    for e in train_examples:
        counts.index_add_(0, torch.from_numpy(e.tokens), torch.ones(len(e.tokens)))
    init_draft_from_target(draft, target.embed_tokens.weight.detach(), weights=counts + 1.0)
    draft.tokenizer = target.tokenizer
    return draft


def load_exported_draft(path: str | Path, target_config: ModelConfig, tokenizer) -> Transformer:
    """A draft this tool exported, in float32, checked as speculate checks it (vocabulary and tokenizer)."""
    draft = Transformer.from_pretrained(path, dtype=torch.float32)
    check_compatible(SimpleNamespace(config=target_config, tokenizer=tokenizer), draft)
    if draft.head_ids is None:
        raise ValueError(f"{path} has no subset head (head_ids); --init-from needs a draft made by this tool")
    return draft


def draft_head_logits(draft: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Differentiable forward (B, T) -> logits over the head's ids only (B, T, H).

    Transformer.forward runs under inference_mode (no autograd) and widens to
    the full vocabulary; training needs neither.
    """
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    h = draft._trunk(tokens, positions)  # (B, T, dim)
    return F.linear(h, draft.lm_head.weight)  # (B, T, H)


def export_draft(draft: Transformer, tokenizer, out: str | Path, meta: dict | None = None) -> None:
    """Write the draft as a bf16 checkpoint with the target's tokenizer files (so the fingerprints match)."""
    draft.tokenizer = tokenizer
    draft.save_pretrained(out, dtype=torch.bfloat16)
    if meta:
        (Path(out) / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")
