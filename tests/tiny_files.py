"""Tiny valid files of every kind minispec reads, for the hostile-input tests and the fuzz test to spoil.

Each builder writes a small, valid artifact in milliseconds: a minispec checkpoint (config.json +
model.safetensors), a tokenizer directory (tokenizer.json + tokenizer_config.json with a chat
template), and a llama GGUF file (F32 tensors, a gpt2-style or SentencePiece-style vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from minispec import ModelConfig, Transformer

# the tiny model: 16 tokens, width 16, 1 layer, 2 query heads sharing 1 kv head of width 8
TINY = dict(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64)
WORDS = ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e", "ab", "cd", "abcd", "de", "ea", "bc", "ce", "da"]
MERGES = ["a b", "c d", "ab cd", "d e", "e a", "b c", "c e", "d a"]


def tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Transformer:
    """Save a tiny random minispec checkpoint (no tokenizer) at `path`; return the model."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, **overrides}))
    model.save_pretrained(path)
    return model


def tokenizer_json() -> str:
    """A byte-free BPE tokenizer.json over WORDS (the tokenizers library's own serialization)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(WORDS)}, merges=[tuple(m.split()) for m in MERGES],
                               unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok.to_str()


CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}" \
                "{% if add_generation_prompt %}<s>assistant{% endif %}"


def tiny_tokenizer_dir(path: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (bos <s>, eos </s>, a chat template) in the directory `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    return path


def _weights(seed: int) -> dict[str, np.ndarray]:
    """GGUF-named F32 weights of the tiny model (the q/k permutation does not matter for a random model)."""
    rng = np.random.default_rng(seed)
    v, d, f, hd = TINY["vocab_size"], TINY["dim"], TINY["ffn_dim"], TINY["dim"] // TINY["n_heads"]
    w = {"token_embd.weight": (v, d), "output_norm.weight": (d,), "output.weight": (v, d),
         "blk.0.attn_norm.weight": (d,), "blk.0.ffn_norm.weight": (d,),
         "blk.0.attn_q.weight": (TINY["n_heads"] * hd, d), "blk.0.attn_k.weight": (TINY["n_kv_heads"] * hd, d),
         "blk.0.attn_v.weight": (TINY["n_kv_heads"] * hd, d), "blk.0.attn_output.weight": (d, TINY["n_heads"] * hd),
         "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d), "blk.0.ffn_down.weight": (d, f)}
    return {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, shape in w.items()}


def gpt2_vocab() -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": WORDS, "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(WORDS) - 3),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def llama_vocab(with_unknown: bool = True) -> dict:
    """A SentencePiece-style vocabulary; without an unknown piece (type 2) sentencepiece cannot load it."""
    types = [2 if with_unknown else 1, 3, 3] + [1] * (len(WORDS) - 3)
    pieces = ["<unk>", "<s>", "</s>"] + ["\u2581" + w for w in WORDS[3:]]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [-float(i) for i in range(len(WORDS) - 3)],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def add_metadata(w, meta: dict) -> None:
    """Add each key of `meta` to GGUFWriter `w` as the GGUF type its Python value implies (int: uint32)."""
    for key, value in meta.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)


def tiny_gguf(path: Path, vocab: dict | None = None, seed: int = 0, **meta) -> Path:
    """A llama GGUF of the tiny model at `path`: F32 tensors, `vocab` metadata (gpt2_vocab() by default).

    meta: `llama.*` keys to set or override, by their name after "llama." (e.g. block_count=10**9).
    """
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"block_count": TINY["n_layers"], "context_length": TINY["max_seq_len"], "embedding_length": TINY["dim"],
            "feed_forward_length": TINY["ffn_dim"], "attention.head_count": TINY["n_heads"],
            "attention.head_count_kv": TINY["n_kv_heads"], "rope.freq_base": 10000.0,
            "attention.layer_norm_rms_epsilon": 1e-5, **meta}

    meta = {**{f"llama.{k}": v for k, v in keys.items()}, **(gpt2_vocab() if vocab is None else vocab)}
    wide = {k: v for k, v in meta.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 2**32}
    add_metadata(w, {k: v for k, v in meta.items() if k not in wide})  # ints as uint32
    for key, value in wide.items():
        w.add_uint64(key, value)
    return finish_gguf(w, _weights(seed), path)


def finish_gguf(w, tensors: dict, path):
    """Add `tensors` (name -> array) to the GGUFWriter `w`, write the file and close it; returns path."""
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
