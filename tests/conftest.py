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


@pytest.fixture
def model():
    return tiny_model(seed=0, scale=5.0)
