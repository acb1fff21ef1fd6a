"""Shared fixtures: tiny random models with fixed seeds."""

import pytest
import torch

from minispec import ModelConfig, Transformer


def tiny_model(seed: int = 0, scale: float = 1.0, **overrides) -> Transformer:
    """A small random Transformer; `scale` multiplies the weights so logits are peaked enough to matter."""
    kw = dict(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**kw))
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    return model


def peaked_model(seed: int, vocab_size: int, dim: int = 32, n_layers: int = 2, logit_scale: float = 2.0,
                 max_seq_len: int = 64) -> Transformer:
    """Unit-variance embeddings, 1/sqrt(fan_in) weights, a scaled untied head: peaked,
    context-dependent conditionals and greedy paths that wander over the vocabulary."""
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                max_seq_len=max_seq_len, tie_embeddings=False))
    with torch.no_grad():
        for name, w in m.named_parameters():
            if name == "embed_tokens.weight":
                w.normal_(0.0, 1.0)
            elif w.dim() > 1:
                w.normal_(0.0, w.shape[1] ** -0.5)
        m.lm_head.weight.mul_(logit_scale)
    return m


@pytest.fixture
def model():
    return tiny_model(seed=0, scale=5.0)
