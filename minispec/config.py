"""ModelConfig: the one description of a minispec Transformer.

A checkpoint's config.json is this dataclass as JSON. Derived sizes (head_dim,
ffn_dim, n_kv_heads) are filled in only where the caller left them unset.

Every field is checked when a config is made, before anything is built from it:
counts are integers in [1, MAX_COUNT] (never strings, floats or booleans),
floats are finite and in range (Python's json reads NaN), flags are booleans
(the string "false" is refused, not read as true), and rope_scaling is a dict
of the Llama 3 parameters with values that give finite frequencies. A bad
field raises ConfigError naming it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch

from .errors import InputError, is_int, is_number, show

FORMAT_VERSION = 1
# the compute dtypes a model can be loaded in, by the name the command lines' --dtype options take
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the largest count or size a config may give (vocab_size, dim, n_layers, max_seq_len, ...): a product of two
# of them still fits torch's int64 indices. A config is only a description: loaders compare these counts with
# what the weights file holds before they build anything.
MAX_COUNT = 2**31 - 1
# a config-like JSON file (config.json, index.json, tokenizer_config.json) larger than this is refused
MAX_JSON_BYTES = 64 * 2**20
# Llama 3 rope scaling: the keys besides rope_type and the defaults Hugging Face uses for the optional ones
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_COUNT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len")


class ConfigError(InputError):
    """A ModelConfig field (or the config.json it came from) is missing, mistyped or out of range."""


def check_count(name: str, v, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """`v` if it is an integer in [lo, hi]; else ConfigError naming `name`."""
    if not is_int(v) or not lo <= v <= hi:
        kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ConfigError(f"{name} must be {kind} (at most {hi}), got {show(v)}")
    return v


def check_float(name: str, v, lo: float = 0.0, lo_open: bool = True, hi: float = math.inf) -> float:
    """`v` as a float if it is a finite number above lo (or at it, when not lo_open) and at most hi."""
    try:
        f = float(v) if is_number(v) else math.nan
    except OverflowError:  # an int past the float range
        f = math.inf
    if not math.isfinite(f) or not (lo < f if lo_open else lo <= f) or not f <= hi:
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ConfigError(f"{name} must be a finite number {bound}{'' if hi == math.inf else f' and <= {hi}'}, "
                          f"got {show(v)}")
    return f


def check_rope_scaling(rs) -> None:
    """None, {"rope_type": "default"}, or Llama 3 scaling whose parameters give finite frequencies."""
    if rs is None:
        return
    if not isinstance(rs, dict):
        raise ConfigError(f"ModelConfig.rope_scaling must be a dict or None, got {show(rs)}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        extra = sorted(set(rs) - {"rope_type", "type"})
        if extra:
            raise ConfigError(f"rope_scaling of type 'default' takes no parameters, got {extra}")
        return
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {show(kind)} is not supported (only 'llama3'); got {show(rs, 200)}")
    unknown = sorted(set(rs) - {"rope_type", "type", "factor", *LLAMA3_DEFAULTS})
    if unknown:
        raise ConfigError(f"llama3 rope_scaling has unknown key(s) {unknown}; "
                          f"known: factor, {', '.join(LLAMA3_DEFAULTS)}")
    if "factor" not in rs:
        raise ConfigError("llama3 rope_scaling needs 'factor' (how much longer the context became); "
                          f"got {show(rs, 200)}")
    check_float("rope_scaling.factor", rs["factor"], lo=1.0, lo_open=False)  # as transformers requires: >= 1
    lo = check_float("rope_scaling.low_freq_factor", rs.get("low_freq_factor", LLAMA3_DEFAULTS["low_freq_factor"]))
    hi = check_float("rope_scaling.high_freq_factor", rs.get("high_freq_factor", LLAMA3_DEFAULTS["high_freq_factor"]))
    if not hi > lo:  # the smoothing band divides by (hi - lo)
        raise ConfigError(f"rope_scaling.high_freq_factor ({hi}) must be greater than low_freq_factor ({lo})")
    check_count("rope_scaling.original_max_position_embeddings",
                rs.get("original_max_position_embeddings", LLAMA3_DEFAULTS["original_max_position_embeddings"]))


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
    # None, or Llama-3 style {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    max_seq_len: int = 2048  # longest sequence (prompt + generated) the model accepts
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    # lm_head scores only this many token ids (a draft's frequent-token subset, stored as `head_ids`); the rest get
    # logit -inf. None = every id
    head_vocab_size: int | None = None
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2 style)
    # ids at or above this are padding rows of the embedding (Qwen2: 151,665 tokens, 151,936 rows): their logits are
    # -inf, so they are never sampled. None = every id is a token
    sampled_vocab_size: int | None = None
    # a CPU loads the products in int4 (Model.to_int4): a draft's fast form, never a target's (not exact); stored
    # weights stay float
    int4: bool = False
    bos_id: int | None = None  # beginning-of-sequence token id, if the tokenizer has one
    eos_id: int | list[int] | None = None  # end-of-sequence id(s): the default stop tokens

    def __post_init__(self):
        # the given sizes first: the derivations below divide by them
        for name in _COUNT_FIELDS:
            if getattr(self, name) is not None:
                check_count(f"ModelConfig.{name}", getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim explicitly")
            self.head_dim = self.dim // self.n_heads
        if self.ffn_dim is None:
            hidden = int(2 * (4 * self.dim) / 3)
            self.ffn_dim = 256 * ((hidden + 255) // 256)
        # floats as floats (json may give an int): a 20-digit int eps would overflow torch's scalar arguments
        self.norm_eps, self.rope_theta = check_float("ModelConfig.norm_eps", self.norm_eps, hi=1.0), \
            check_float("ModelConfig.rope_theta", self.rope_theta, lo=1.0, lo_open=False)
        self.validate()

    def validate(self) -> None:
        for name in _COUNT_FIELDS:
            check_count(f"ModelConfig.{name}", getattr(self, name))
        for name in ("tie_embeddings", "qkv_bias", "int4"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} must be true or false, got {show(getattr(self, name))}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                              "(grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.head_vocab_size is not None:
            if not is_int(self.head_vocab_size) or not 1 <= self.head_vocab_size <= self.vocab_size:
                raise ConfigError(f"head_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, "
                                  f"got {show(self.head_vocab_size)}")
            if self.tie_embeddings:
                raise ConfigError("head_vocab_size (a subset lm_head) needs tie_embeddings=False")
        check_float("ModelConfig.norm_eps", self.norm_eps, hi=1.0)
        check_float("ModelConfig.rope_theta", self.rope_theta, lo=1.0, lo_open=False)  # below 1 frequencies overflow
        check_rope_scaling(self.rope_scaling)
        eos = self.eos_id
        if not (eos is None or is_int(eos) or isinstance(eos, (list, tuple)) and eos and all(map(is_int, eos))):
            raise ConfigError("ModelConfig.eos_id must be a token id, a non-empty list of ids, or None, "
                              f"got {show(eos)}")
        if self.sampled_vocab_size is not None and (
                not is_int(self.sampled_vocab_size) or not 1 <= self.sampled_vocab_size <= self.vocab_size):
            raise ConfigError(f"sampled_vocab_size must be in [1, vocab_size={self.vocab_size}] or None, "
                              f"got {show(self.sampled_vocab_size)}")
        if self.bos_id is not None and not is_int(self.bos_id):
            raise ConfigError(f"ModelConfig.bos_id must be a token id or None, got {show(self.bos_id)}")
        for tid in self.stop_ids + ((self.bos_id,) if self.bos_id is not None else ()):
            if not 0 <= tid < self.vocab_size:
                raise ConfigError(f"special token id {tid} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The eos id(s) as a tuple: the default stop tokens for generation."""
        if self.eos_id is None:
            return ()
        return tuple(self.eos_id) if isinstance(self.eos_id, (list, tuple)) else (self.eos_id,)

    def llama3_rope(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of Llama 3
        rope scaling, the optional ones defaulted as in Hugging Face; None without that scaling."""
        rs = self.rope_scaling
        if rs is None or rs.get("rope_type", rs.get("type")) != "llama3":
            return None
        d = {**LLAMA3_DEFAULTS, **rs}
        return (float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"]),
                d["original_max_position_embeddings"])

    def to_dict(self) -> dict:
        return {"format": "minispec", "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> ModelConfig:
        d = dict(d)
        d.pop("format", None)
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION or not is_int(version):
            raise ConfigError(f"{source}: format_version {show(version)} is not supported "
                              f"(this minispec reads {FORMAT_VERSION})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown ModelConfig field(s) {show(unknown, 200)}; "
                              f"known fields: {sorted(known)}")
        try:
            return cls(**d)
        except TypeError as e:  # missing required fields
            raise ConfigError(f"{source}: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> ModelConfig:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(read_json(path), source=path)


def read_json(path, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from `path`, or a ConfigError naming the file and what is wrong with it.

    Refused: a file over max_bytes, text that is not UTF-8, invalid JSON (also numbers past
    Python's 4300-digit limit and nesting too deep to parse), and anything but an object.
    """
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ConfigError(f"{path} is {size} bytes, more than the {max_bytes} a JSON config may have; "
                          "is it the right file?")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "JSON files must be UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{path} nests JSON too deeply to be a config") from None
    except ValueError as e:  # json.JSONDecodeError, and int() past Python's digit limit
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d
