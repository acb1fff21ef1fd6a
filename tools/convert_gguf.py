"""Convert a llama- or qwen2-architecture GGUF file into a minispec checkpoint directory.

    python tools/convert_gguf.py FILE.gguf DST_DIR [--dtype float32|bfloat16|float16] [--int4 | --keep-quant]
        [--overwrite]

What a GGUF holds and what becomes of it:
- tensors (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants) are dequantized
  with `gguf.quants.dequantize` and stored in model.safetensors at --dtype; with --keep-quant each
  quantized matrix keeps the file's quantization instead (minispec.quantized): Q4_K, Q6_K, Q5_0 and Q8_0
  as the file's own blocks, byte for byte; any other quantized type as int8 rows requantized from its
  dequantized values (how far each is from the file: the table it prints, and docs/design.md);
- for llama, llama.cpp's converter permutes the rows of attn_q / attn_k so that its RoPE, which
  rotates adjacent pairs, matches Hugging Face's rotate-half RoPE; we undo that permutation per
  head (K with n_kv_heads heads: grouped-query attention). For qwen2 it permutes nothing (its
  graph uses the rotate-half "NEOX" RoPE), so the rows are taken as stored;
- qwen2's q/k/v biases (attn_q.bias, ...) become the projections' biases (`qkv_bias`);
- `output.weight` becomes the lm_head when the file has one; otherwise the head is tied;
- `{arch}.*` metadata becomes config.json (a ModelConfig): sizes, RoPE base, RMSNorm eps, the
  context length (the RoPE tables grow with use, so a long one costs nothing); a vocabulary padded
  with UNUSED tokens to the embedding's row count (Qwen2: 151,665 tokens, 151,936 rows) sets
  `sampled_vocab_size`, so those rows are never sampled;
- `tokenizer.ggml.*` metadata becomes tokenizer.json (gpt2-style byte-level BPE, built with the
  `tokenizers` library) or tokenizer.model (a SentencePiece vocabulary, serialized as
  sentencepiece's ModelProto by the small protobuf writer below, so protobuf is not needed),
  plus tokenizer_config.json with the special tokens and the chat template.

Everything that can be checked without reading the weights is checked first, and the file is
read as hostile: tensor data must lie inside the file, in order, aligned and without overlap
(two tensors reading the same bytes would convert into wrong weights); metadata counts must be
positive integers and floats finite; the layer count must match the tensors before anything is
built; with --keep-quant a matrix holding a non-finite block scale or value is refused (requantized, a
NaN row would become zeros), and each kept matrix is made a chunk of rows at a time (CHUNK_VALUES), so
no float copy of a whole embedding is held. The output is written to a temporary directory beside DST,
loaded back as a check (as users load it: a kept checkpoint packed), and renamed into place at the end
(tools/_common.py), so a failed conversion (unsupported architecture or tensor type, truncated file,
missing tensor, a checkpoint that would not load) leaves no DST behind; an existing DST is refused, or
with --overwrite replaced only once the new one is complete.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

try:
    import gguf
except ImportError:  # pragma: no cover - depends on the environment
    gguf = None

from minispec import forms, protobuf, quantized
from minispec.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_output_dir, check_state_dict, expected_tensors
from minispec.config import MAX_COUNT, ModelConfig
from minispec.errors import InputError, one_line, out_of_memory, show
from minispec.model import Transformer
from minispec.safetensors_writer import ST_DTYPE, TORCH_DTYPE

from _common import (
    DTYPES,
    ConversionError,
    TensorEntry,
    atomic_output_dir,
    check_output_loads,
    run_tool,
    tool_parser,
    write_safetensors,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# the architectures whose attn_q / attn_k rows llama.cpp's converter permutes (LlamaModel.modify_tensors);
# Qwen2Model writes them as Hugging Face has them
ROPE_PERMUTED = {"llama": True, "qwen2": False}


# ---------------------------------------------------------------------------------------------
# tensor names and layout

_GGUF_LAYER_PARTS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_minispec_name(name: str) -> str:
    """GGUF (llama.cpp) tensor name -> minispec name, e.g. blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    m = _GGUF_LAYER.match(name)
    if m and m.group(2) in _GGUF_LAYER_PARTS:
        return f"layers.{m.group(1)}.{_GGUF_LAYER_PARTS[m.group(2)]}"
    if name == "rope_freqs.weight":
        raise ConversionError("the file carries rope_freqs.weight (Llama 3.1-style RoPE scaling factors), which this "
                              "converter does not translate; convert the original Hugging Face checkpoint instead")
    raise ConversionError(f"unexpected tensor {name!r}: it has no minispec counterpart in a llama or qwen2 model")


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a q/k projection weight (n_heads*head_dim, dim) or bias (n_heads*head_dim,).

    Hugging Face's RoPE rotates the two halves of each head (x[i] with x[i + D/2]); GGML's
    rotates adjacent pairs (x[2i] with x[2i+1]). llama.cpp's converter therefore interleaves
    each head's rows, half-major -> pair-major: row (h, half, i) moved to (h, i, half).
    The inverse reads the rows as (h, i, half) and puts them back as (h, half, i).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ConversionError(f"cannot un-permute a RoPE weight of shape {tuple(w.shape)} over {n_heads} heads")
    head_dim = rows // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])  # (H, D/2, 2, ...): pair-major, as stored
             .transpose(1, 2)                                   # (H, 2, D/2, ...): half-major, as HF expects
             .reshape(w.shape))


# ---------------------------------------------------------------------------------------------
# metadata

def _field_value(field):
    """A GGUF metadata field as a Python value (str, int, float, bool, or a list of those).

    Uses only ReaderField.parts/.data/.types, which every gguf release has.
    """
    T = gguf.GGUFValueType
    kind = field.types[0]

    def scalar(part, t):
        if t == T.STRING:
            return bytes(part).decode("utf-8")
        v = part[0].item()
        return bool(v) if t == T.BOOL else v

    if kind == T.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        if sub == T.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if sub is None or sub == T.ARRAY:
            return [field.parts[i].tolist() for i in field.data]
        values = np.concatenate([field.parts[i] for i in field.data]) if len(field.data) else np.array([])
        return [bool(v) for v in values] if sub == T.BOOL else values.tolist()
    return scalar(field.parts[field.data[0]], kind)


# `{arch}.*` metadata that must be a positive integer (at most MAX_COUNT), or a finite positive float
_COUNT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
               "vocab_size")
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")
# tokenizer.ggml.* keys and the Python type each must have
_TOKENIZER_TYPES = {"model": str, "pre": str, "tokens": list, "scores": list, "token_type": list, "merges": list,
                    "add_bos_token": bool, "add_eos_token": bool, "add_space_prefix": bool}


def check_metadata(meta: dict, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse metadata that would build something absurd or wrong, naming the key: counts that are not
    positive integers (head_count 0, a string, a per-layer list), non-finite floats, token ids that are
    not integers, tokenizer fields of the wrong type, more tokens than the embedding has rows."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConversionError(f"{source}: general.architecture must be a string, got {show(arch)}")
    for suffix in _COUNT_KEYS:
        v = meta.get(f"{arch}.{suffix}")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_COUNT):
            raise ConversionError(f"{source}: metadata {arch}.{suffix} must be a positive integer (at most "
                                  f"{MAX_COUNT}; per-layer lists are not supported), got {show(v)}")
    for suffix in _FLOAT_KEYS:
        v = meta.get(f"{arch}.{suffix}")
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v <= 0):
            raise ConversionError(f"{source}: metadata {arch}.{suffix} must be a finite positive number, got {show(v)}")
    for key, v in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and v is not None \
                and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConversionError(f"{source}: metadata {key} must be a token id (an integer >= 0), got {show(v)}")
    for name, kind in _TOKENIZER_TYPES.items():
        v = meta.get(f"tokenizer.ggml.{name}")
        if v is not None and not isinstance(v, kind):
            raise ConversionError(f"{source}: metadata tokenizer.ggml.{name} must be a {kind.__name__}, got {show(v)}")
    for name, ok, kind in (("tokens", lambda t: isinstance(t, str), "strings"),
                           ("merges", lambda t: isinstance(t, str), "strings"),
                           ("scores", lambda t: isinstance(t, (int, float)) and not isinstance(t, bool)
                            and abs(t) <= np.finfo(np.float32).max, "float32 numbers"),
                           ("token_type", lambda t: isinstance(t, int) and not isinstance(t, bool), "integers")):
        if not all(map(ok, meta.get(f"tokenizer.ggml.{name}", ()))):
            raise ConversionError(f"{source}: metadata tokenizer.ggml.{name} must be a list of {kind}")
    tokens = meta.get("tokenizer.ggml.tokens")
    for name in ("token_type", "scores"):  # one entry per token: a shorter list leaves tokens without a type
        v = meta.get(f"tokenizer.ggml.{name}")
        if v is not None and tokens is not None and len(v) != len(tokens):
            raise ConversionError(f"{source}: metadata tokenizer.ggml.{name} has {len(v)} entries for {len(tokens)} "
                                  "tokens; the file is inconsistent")
    embd = shapes.get("token_embd.weight")
    if embd is not None and len(embd) != 2:
        raise ConversionError(f"{source}: tensor token_embd.weight has shape {embd}; an embedding is (vocab, dim)")
    if embd is not None and tokens is not None and len(tokens) > embd[0]:
        raise ConversionError(f"{source}: the vocabulary lists {len(tokens)} tokens, the embedding has only {embd[0]} "
                              "rows; the file is inconsistent")


def check_tensor_layout(reader, size: int, path: Path) -> None:
    """Tensor data must be where GGUF puts it: each tensor's bytes inside the file, at an aligned offset
    into the data section, after the previous tensor's (in order, so no two tensors share bytes), and as
    many as its shape and type need, filling the space up to the next tensor but for the alignment's
    padding (an F32 tensor relabelled F16 would read half its bytes as garbage and leave the rest)."""
    end, prev = 0, None
    spans = []  # (name, start, end) relative to the data section, in order
    for t in reader.tensors:
        rel = t.data_offset - reader.data_offset
        n = math.prod(int(d) for d in t.shape)  # exact (the reader's numpy product wraps around in uint64)
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if n != t.n_elements or n % block or t.n_bytes != n // block * type_size:
            raise ConversionError(f"{path}: tensor {t.name!r} of shape {[int(d) for d in t.shape]} and type "
                                  f"{t.tensor_type.name} does not have a valid size; the file is corrupt")
        if t.data_offset + t.n_bytes > size:
            raise ConversionError(f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                                  f"the file has {size} bytes; download or copy it again")
        if rel % reader.alignment:
            raise ConversionError(f"{path}: tensor {t.name!r} starts at data offset {rel}, not a multiple of the "
                                  f"alignment {reader.alignment}; the file is corrupt")
        if rel < end:
            raise ConversionError(f"{path}: tensor {t.name!r} (data offset {rel}) overlaps or precedes {prev!r} "
                                  f"(which ends at {end}); the file is corrupt or crafted: its weights would be wrong")
        end, prev = rel + t.n_bytes, t.name
        spans.append((t.name, rel, end))
    # the space up to the next tensor (or the end of the file) may hold only the alignment's padding
    nexts = [(start, f"{name!r} starts") for name, start, _ in spans[1:]]
    nexts.append((size - reader.data_offset, "the end of the file"))
    for (name, _, stop), (start, what) in zip(spans, nexts):
        if start - stop >= reader.alignment:
            raise ConversionError(f"{path}: tensor {name!r} ends {start - stop} bytes before {what}, more than the "
                                  f"alignment ({reader.alignment}) pads; its type or shape is wrong: the file is "
                                  "corrupt or crafted")


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except UnicodeDecodeError as e:
            raise ConversionError(f"metadata key {key!r} holds a string that is not valid UTF-8 ({e})") from None
    return meta


def _f32_decimal(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


# GGUF token types (llama.cpp's, which follow SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> control tokens that also end generation, beside the file's eos / eot: what the
# family's own generation_config.json lists (Qwen2.5: [<|im_end|>, <|endoftext|>]) and llama.cpp
# stops on, though the GGUF metadata has no key for it
EXTRA_STOP_TOKENS = {"qwen2": ("<|endoftext|>",)}


def stop_token_ids(meta: dict) -> list[int]:
    """The ids that end generation: eos, then a distinct end-of-turn token, then the family's extra stops."""
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
    ids += [control.get(t) for t in EXTRA_STOP_TOKENS.get(meta.get("tokenizer.ggml.pre"), ())]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def sampled_vocab_size(meta: dict, rows: int) -> int | None:
    """How many embedding rows are real tokens; None when all are.

    llama.cpp's converter pads a token list shorter than the embedding (Qwen2: 151,665 tokens for
    151,936 rows) with UNUSED placeholders `[PAD151665]` ...; those trailing ids, and any rows past
    the token list, are no tokens and must never be sampled.
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    n = min(len(tokens), rows)
    while n > 0 and types[n - 1] == UNUSED:
        n -= 1
    return n if 0 < n < rows else None


def config_from_metadata(meta: dict, tensors: dict[str, tuple[int, ...]], source: str) -> ModelConfig:
    """ModelConfig from a GGUF's `{arch}.*` keys; `tensors` maps GGUF tensor names to numpy-order shapes."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{source}: architecture {arch!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}); minispec implements the Llama family "
                              "(Llama, Qwen2) only")

    def key(name, default=None, required=True):
        k = f"{arch}.{name}"
        if k in meta:
            return meta[k]
        if required and default is None:
            raise ConversionError(f"{source}: metadata key {k!r} is missing; the file is not a complete {arch} GGUF")
        return default

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ConversionError(f"{source}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
    if "token_embd.weight" not in tensors:
        raise ConversionError(f"{source}: tensor 'token_embd.weight' is missing")
    vocab_size, dim = tensors["token_embd.weight"]
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", dim // n_heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConversionError(f"{source}: partial rotary embeddings ({arch}.rope.dimension_count={rope_dims} < "
                              f"head_dim={head_dim}) are not supported")
    stops = stop_token_ids(meta)
    fields = dict(
        vocab_size=int(vocab_size),
        dim=int(key("embedding_length")),
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        norm_eps=_f32_decimal(key("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32_decimal(key("rope.freq_base", 10000.0)),
        max_seq_len=int(key("context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        # any q/k/v bias in any layer: a file missing one of them is then told it is missing, not that the others
        # are unexpected
        qkv_bias=any(re.fullmatch(r"blk\.\d+\.attn_[qkv]\.bias", n) for n in tensors),
        sampled_vocab_size=sampled_vocab_size(meta, int(vocab_size)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=stops[0] if len(stops) == 1 else (stops or None),
    )
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # ModelConfig.validate: inconsistent sizes or special ids
        raise ConversionError(f"{source}: the metadata does not describe a valid model: {e}") from None


# ---------------------------------------------------------------------------------------------
# tokenizer

# tokenizer.ggml.pre -> the split regex its merges were learned with (None: GPT-2's, built into ByteLevel)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2",
    "smollm": "digits+gpt2",  # SmolLM/SmolLM2: every digit alone, then GPT-2's split
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


# tokenizer.ggml.pre -> the normalizer its tokenizer.json has (Qwen2's: NFC, as Qwen's own tokenizer applies)
NORMALIZERS = {"qwen2": "NFC"}


def _byte_level_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers
    rule = PRE_TOKENIZERS.get(pre)
    if rule is None:
        raise ConversionError(f"tokenizer.ggml.pre={pre!r}: this pre-tokenizer is unknown to the converter (known: "
                              f"{sorted(PRE_TOKENIZERS)}); add its split rule to PRE_TOKENIZERS in {__file__}")
    if rule == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rule), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_bpe_tokenizer_json(meta: dict) -> str:
    """tokenizer.json text for a gpt2-style (byte-level BPE) GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ConversionError("tokenizer.ggml.merges is missing: a gpt2-style tokenizer needs its merges")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise ConversionError(f"token {t!r} appears twice in tokenizer.ggml.tokens (ids {vocab[t]} and {i})")
        vocab[t] = i
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ConversionError(f"merge {m!r} in tokenizer.ggml.merges is not two tokens separated by a space")
        pairs.append((a, b))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # the tokenizers library's own check, e.g. a merge of tokens not in the vocabulary
        raise ConversionError(f"tokenizer.ggml.tokens/merges do not make a BPE tokenizer "
                              f"({show(str(e), 200)})") from None
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    if NORMALIZERS.get(pre) == "NFC":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens (<|im_start|>, <|endoftext|>, ...) must be matched whole in text, never split into bytes
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ConversionError(f"the rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                              f"the file lists {len(tokens)}")
    return tok.to_str(pretty=True)


_pb = protobuf.field


def build_sentencepiece_model(meta: dict) -> bytes:
    """A serialized sentencepiece ModelProto (tokenizer.model) for a llama/SentencePiece GGUF vocabulary.

    Field numbers are those of sentencepiece_model.proto: ModelProto{1: pieces, 2: trainer_spec,
    3: normalizer_spec}; SentencePiece{1: piece, 2: score, 3: type}; TrainerSpec{3: model_type,
    4: vocab_size, 35: byte_fallback, 40-43: unk/bos/eos/pad id}; NormalizerSpec{1: name,
    3: add_dummy_prefix, 4: remove_extra_whitespaces, 5: escape_whitespaces}.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not len(tokens) == len(scores) == len(types):
        raise ConversionError(f"tokenizer.ggml.tokens/scores/token_type have different lengths "
                              f"({len(tokens)}, {len(scores)}, {len(types)})")
    out = bytearray()
    for piece, score, ty in zip(tokens, scores, types):
        ty = ty if ty in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
        out += _pb(1, _pb(1, piece) + _pb(2, float(score)) + _pb(3, int(ty)))

    def special(name, default):
        v = meta.get(f"tokenizer.ggml.{name}_token_id")
        return default if v is None else int(v)
    unk = special("unknown", types.index(UNKNOWN) if UNKNOWN in types else 0)
    trainer = (_pb(3, 2)  # model_type BPE: llama's scores are merge ranks, encoded greedily by score
               + _pb(4, len(tokens))
               + _pb(35, int(BYTE in types))  # byte_fallback when the vocabulary has <0xNN> pieces
               + _pb(40, unk) + _pb(41, special("bos", -1)) + _pb(42, special("eos", -1))
               + _pb(43, special("padding", -1)))
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    normalizer = (_pb(1, "identity") + _pb(3, int(bool(add_prefix)))
                  + _pb(4, 0) + _pb(5, 1))
    out += _pb(2, trainer) + _pb(3, normalizer)
    return bytes(out)


def tokenizer_files(meta: dict) -> dict[str, bytes]:
    """The tokenizer files for a checkpoint dir, from tokenizer.ggml.* metadata ({} when the file has none)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        return {}
    tokens = meta["tokenizer.ggml.tokens"]
    if model == "gpt2":
        files = {"tokenizer.json": build_bpe_tokenizer_json(meta).encode("utf-8")}
        add_bos_default, cls = False, "PreTrainedTokenizerFast"
    elif model == "llama":
        files = {"tokenizer.model": build_sentencepiece_model(meta)}
        add_bos_default, cls = True, "LlamaTokenizer"  # llama.cpp adds BOS to a SentencePiece vocab unless told not to
    else:
        raise ConversionError(f"tokenizer.ggml.model={model!r} is not supported (supported: 'gpt2', 'llama'); "
                              "convert the original Hugging Face checkpoint, which carries its tokenizer files")

    def name(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": cls,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": name("bos"), "eos_token": name("eos"), "unk_token": name("unknown"), "pad_token": name("padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if meta.get("tokenizer.ggml.eot_token_id") is not None:
        config["eot_token"] = name("eot")
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    if model == "llama":
        config["legacy"] = False
        config["add_prefix_space"] = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    files["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


# ---------------------------------------------------------------------------------------------
# the conversion

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def open_gguf(path: Path):
    if gguf is None:
        raise ConversionError("the 'gguf' package is not installed: pip install 'minispec[convert]' "
                              "(or pip install gguf)")
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    try:
        with np.errstate(all="ignore"):  # a crafted offset overflows numpy's uint64 sum: checked below, not warned
            reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails in many ways on a damaged file: say which file and what to do
        if out_of_memory(e):
            raise
        raise ConversionError(f"{path} cannot be read as GGUF ({type(e).__name__}: {e}); the file may be truncated or "
                              "corrupt: download or copy it again") from None
    check_tensor_layout(reader, path.stat().st_size, path)
    return reader


def check_tensor_type(t) -> None:
    if t.tensor_type.name not in SUPPORTED_TYPES:
        raise ConversionError(f"tensor {t.name!r} has type {t.tensor_type.name}, which this converter does not "
                              f"dequantize (supported: {', '.join(SUPPORTED_TYPES)}); re-quantize the model to one "
                              "of those")


def load_tensor(t, name: str, cfg: ModelConfig, permuted: bool = True) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in minispec's layout (numpy order: out x in).

    permuted: the file's q/k rows are in llama.cpp's pair-major RoPE order (ROPE_PERMUTED).
    """
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a writable copy, off the memmap
    return in_hf_rope_order(w, name, cfg, permuted)


def in_hf_rope_order(w: torch.Tensor, name: str, cfg: ModelConfig, permuted: bool) -> torch.Tensor:
    """A q/k weight or bias (or any tensor whose rows are its outputs: a kept form's parts) with llama.cpp's
    RoPE row permutation undone when the file has it; any other tensor as it is."""
    if not permuted:
        return w
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rope_rows(w, cfg.n_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rope_rows(w, cfg.n_kv_heads)  # K has only the kv heads (GQA)
    return w


FLOAT_TYPES = ("F32", "F16", "BF16")


# values of a kept matrix made at a time: its float copies (the file's values, the stored and computed ones) stay
# this small whatever the matrix's size, so an embedding costs its kept parts, not several float copies of itself
CHUNK_VALUES = 1 << 22


def _worst(a: float, b: float) -> float:
    """The larger of two distances, NaN if either is one (Python's max(0.0, nan) is 0.0: a NaN would read as exact)."""
    return b if math.isnan(b) or b > a else a


class KeptTensor:
    """One quantized GGUF matrix in a kept form (`quantized.STORED_PARTS`): its parts made once, when the first is
    written (the parts are written one after another), and its distance from the file's values recorded."""

    def __init__(self, t, name: str, shape: tuple[int, int], cfg: ModelConfig, permuted: bool, errors: dict,
                 source: str = "the GGUF file"):
        self.t, self.name, self.shape, self.cfg, self.permuted, self.errors = t, name, shape, cfg, permuted, errors
        kind = t.tensor_type.name.lower()  # the file's blocks as they are where minispec can also decode them
        self.form = kind if kind in quantized.BLOCK_FORMS else "q8"
        self.source = source
        self.parts: dict[str, torch.Tensor] | None = None
        self.left: set[str] = set()  # the parts not yet written: the made ones are dropped after the last

    def entries(self) -> list[TensorEntry]:
        n, k = self.shape
        return [TensorEntry(f"{self.name}.{suffix}", shape(n, k), TORCH_DTYPE[dtype],
                            functools.partial(self.part, suffix))
                for suffix, dtype, shape in quantized.STORED_PARTS[self.form]]

    def part(self, suffix: str) -> torch.Tensor:
        if self.parts is None:
            self.parts = self.make()
            self.left = set(self.parts)
        part = self.parts[suffix]
        self.left.discard(suffix)
        if not self.left:
            self.parts = None  # the last part: the next matrix's turn
        return part

    def make(self) -> dict[str, torch.Tensor]:
        """The kept form's parts, made from the file's rows a chunk at a time (rows as stored; RoPE's permutation
        undone on the parts at the end: each row is made alone, so the order does not change it). A non-finite
        block scale or value is refused: requantized, a NaN row would become zeros."""
        n, k = self.shape
        kind = self.t.tensor_type
        parts = {s: torch.empty(shape(n, k), dtype=TORCH_DTYPE[dt])
                 for s, dt, shape in quantized.STORED_PARTS[self.form]}
        worst = self.errors.setdefault(kind.name, [self.form, 0.0, 0.0, 0.0])
        step = max(1, CHUNK_VALUES // k)
        for i in range(0, n, step):
            rows = self.t.data[i:i + step]  # (rows, bytes a row), as the reader maps them
            with np.errstate(all="ignore"):  # a non-finite scale's NaN or inf: refused below, not warned
                exact = torch.from_numpy(gguf.quants.dequantize(rows, kind).reshape(-1, k))  # the file's values
            if self.form in quantized.BLOCK_FORMS:
                chunk = {self.form: torch.from_numpy(np.array(rows, dtype=np.uint8))}  # a writable copy
            else:
                chunk = forms.int8_rows(exact)
            bad = next((v for v in (exact, *chunk.values()) if v.is_floating_point() and not torch.isfinite(v).all()),
                       None)
            if bad is not None:
                row = i + int((~torch.isfinite(bad)).reshape(len(bad), -1).any(1).nonzero()[0, 0])
                raise ConversionError(f"{self.source}: tensor {self.t.name!r} ({kind.name}) holds NaN or inf (a "
                                      f"non-finite block scale or value in its row {row} as stored); the file is "
                                      "corrupt: its weights cannot be kept, download it again")
            for s, p in chunk.items():
                parts[s][i:i + len(exact)] = p
            stored = quantized.dequantize(self.form, chunk)
            computed = forms.computed_values(self.form, chunk)
            worst[1:] = [_worst(worst[1], float((stored - exact).abs().max())),
                         _worst(worst[2], float((computed - exact).abs().max())),
                         _worst(worst[3], float(exact.abs().max()))]
        return {s: in_hf_rope_order(p, self.name, self.cfg, self.permuted) for s, p in parts.items()}


def error_table(errors: dict) -> str:
    """The kept forms' distance from the file's dequantized values, one line per GGUF type."""
    lines = ["type   form  max |stored - file|  max |computed - file|  max |file|"]
    for name, (form, stored, computed, peak) in sorted(errors.items()):
        lines.append(f"{name:<6} {form:<5} {stored:>18.3g}  {computed:>21.3g}  {peak:>10.3g}")
    return "\n".join(lines)


def tensor_entries(reader, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, dtype: str, keep_quant: bool,
                   permuted: bool, errors: dict, source: str) -> list[TensorEntry]:
    """The file's tensors as the checkpoint's, each made when the writer reaches it: dequantized to `dtype`, or
    (keep_quant) a quantized matrix's kept parts."""
    entries = []
    for t in reader.tensors:
        check_tensor_type(t)
        name = gguf_to_minispec_name(t.name)
        if keep_quant and t.tensor_type.name not in FLOAT_TYPES and len(shapes[t.name]) == 2:
            entries += KeptTensor(t, name, shapes[t.name], cfg, permuted, errors, source).entries()
        else:
            entries.append(TensorEntry(name, shapes[t.name], DTYPES[dtype],
                                       lambda t=t, name=name: load_tensor(t, name, cfg, permuted)))
    return entries


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "float32", overwrite: bool = False,
            progress: bool = True, int4: bool = False, keep_quant: bool = False,
            errors: dict | None = None) -> ModelConfig:
    """Convert the GGUF file `src` into the minispec checkpoint directory `dst`; return its config.

    Everything that can be checked without dequantizing (architecture, metadata, tokenizer,
    tensor names, shapes and types) is checked first; then the tensors are dequantized and
    written one at a time, so the peak memory is one tensor, not the model. int4: config.json records that
    a CPU loads the products in int4 (a draft's fast form; the stored weights stay at `dtype`). keep_quant:
    quantized matrices keep the file's quantization (`KeptTensor`); `errors`, when given, receives each
    GGUF type's [form, max |stored - file|, max |computed - file|, max |file|].
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        check_output_dir(dst, overwrite)  # before the work, not after it
    except FileExistsError as e:
        raise ConversionError(str(e)) from None
    reader = open_gguf(src)
    meta = read_metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    check_metadata(meta, shapes, str(src))
    cfg = config_from_metadata(meta, shapes, str(src))
    if int4 and keep_quant:
        raise ConversionError("--int4 and --keep-quant are two different forms: choose one")
    cfg.int4 = int4
    errors = {} if errors is None else errors
    tok_files = tokenizer_files(meta)
    permuted = ROPE_PERMUTED[meta["general.architecture"]]
    entries = tensor_entries(reader, shapes, cfg, dtype, keep_quant, permuted, errors, str(src))
    try:
        got, _ = quantized.split_kept({e.name: e.shape for e in entries},
                                      {e.name: ST_DTYPE[e.dtype] for e in entries}, str(src))
        check_state_dict(got, expected_tensors(Transformer, cfg, got, str(src)), str(src))  # layers counted first
    except InputError as e:
        raise ConversionError(str(e)) from None
    entries.sort(key=lambda e: e.name)
    with atomic_output_dir(dst, overwrite=overwrite) as tmp:
        write_safetensors(tmp / WEIGHTS_NAME, entries, metadata={"format": "pt", "producer": "minispec convert_gguf"},
                          show_progress=progress, desc=f"converting {src.name}")
        cfg.save(str(tmp / CONFIG_NAME))
        for name, data in tok_files.items():
            (tmp / name).write_bytes(data)
        del entries, reader  # the file's memory map goes: its pages would count again beside the loaded model
        check_output_loads(tmp, dst, src, int4=False if int4 else None)  # a kept checkpoint: as users load it
    return cfg


def main(argv=None) -> int:
    args = tool_parser("Convert a llama- or qwen2-architecture GGUF file into a minispec checkpoint dir.",
                       src_help="the GGUF file", dst_help="the checkpoint directory to create", src_metavar="FILE.gguf",
                       dst_metavar="DST_DIR", dtype_default="float32",
                       dtype_help="dtype of the stored weights (default float32)")
    args.add_argument("--int4", action="store_true",
                      help="record in config.json that a CPU loads the products in int4: a draft's fast form")
    args.add_argument("--keep-quant", action="store_true",
                      help="keep each quantized matrix's own quantization (Q4_K, Q6_K, Q5_0, Q8_0 as the file's "
                           "blocks; other types as int8 rows): a CPU computes it as stored; --dtype applies to the "
                           "float tensors")
    args = args.parse_args(argv)

    def job() -> str:
        errors = {}
        try:
            cfg = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet,
                          int4=args.int4, keep_quant=args.keep_quant, errors=errors)
        except (MemoryError, RuntimeError) as e:  # torch's CPU allocator says so with a RuntimeError
            if not out_of_memory(e):
                raise
            raise ConversionError(f"out of memory converting {args.src} ({one_line(e)}); nothing was written: free "
                                  "memory or raise this process's limit (ulimit -v) and run it again") from None
        form = " (int4 products on a CPU)" if args.int4 else " (quantization kept)" if args.keep_quant else ""
        return (f"wrote {args.dst}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), "
                f"vocab {cfg.vocab_size}, {args.dtype}{form}" + (f"\n{error_table(errors)}" if errors else ""))
    return run_tool(job)


if __name__ == "__main__":
    sys.exit(main())
