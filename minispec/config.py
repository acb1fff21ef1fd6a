"""ModelConfig: the one description of a minispec Transformer.

A checkpoint's config.json is this dataclass as JSON. Derived sizes (head_dim,
ffn_dim, n_kv_heads) are filled in only where the caller left them unset.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

FORMAT_VERSION = 1


@dataclass
class ModelConfig:
    vocab_size: int  # number of token ids; embedding and lm_head rows
    dim: int  # residual stream width (hidden_size)
    n_layers: int  # number of transformer blocks
    n_heads: int  # query heads per attention layer
    n_kv_heads: int | None = None  # key/value heads (GQA); None = n_heads (MHA), 1 = MQA
    head_dim: int | None = None  # per-head width; None = dim // n_heads
    ffn_dim: int | None = None  # SwiGLU hidden width; None = Llama's rule (8/3 * dim rounded up to 256)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: dict | None = None  # None, or Llama-3 style {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    max_seq_len: int = 2048  # longest sequence (prompt + generated) the model accepts
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    head_vocab_size: int | None = None  # lm_head scores only this many token ids (a draft's frequent-token subset, stored as `head_ids`); the rest get logit -inf. None = every id
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2 style)
    sampled_vocab_size: int | None = None  # ids at or above this are padding rows of the embedding (Qwen2: 151,665 tokens, 151,936 rows): their logits are -inf, so they are never sampled. None = every id is a token
    bos_id: int | None = None  # beginning-of-sequence token id, if the tokenizer has one
    eos_id: int | list[int] | None = None  # end-of-sequence id(s): the default stop tokens

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim explicitly")
            self.head_dim = self.dim // self.n_heads
        if self.ffn_dim is None:
            hidden = int(2 * (4 * self.dim) / 3)
            self.ffn_dim = 256 * ((hidden + 255) // 256)
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.head_vocab_size is not None:
            if not isinstance(self.head_vocab_size, int) or not 1 <= self.head_vocab_size <= self.vocab_size:
                raise ValueError(f"head_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, got {self.head_vocab_size!r}")
            if self.tie_embeddings:
                raise ValueError("head_vocab_size (a subset lm_head) needs tie_embeddings=False")
        if self.sampled_vocab_size is not None and (
                not isinstance(self.sampled_vocab_size, int) or not 1 <= self.sampled_vocab_size <= self.vocab_size):
            raise ValueError(f"sampled_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, "
                             f"got {self.sampled_vocab_size!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3'); got {self.rope_scaling}")
        for tid in self.stop_ids + ((self.bos_id,) if self.bos_id is not None else ()):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"special token id {tid} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The eos id(s) as a tuple: the default stop tokens for generation."""
        if self.eos_id is None:
            return ()
        return tuple(self.eos_id) if isinstance(self.eos_id, (list, tuple)) else (self.eos_id,)

    def to_dict(self) -> dict:
        return {"format": "minispec", "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "ModelConfig":
        d = dict(d)
        d.pop("format", None)
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"{source}: format_version {version} is not supported (this minispec reads {FORMAT_VERSION})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        try:
            return cls(**d)
        except TypeError as e:  # missing required fields
            raise ValueError(f"{source}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "ModelConfig":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(read_json(path), source=path)


def read_json(path) -> dict:
    """A JSON object from `path`, or a ValueError naming the file and what is wrong with it."""
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d
