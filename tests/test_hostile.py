"""Hostile and broken input, class by class: a clear one-line error, or a bounded and correct result.

Each test names the class of input it covers (see the module's sections): config values,
counts checked before anything is built, tensor dtypes, lazily grown RoPE tables and KV
cache, rows that cannot be sampled, tokenizer files, chat templates, GGUF tensor layout,
Hugging Face shard names and pickles, interrupted writes (real processes killed with
SIGKILL), and the command lines. tests/test_fuzz.py throws random mutations at the same
loaders.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import minispec.tokenizer as tokenizer_module
from minispec import CacheExhausted, CheckpointError, ModelConfig, PagedKVCache, Transformer
from minispec.checkpoint import atomic_output_dir, recover_output_dir
from minispec.config import ConfigError
from minispec.errors import InputError
from minispec.sampling import SamplingError, SamplingParams, logits_to_probs, sample_rows
from minispec.tokenizer import TokenizerError, load_tokenizer

import convert_gguf as conv
import convert_hf
import export_hf
from helpers import LLAMA3, ROOT, TOOLS, Payload, leftovers, run_main
from tiny_files import TINY, llama_vocab, tiny_checkpoint, tiny_gguf, tiny_tokenizer_dir

gguf = pytest.importorskip("gguf")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TOOLS), os.environ.get("PYTHONPATH", "")])}


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    tiny_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


# ---------------------------------------------------------------------------------------------
# config values: finite, in range, of the right type

BASE = dict(vocab_size=16, dim=32, n_layers=1, n_heads=4)
BAD_CONFIGS = {
    "n_heads 0": (dict(n_heads=0), "n_heads must be a positive integer"),
    "dim as a string": (dict(dim="32"), "dim must be a positive integer"),
    "n_layers as a float": (dict(n_layers=2.0), "n_layers must be a positive integer"),
    "n_layers as a bool": (dict(n_layers=True), "n_layers must be a positive integer"),
    "max_seq_len 2**40": (dict(max_seq_len=2**40), "max_seq_len must be a positive integer"),
    "norm_eps as a string": (dict(norm_eps="1e-5"), "norm_eps must be a finite number"),
    "norm_eps NaN": (dict(norm_eps=float("nan")), "norm_eps must be a finite number"),
    "rope_theta NaN": (dict(rope_theta=float("nan")), "rope_theta must be a finite number"),
    "rope_theta inf": (dict(rope_theta=float("inf")), "rope_theta must be a finite number"),
    "rope_theta below 1": (dict(rope_theta=1e-30), "rope_theta must be a finite number >= 1"),
    "tie_embeddings 'false'": (dict(tie_embeddings="false"), "tie_embeddings must be true or false"),
    "qkv_bias 1": (dict(qkv_bias=1), "qkv_bias must be true or false"),
    "rope_scaling a string": (dict(rope_scaling="llama3"), "rope_scaling must be a dict"),
    "llama3 without factor": (dict(rope_scaling={"rope_type": "llama3"}), "needs 'factor'"),
    "llama3 factor 0": (dict(rope_scaling={**LLAMA3, "factor": 0}), "factor must be a finite number >= 1"),
    "llama3 factor NaN": (dict(rope_scaling={**LLAMA3, "factor": float("nan")}), "factor must be a finite number"),
    "llama3 equal bands": (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "greater than low_freq_factor"),
    "llama3 bad length": (dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": "8k"}),
                          "original_max_position_embeddings must be a positive integer"),
    "llama3 unknown key": (dict(rope_scaling={**LLAMA3, "beta": 1}), r"unknown key\(s\) \['beta'\]"),
    "eos '</s>'": (dict(eos_id="</s>"), "eos_id must be a token id"),
    "eos float": (dict(eos_id=2.0), "eos_id must be a token id"),
    "eos empty list": (dict(eos_id=[]), "eos_id must be a token id"),
    "bos bool": (dict(bos_id=True), "bos_id must be a token id"),
    "head_vocab_size bool": (dict(head_vocab_size=True, tie_embeddings=False), "head_vocab_size must be in"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_config_values_are_checked(case):
    kw, msg = BAD_CONFIGS[case]
    with pytest.raises(ConfigError, match=msg):
        ModelConfig(**{**BASE, **kw})


def test_config_accepts_what_real_checkpoints_hold():
    """Negative control: ints where floats go, llama3 scaling with defaults, eos lists, huge context lengths."""
    ModelConfig(**BASE, norm_eps=1, rope_theta=500000, eos_id=[1, 2], max_seq_len=2**31 - 1,
                rope_scaling={"rope_type": "llama3", "factor": 8})
    ModelConfig(**BASE, rope_scaling=LLAMA3, tie_embeddings=False, head_vocab_size=4)


def test_config_json_with_nan_or_non_utf8_is_refused_naming_the_file(ckpt):
    text = (ckpt / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": NaN')
    (ckpt / "config.json").write_text(text)  # Python's json reads NaN
    with pytest.raises(ConfigError, match=r"config.json: ModelConfig.rope_theta must be a finite number.*nan"):
        Transformer.from_pretrained(ckpt)
    (ckpt / "config.json").write_bytes(b'{"vocab_size": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"config.json is not UTF-8 text"):
        Transformer.from_pretrained(ckpt)
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nests JSON too deeply"):
        Transformer.from_pretrained(ckpt)
    (ckpt / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")  # past Python's int digit limit
    with pytest.raises(ConfigError, match="not valid JSON"):
        Transformer.from_pretrained(ckpt)


# ---------------------------------------------------------------------------------------------
# counts are compared with the weights file before anything is built

def test_absurd_layer_count_is_refused_before_building(ckpt):
    Transformer.from_pretrained(ckpt)  # negative control, and torch's one-time set-up of the meta device (seconds)
    edit_json(ckpt / "config.json", n_layers=10**9)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="n_layers=1000000000, the weights hold 1 layer"):
        Transformer.from_pretrained(ckpt)
    assert time.perf_counter() - start < 5  # building 10**9 layers, even on the meta device, never ends


def test_absurd_dims_and_vocab_are_refused_by_shape(ckpt):
    for field in ("dim", "vocab_size", "ffn_dim"):
        tiny_checkpoint(ckpt)
        edit_json(ckpt / "config.json", **{field: 2**31 - 1})
        with pytest.raises(CheckpointError, match="has shape .* the config expects"):
            Transformer.from_pretrained(ckpt)


@pytest.mark.parametrize("dtype, tag", [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8_E4M3"),
                                        (torch.float64, "F64")])
def test_unsupported_tensor_dtypes_are_named(ckpt, dtype, tag):
    state = load_file(ckpt / "model.safetensors")
    state["norm.weight"] = state["norm.weight"].to(dtype)
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor 'norm.weight' has dtype {tag}; minispec reads F32/BF16/F16"):
        Transformer.from_pretrained(ckpt)
    with pytest.raises(CheckpointError, match=f"'norm.weight' has dtype {tag}"):
        export_hf.export(ckpt, ckpt.parent / "hf", progress=False)


def test_subset_head_ids_must_be_distinct_ids(tmp_path):
    model = tiny_checkpoint(tmp_path / "d", tie_embeddings=False, head_vocab_size=3)
    for bad in ([0, 1, 16], [0, 1, 1], [-1, 1, 2]):
        with torch.no_grad():
            model.head_ids.copy_(torch.tensor(bad))
        model.save_pretrained(tmp_path / "d")
        with pytest.raises(CheckpointError, match="head_ids must be distinct token ids in"):
            Transformer.from_pretrained(tmp_path / "d")


# ---------------------------------------------------------------------------------------------
# RoPE tables and the KV cache grow with use: nothing is sized by max_seq_len or max_new_tokens

def test_huge_max_seq_len_allocates_nothing_and_changes_nothing(ckpt):
    small = Transformer.from_pretrained(ckpt)  # max_seq_len 64
    edit_json(ckpt / "config.json", max_seq_len=2**31 - 1)
    huge = Transformer.from_pretrained(ckpt)
    assert huge.rope_cos.numel() == 0  # a table for 2**31 positions would take 64 GiB at this head width
    prompt = [1, 3, 4, 5]
    assert huge.generate(prompt, max_new_tokens=60, stop_tokens=[]) == small.generate(prompt, max_new_tokens=60,
                                                                                        stop_tokens=[])
    assert len(huge.generate(prompt, max_new_tokens=100, stop_tokens=[])) == 100  # past the small model's limit
    assert 104 <= huge.rope_cos.shape[0] <= 2 * 104  # grown to what the sequences used, within a factor of two


def test_rope_rows_do_not_change_when_the_tables_grow():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 4096}))
    model(torch.randint(0, 16, (1, 10)))
    cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
    model(torch.randint(0, 16, (1, 300)))
    assert model.rope_cos.shape[0] >= 300
    assert torch.equal(model.rope_cos[:len(cos)], cos) and torch.equal(model.rope_sin[:len(sin)], sin)
    # the cached path, its tables growing twice on the way, equals the full forward of a fresh model
    seq = torch.randint(0, 16, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    fresh = Transformer(ModelConfig(**{**TINY, "max_seq_len": 4096}))
    fresh.load_state_dict(model.state_dict())
    cache = fresh.new_cache(block_size=8)
    s = cache.new_sequence()
    steps = [fresh.step(cache, [s], [seq[:70]])] + [fresh.step(cache, [s], [[t]]) for t in seq[70:149]]
    assert 149 <= fresh.rope_cos.shape[0] < 300  # 70 rows, then 140, then 280
    torch.testing.assert_close(torch.cat(steps), model(torch.tensor([seq]))[0, 69:149], rtol=1e-4, atol=1e-4)


def test_growing_cache_keeps_contents_and_respects_its_bound():
    c = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, block_size=2)
    assert c.num_blocks == 0 and c.kv.numel() == 0
    s = c.new_sequence()
    (slots,) = c.reserve([s], [3])
    c.k[:, slots] = torch.tensor([1.0, 2.0, 3.0]).view(1, -1, 1, 1)
    (more,) = c.reserve([s], [6])
    c.k[:, more] = torch.arange(4.0, 10.0).view(1, -1, 1, 1)
    assert c.k[0, c.slots(s), 0, 0].tolist() == list(range(1, 10)) and c.num_blocks >= 5
    c.check_consistency()
    bounded = PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, block_size=2, max_blocks=2)
    t = bounded.new_sequence()
    bounded.reserve([t], [4])
    with pytest.raises(CacheExhausted, match="raise the growing cache's max_blocks=2"):
        bounded.reserve([t], [1])
    assert (bounded.num_blocks, bounded.length(t)) == (2, 4)  # nothing changed
    with pytest.raises(ValueError, match="max_blocks bounds a growing cache"):
        PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=4, max_blocks=8)


def test_generate_reserves_no_cache_for_tokens_it_does_not_make(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 2**20}))
    first = model.generate([1, 2, 3], max_new_tokens=1)[0]
    made, new_cache = [], model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda **kw: made.append(new_cache(**kw)) or made[-1])
    assert model.generate([1, 2, 3], max_new_tokens=2**20, stop_tokens=[first]) == [first]
    assert made[0].num_blocks == 1  # reserving min(max_new_tokens, max_seq_len) would be 65537 blocks


@pytest.mark.parametrize("block_size", [0, 2.5, 2**40, True])
def test_block_size_is_checked(block_size):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1 and <= 65536"):
        model.generate([1, 2], max_new_tokens=2, block_size=block_size)


# ---------------------------------------------------------------------------------------------
# sampling: rows that cannot be sampled are refused, naming the setting

def test_tiny_temperature_is_refused_naming_it():
    logits = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]])
    for t in (1e-45, 1e-300):
        with pytest.raises(SamplingError, match=f"temperature={t!r} is too small"):
            logits_to_probs(logits, SamplingParams(temperature=t))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1e-3)).max(-1).values, torch.ones(2))


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))  # 0 in float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    assert model.generate([1, 2], max_new_tokens=8, temperature=1.0, top_p=1e-300, seed=0, stop_tokens=[]) == \
        model.generate([1, 2], max_new_tokens=8, stop_tokens=[])  # only the argmax is left: greedy


def test_nonfinite_logits_and_empty_rows_are_refused():
    for bad in ([[0.0, float("nan"), 1.0]], [[0.0, float("inf"), 1.0]], [[float("-inf")] * 3]):
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=2)):
            with pytest.raises(SamplingError, match="logits are"):
                logits_to_probs(torch.tensor(bad), params)
    ok = logits_to_probs(torch.tensor([[0.0, float("-inf"), 1.0]]), SamplingParams(temperature=1.0))  # -inf: p = 0
    assert ok[0, 1] == 0 and torch.isfinite(ok).all()
    u = torch.tensor([0.5])
    for row in ([0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5], [0.5, -0.1, 0.6]):
        with pytest.raises(SamplingError, match="probability row 0"):
            sample_rows(torch.tensor([row]), u)
    assert sample_rows(torch.tensor([[0.0, 1.0, 0.0]]), u) == [1]


def test_greedy_generation_refuses_nan_logits():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    model.generate([1, 2], max_new_tokens=2)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with pytest.raises(SamplingError, match="NaN or \\+inf"):
        model.generate([1, 2], max_new_tokens=2)


@pytest.mark.parametrize("seed", [2**64, 2**63, -1, 1.5, "abc", True])
def test_seeds_are_checked(seed):
    model = Transformer(ModelConfig(**TINY))
    for run in (model.generate, lambda *a, **kw: model.speculate("prompt-lookup", *a, **kw).tokens):
        with pytest.raises(SamplingError, match="seed must be an integer in"):  # before any work, even none to do
            run([1, 2], max_new_tokens=0, temperature=1.0, seed=seed)
        assert len(run([1, 2], max_new_tokens=1, temperature=1.0, seed=2**63 - 1, stop_tokens=[])) == 1


@pytest.mark.parametrize("stop", [[1.5], ["2"], [16], [-1], [True], "2"])
def test_stop_tokens_are_checked(stop):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="stop_tokens"):
        model.generate([1, 2], max_new_tokens=2, stop_tokens=stop)


# ---------------------------------------------------------------------------------------------
# tokenizer files

@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                  "chat_template.jinja"])
def test_non_utf8_tokenizer_files_are_named(tmp_path, name):
    d = tiny_tokenizer_dir(tmp_path / "tok")
    (d / name).write_bytes(b'{"bos_token": "\xff"}')
    with pytest.raises(TokenizerError, match=f"{d}: {name} is not UTF-8 text"):
        load_tokenizer(d)


@pytest.mark.parametrize("changes, msg", [
    ({"add_bos_token": "false"}, "add_bos_token must be true or false"),
    ({"eos_token": 2}, "eos_token must be a token string"),
    ({"chat_template": 5}, "chat_template must be a string"),
])
def test_tokenizer_config_fields_are_typed(tmp_path, changes, msg):
    d = tiny_tokenizer_dir(tmp_path / "tok")
    edit_json(d / "tokenizer_config.json", **changes)
    with pytest.raises(TokenizerError, match=msg):
        load_tokenizer(d)


def test_empty_tokenizer_model_is_refused(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match="holds no tokens"):
        load_tokenizer(tmp_path)


def test_decode_refuses_ids_that_are_not_integers(tmp_path):
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / "tok"))
    assert tok.decode(np.array([3, 4])) == tok.decode(torch.tensor([3, 4])) == tok.decode([3, 4])  # integer arrays
    for ids in ([3.7], [True], torch.tensor([3.0]), [3, "4"], "34", 3):
        with pytest.raises(TokenizerError, match="not an integer|must be a list of integers"):
            tok.decode(ids)
    with pytest.raises(TokenizerError, match="not an integer"):
        tok.decoder_stream().push([1.5])


def test_tokenizer_must_fit_the_model_vocabulary(tmp_path):
    tiny_checkpoint(tmp_path / "small", vocab_size=8)
    tiny_tokenizer_dir(tmp_path / "small")  # 16 tokens for an 8-row embedding
    with pytest.raises(CheckpointError, match="the tokenizer has 16 tokens, more than the model's vocab_size=8"):
        Transformer.from_pretrained(tmp_path / "small")
    tiny_checkpoint(tmp_path / "eos", vocab_size=32, eos_id=20)
    tiny_tokenizer_dir(tmp_path / "eos")
    with pytest.raises(CheckpointError, match="eos_id 20 is not in the tokenizer's vocabulary of 16"):
        Transformer.from_pretrained(tmp_path / "eos")
    tiny_checkpoint(tmp_path / "padded", vocab_size=32, eos_id=2)  # negative control: a padded embedding loads
    tiny_tokenizer_dir(tmp_path / "padded")
    assert Transformer.from_pretrained(tmp_path / "padded").tokenizer.vocab_size == 16


# ---------------------------------------------------------------------------------------------
# chat templates: sandboxed, with time, memory and output limits

@pytest.fixture
def strict_limits(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "CHAT_TEMPLATE_SECONDS", 1.0)
    monkeypatch.setattr(tokenizer_module, "CHAT_TEMPLATE_MAX_CHARS", 10_000)
    monkeypatch.setattr(tokenizer_module, "CHAT_TEMPLATE_MEMORY", 256 * 2**20)


HOSTILE_TEMPLATES = {
    "endless loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "ran longer than 1 s"),
    "huge allocation": ("{{ 'x' * 10**10 }}", "more memory|died"),
    "exponential structure": ("{% set ns = namespace(x=[1]) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}"
                              "{% endfor %}{{ ns.x }}", "ran longer|more memory|died"),
    "endless output": ("{% for i in range(100000) %}xxxxxxxx{% endfor %}", "writes more than 10000 characters"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
    "python internals": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "type error": ("{{ messages + 1 }}", "TypeError"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_are_stopped(tmp_path, strict_limits, case):
    template, msg = HOSTILE_TEMPLATES[case]
    d = tiny_tokenizer_dir(tmp_path / "tok")
    edit_json(d / "tokenizer_config.json", chat_template=template)
    tok = load_tokenizer(d)
    limit = resource.getrlimit(resource.RLIMIT_AS)
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=msg):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 10
    assert resource.getrlimit(resource.RLIMIT_AS) == limit  # the limits bind the renderer, not this process


def test_chat_template_renders_as_in_process(tmp_path, strict_limits):
    """Negative control: a normal template gives what jinja gives in this process."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / "tok"))
    msgs = [{"role": "user", "content": "ab cd \u00e9\ud83d\ude00"}]
    text = tok.apply_chat_template(msgs)
    assert text == tokenizer_module._render_limited(
        tok.chat_template, dict(messages=msgs, add_generation_prompt=True, **tok.special_tokens), 10_000)
    assert text == "<s>user ab cd \u00e9\ud83d\ude00</s><s>assistant"


# ---------------------------------------------------------------------------------------------
# GGUF: tensor layout and metadata are checked before anything is built or written

def _set_offset(path: Path, index: int, value) -> None:
    """Rewrite tensor `index`'s data offset (relative to the data section) in the GGUF file."""
    reader = gguf.GGUFReader(str(path), "r+")
    offsets = [int(t.field.parts[5][0]) for t in reader.tensors]
    reader.tensors[index].field.parts[5][0] = value(offsets) if callable(value) else value
    reader.data.flush()
    del reader


@pytest.mark.parametrize("spoil, msg", [
    (lambda o: o[0], "overlaps or precedes"),  # tensor 1 reads tensor 0's bytes
    (lambda o: o[2] + 32, "overlaps or precedes"),  # tensor 1 after tensor 2's start: out of order
    (lambda o: o[1] + 4, "not a multiple of the alignment 32"),
    (lambda o: 2**40, "truncated"),
])
def test_gguf_tensor_offsets_must_be_ordered_aligned_and_inside(tmp_path, spoil, msg):
    src = tiny_gguf(tmp_path / "m.gguf")
    conv.convert(src, tmp_path / "ok", progress=False)  # negative control: the unspoiled file converts
    _set_offset(src, 1, spoil)
    with pytest.raises(conv.ConversionError, match=msg):
        conv.convert(src, tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("meta, msg", [
    (dict(block_count=10**9), "n_layers=1000000000, the weights hold 1 layer"),
    (dict(**{"attention.head_count": 0}), "head_count must be a positive integer"),
    (dict(**{"attention.head_count": "2"}), "head_count must be a positive integer"),
    (dict(**{"attention.head_count_kv": [1, 1]}), "per-layer lists are not supported"),
    (dict(context_length=2**40), "context_length must be a positive integer"),
    (dict(**{"attention.layer_norm_rms_epsilon": float("nan")}), "layer_norm_rms_epsilon must be a finite"),
    (dict(**{"rope.freq_base": float("inf")}), "freq_base must be a finite"),
])
def test_gguf_metadata_is_checked_before_building(tmp_path, meta, msg):
    src = tiny_gguf(tmp_path / "m.gguf", **meta)
    start = time.perf_counter()
    with pytest.raises(conv.ConversionError, match=msg):
        conv.convert(src, tmp_path / "out", progress=False)
    assert time.perf_counter() - start < 10 and leftovers(tmp_path, "out") == []


def test_gguf_huge_context_converts_without_allocating(tmp_path):
    src = tiny_gguf(tmp_path / "m.gguf", context_length=2**31 - 1)
    conv.convert(src, tmp_path / "out", progress=False)
    model = Transformer.from_pretrained(tmp_path / "out")
    assert model.config.max_seq_len == 2**31 - 1 and model.rope_cos.numel() == 0
    assert len(model.generate([1, 3], max_new_tokens=3, stop_tokens=[])) == 3


def test_gguf_token_ids_and_vocabulary_are_checked(tmp_path):
    vocab = {**llama_vocab(), "tokenizer.ggml.eos_token_id": "</s>"}
    with pytest.raises(conv.ConversionError, match="eos_token_id must be a token id"):
        conv.convert(tiny_gguf(tmp_path / "a.gguf", vocab), tmp_path / "out", progress=False)
    vocab = {**llama_vocab(), "tokenizer.ggml.tokens": llama_vocab()["tokenizer.ggml.tokens"] + ["\u2581x"],
             "tokenizer.ggml.scores": llama_vocab()["tokenizer.ggml.scores"] + [0.0],
             "tokenizer.ggml.token_type": llama_vocab()["tokenizer.ggml.token_type"] + [1]}
    with pytest.raises(conv.ConversionError, match="lists 17 tokens, the embedding has only 16 rows"):
        conv.convert(tiny_gguf(tmp_path / "b.gguf", vocab), tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_gguf_whose_output_would_not_load_fails_and_writes_nothing(tmp_path):
    """A llama vocabulary without an unknown piece: sentencepiece cannot load the tokenizer.model it makes."""
    src = tiny_gguf(tmp_path / "m.gguf", llama_vocab(with_unknown=False))
    r = subprocess.run([sys.executable, str(TOOLS / "convert_gguf.py"), str(src), str(tmp_path / "out"), "--quiet"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: the checkpoint converted from") and "unk is not defined" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert leftovers(tmp_path, "out") == []
    conv.convert(tiny_gguf(tmp_path / "ok.gguf", llama_vocab()), tmp_path / "out", progress=False)  # control


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints: shard names, config types, dtypes, pickles

@pytest.fixture
def hf_dir(tmp_path) -> Path:
    tiny_checkpoint(tmp_path / "ms", tie_embeddings=False, bos_id=1, eos_id=2)
    export_hf.export(tmp_path / "ms", tmp_path / "hf", progress=False)
    return tmp_path / "hf"


def _shard(hf_dir: Path, name: str) -> None:
    keys = list(load_file(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in keys}}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors", 7])
def test_hf_shard_names_must_stay_inside_the_source(hf_dir, shard):
    (hf_dir.parent / "outside.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    _shard(hf_dir, shard)
    with pytest.raises(convert_hf.ConversionError, match="which is not a file inside"):
        convert_hf.convert(hf_dir, hf_dir.parent / "out", progress=False)
    assert leftovers(hf_dir.parent, "out") == []


def test_hf_shard_inside_the_source_converts(hf_dir):
    """Negative control: an index naming a file in the directory (a symlink, as in the Hub cache, included)."""
    _shard(hf_dir, "model-00001-of-00001.safetensors")
    (hf_dir / "model.safetensors").rename(hf_dir / "blob")
    (hf_dir / "model-00001-of-00001.safetensors").symlink_to(hf_dir / "blob")
    convert_hf.convert(hf_dir, hf_dir.parent / "out", progress=False)


@pytest.mark.parametrize("file, changes, msg", [
    ("generation_config.json", dict(eos_token_id="</s>"), "generation_config.json: eos_token_id must be a token id"),
    ("generation_config.json", dict(eos_token_id=[2, 2.5]), "eos_token_id must be a token id"),
    ("config.json", dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a number"),
    ("config.json", dict(rope_theta=[1]), "rope_theta must be a number"),
    ("config.json", dict(tie_word_embeddings="false"), "tie_embeddings must be true or false"),
    ("config.json", dict(num_hidden_layers=10**9), "n_layers=1000000000"),
    ("config.json", dict(num_attention_heads=0), "n_heads must be a positive integer"),
    ("config.json", dict(rope_scaling="llama3"), "rope_scaling must be an object"),
    ("config.json", dict(rope_scaling={**LLAMA3, "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4}),
     "factor must be"),
    ("config.json", dict(sliding_window="4k"), "sliding_window must be an integer"),
])
def test_hf_config_values_are_checked(hf_dir, file, changes, msg):
    edit_json(hf_dir / file, **changes)
    start = time.perf_counter()
    with pytest.raises(InputError, match=msg):
        convert_hf.convert(hf_dir, hf_dir.parent / "out", progress=False)
    assert time.perf_counter() - start < 10 and leftovers(hf_dir.parent, "out") == []


@pytest.mark.parametrize("dtype, msg", [(torch.int32, "dtype torch.int32; model weights are floating point"),
                                        (torch.float8_e4m3fn, "dtype F8_E4M3, which minispec does not read"),
                                        (torch.float64, "pass --dtype float32")])
def test_hf_tensor_dtypes_are_checked(hf_dir, dtype, msg):
    state = load_file(hf_dir / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(dtype)
    save_file(state, hf_dir / "model.safetensors")
    with pytest.raises(convert_hf.ConversionError, match=msg):
        convert_hf.convert(hf_dir, hf_dir.parent / "out", progress=False)


def test_malicious_pickle_is_refused_without_running_it(hf_dir):
    marker = hf_dir.parent / "pwned"
    state = {k: v for k, v in load_file(hf_dir / "model.safetensors").items()}
    state["model.norm.weight"] = Payload(marker)
    with open(hf_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump(state, f)  # a legacy (non-zip) pickle; torch.save writes the zip format: both are refused
    (hf_dir / "model.safetensors").unlink()
    torch.save(state, hf_dir.parent / "zip.bin")
    for pickled in (hf_dir / "pytorch_model.bin", hf_dir.parent / "zip.bin"):
        (hf_dir / "pytorch_model.bin").write_bytes(pickled.read_bytes())
        r = subprocess.run([sys.executable, str(TOOLS / "convert_hf.py"), str(hf_dir), str(hf_dir.parent / "out"),
                            "--quiet"], capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 1 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1
        assert "weights_only=True" in r.stderr
        assert "set to False" not in r.stderr and "weights_only=False" not in r.stderr  # never advise it
        assert not marker.exists() and leftovers(hf_dir.parent, "out") == []


# ---------------------------------------------------------------------------------------------
# interrupted writes: real processes killed with SIGKILL at a chosen point

KILLED_WRITER = """
import os, signal, sys
import minispec.checkpoint as ck
dst, when = sys.argv[1], sys.argv[2]
if when == "between-renames":  # die right after the first rename of the overwrite (dst -> .old)
    real = os.replace
    def replace(a, b):
        real(a, b)
        os.kill(os.getpid(), signal.SIGKILL)
    ck.os.replace = replace
with ck.atomic_output_dir(dst, overwrite=True) as tmp:
    (tmp / "marker").write_text("new")
    if when == "while-writing":
        os.kill(os.getpid(), signal.SIGKILL)
    if when == "wait":
        print("ready", flush=True)
        sys.stdin.read()
"""


def _old_dir(tmp_path: Path) -> Path:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "marker").write_text("old")
    return tmp_path / "dst"


def _leftovers(tmp_path: Path) -> list[str]:
    """The kinds of temporary (.dst.tmp, .dst.old) that writes of tmp_path/dst left beside it."""
    return sorted(name.split("-")[0] for name in leftovers(tmp_path, "dst") if name != "dst")


def test_killed_write_leaves_a_temporary_that_the_next_write_removes(tmp_path):
    dst = _old_dir(tmp_path)
    r = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dst), "while-writing"], env=ENV, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert _leftovers(tmp_path) == [".dst.tmp"] and (dst / "marker").read_text() == "old"
    with atomic_output_dir(dst, overwrite=True) as tmp:
        (tmp / "marker").write_text("newer")
    assert _leftovers(tmp_path) == [] and (dst / "marker").read_text() == "newer"


def test_kill_between_the_renames_is_recovered(tmp_path):
    dst = _old_dir(tmp_path)
    r = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dst), "between-renames"], env=ENV, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert not dst.exists() and _leftovers(tmp_path) == [".dst.old", ".dst.tmp"]
    with pytest.raises(FileNotFoundError, match="an overwrite of it was interrupted"):
        Transformer.from_pretrained(dst)
    recover_output_dir(dst)
    assert (dst / "marker").read_text() == "old" and _leftovers(tmp_path) == []


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    dst = _old_dir(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(dst), "wait"], env=ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with atomic_output_dir(dst, overwrite=True) as tmp:
            (tmp / "marker").write_text("mine")
        assert _leftovers(tmp_path) == [".dst.tmp"] and (dst / "marker").read_text() == "mine"
    finally:
        child.kill()
        child.wait()
    recover_output_dir(dst)  # now its writer is dead
    assert _leftovers(tmp_path) == [] and (dst / "marker").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# command lines: one line, non-zero exit, no traceback

@pytest.mark.parametrize("device, msg", [("potato", "'potato' is not a device"),
                                         ("cuda:7" if torch.cuda.is_available() else "cuda", "cuda"),
                                         ("meta", "cannot run a model")])
def test_cli_refuses_devices_it_cannot_use(tmp_path, capsys, device, msg):
    tiny_checkpoint(tmp_path / "m")
    rc = run_main(["generate", "--target", str(tmp_path / "m"), "--prompt", "a", "--device", device])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize("spoil, msg", [
    (lambda d: edit_json(d / "config.json", norm_eps=float("nan")), "norm_eps must be a finite number"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\xff"), "tokenizer.json is not UTF-8 text"),
    (lambda d: edit_json(d / "tokenizer_config.json", chat_template="{{ 'x' * 10**12 }}"), "chat template"),
])
def test_cli_user_errors_are_one_line(tmp_path, capsys, spoil, msg):
    d = tmp_path / "m"
    tiny_checkpoint(d, eos_id=2)
    tiny_tokenizer_dir(d)
    assert run_main(["generate", "--target", str(d), "--prompt", "a b", "--chat", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    spoil(d)
    assert run_main(["generate", "--target", str(d), "--prompt", "a b", "--chat", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1


def test_tools_user_errors_are_one_line(tmp_path):
    tiny_checkpoint(tmp_path / "m")
    edit_json(tmp_path / "m" / "config.json", n_layers="2")
    for tool, src in (("export_hf.py", tmp_path / "m"), ("convert_gguf.py", tmp_path / "missing.gguf"),
                      ("convert_hf.py", tmp_path / "m")):
        r = subprocess.run([sys.executable, str(TOOLS / tool), str(src), str(tmp_path / "out"), "--quiet"],
                           capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 1 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN or +inf"), (float("inf"), "NaN or +inf"), (None, None)])
def test_unsampleable_logits_are_named_whatever_the_row(bad, what):
    from minispec.errors import unsampleable
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[0, :10] = float("-inf")  # some -inf alone is a probability of 0: sampleable
    if bad is not None:
        logits[2, 49] = bad
    assert unsampleable(logits) == what
    logits[1] = float("-inf")  # a row with no token at all
    assert unsampleable(logits) == (what or "-inf for every token")
    logits[1, 3], logits[0, 0] = float("nan"), float("nan")  # NaN beside -inf: NaN is named
    assert unsampleable(logits) == "NaN or +inf"
