"""Tokenizers (placeholder until the tokenizer backends land)."""

from pathlib import Path


def load_tokenizer(path):
    path = Path(path)
    if any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model")):
        raise NotImplementedError("tokenizer backends are not written yet")
    return None
