"""tools/convert_gguf.py: GGUF -> minispec checkpoint, and the `python -m minispec generate` CLI.

Fast tests write tiny llama GGUF files with gguf.GGUFWriter (random weights, permuted the way
llama.cpp's converter permutes them; a SentencePiece or byte-level BPE vocabulary trained in
the test) and check the converter against the original weights, against transformers' own
GGUF loader, and on damaged or unsupported files. Slow tests convert the real
SmolLM2-135M-Instruct GGUF and compare logits and greedy generations with transformers.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minispec import Transformer
from minispec.tokenizer import load_tokenizer

import convert_gguf as conv
from helpers import ROOT, TOOLS, leftovers, run_main
from tiny_files import add_metadata

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# tiny GGUF files

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: each head's halves interleaved into pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SPM_VOCAB = 512  # the SentencePiece vocabulary trained for the tiny models
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, ctx=256)


def tiny_hf_weights(vocab: int, tied: bool, seed: int = 0, bias: bool = False) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face layout, keyed by minispec name; with `bias`, q/k/v biases (Qwen2)."""
    rng = np.random.default_rng(seed)
    d, f, hd = TINY["dim"], TINY["ffn_dim"], TINY["dim"] // TINY["n_heads"]
    w = {"embed_tokens.weight": rng.normal(0, 0.5, (vocab, d)), "norm.weight": rng.uniform(0.5, 1.5, d)}
    if not tied:
        w["lm_head.weight"] = rng.normal(0, 0.2, (vocab, d))
    for i in range(TINY["n_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = rng.uniform(0.5, 1.5, d)
        w[p + "post_attention_layernorm.weight"] = rng.uniform(0.5, 1.5, d)
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.2, (TINY["n_heads"] * hd, d))
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.2, (TINY["n_kv_heads"] * hd, d))
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.2, (TINY["n_kv_heads"] * hd, d))
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.2, (d, TINY["n_heads"] * hd))
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.2, (f, d))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, 0.2, (f, d))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, 0.1, (d, f))
        if bias:
            for name, rows in (("q", TINY["n_heads"] * hd), ("k", TINY["n_kv_heads"] * hd),
                               ("v", TINY["n_kv_heads"] * hd)):
                w[p + f"self_attn.{name}_proj.bias"] = rng.normal(0, 0.5, rows)
    return {k: v.astype(np.float32) for k, v in w.items()}


MINISPEC_TO_GGUF = {v: k for k, v in conv._GGUF_TOP.items()}


def gguf_name(name: str) -> str:
    if name in MINISPEC_TO_GGUF:
        return MINISPEC_TO_GGUF[name]
    _, i, rest = name.split(".", 2)
    part = {v: k for k, v in conv._GGUF_LAYER_PARTS.items()}[rest]
    return f"blk.{i}.{part}"


def _k_quant_blocks(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """Random but finite K-quant blocks (gguf's Python package can dequantize K-quants, not make them)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.full((rows, cols // block), 0.002, dtype=np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == Q.Q4_K:  # d, dmin are the first two fp16 of a block
        blocks[..., 0:2], blocks[..., 2:4] = scale, scale
    elif qtype == Q.Q6_K:  # d is the last fp16 of a block
        blocks[..., -2:] = scale
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, vocab_meta: dict, weights: dict[str, np.ndarray],
                    types: dict[str, object] | None = None, arch: str = "llama", skip: tuple[str, ...] = ()) -> None:
    """A llama (or `arch`) GGUF of `weights` (minispec names, HF layout); types maps GGUF name -> GGMLQuantizationType.

    Q/K rows are permuted as llama.cpp's converter does for llama only (not for qwen2)."""
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["n_layers"])
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(TINY["dim"])
    w.add_feed_forward_length(TINY["ffn_dim"])
    w.add_head_count(TINY["n_heads"])
    w.add_head_count_kv(TINY["n_kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(TINY["dim"] // TINY["n_heads"])
    add_metadata(w, vocab_meta)
    for name, arr in weights.items():
        g = gguf_name(name)
        if g in skip:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, TINY["n_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, TINY["n_kv_heads"])
        qtype = types.get(g, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(g, arr)
        elif qtype == Q.F16:
            w.add_tensor(g, arr.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(g, _k_quant_blocks(*arr.shape, qtype, seed=len(g)), raw_dtype=qtype)
        else:
            w.add_tensor(g, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    """A small SentencePiece BPE model with Llama's settings (identity normalizer, byte fallback)."""
    spm = pytest.importorskip("sentencepiece")
    from test_tokenizer import training_lines
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()), model_writer=buf, vocab_size=SPM_VOCAB, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, byte_fallback=True,
        character_coverage=0.98, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2, max_sentence_length=100000)
    return buf.getvalue()


def spm_vocab_meta(model: bytes) -> dict:
    from minispec.tokenizer import _SentencePieceBackend
    b = _SentencePieceBackend(model)
    sp = b.sp
    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)], "tokenizer.ggml.token_type": b.types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
            "tokenizer.chat_template": "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                                       "{% if add_generation_prompt %}<s>[assistant]{% endif %}"}


@pytest.fixture(scope="module")
def tiny_spm_gguf(tmp_path_factory, spm_model):
    d = tmp_path_factory.mktemp("tiny_spm")
    weights = tiny_hf_weights(SPM_VOCAB, tied=False)
    write_tiny_gguf(d / "tiny.gguf", spm_vocab_meta(spm_model), weights)
    return d / "tiny.gguf", weights


@pytest.fixture(scope="module")
def tiny_spm_dir(tmp_path_factory, tiny_spm_gguf):
    dst = tmp_path_factory.mktemp("tiny_spm_out") / "ckpt"
    conv.convert(tiny_spm_gguf[0], dst, progress=False)
    return dst


# ---------------------------------------------------------------------------------------------
# fast: layout, dequantization, metadata

def test_unpermute_inverts_llama_cpp_permutation_with_gqa():
    rng = np.random.default_rng(1)
    for heads, rows, cols in ((4, 64, 8), (2, 32, 8), (1, 16, 3)):
        w = rng.normal(size=(rows, cols)).astype(np.float32)
        back = conv.unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
        b = rng.normal(size=rows).astype(np.float32)  # a q/k bias is permuted the same way
        permuted = torch.from_numpy(llama_cpp_permute(b, heads))
        assert torch.equal(conv.unpermute_rope_rows(permuted, heads), torch.from_numpy(b))
    # the wrong head count (MHA treatment of a GQA K) gives different rows: the test can fail
    w = rng.normal(size=(32, 4)).astype(np.float32)
    assert not torch.equal(conv.unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 2)), 4), torch.from_numpy(w))


def test_f32_gguf_round_trips_to_the_original_weights(tmp_path, spm_model):
    """F32 tensors must come back bit-exact, Q/K un-permuted with their own head counts, tied head dropped."""
    for tied in (True, False):
        weights = tiny_hf_weights(SPM_VOCAB, tied=tied, seed=3)
        src, dst = tmp_path / f"t{tied}.gguf", tmp_path / f"out{tied}"
        write_tiny_gguf(src, spm_vocab_meta(spm_model), weights)
        cfg = conv.convert(src, dst, progress=False)
        assert cfg.tie_embeddings is tied and cfg.n_kv_heads == 2 and cfg.n_heads == 4 and cfg.ffn_dim == 256
        model = Transformer.from_pretrained(dst)
        state = model.state_dict()
        assert set(state) == set(weights)
        for name, w in weights.items():
            assert torch.equal(state[name], torch.from_numpy(w)), name


def test_quantized_types_and_layout_match_transformers(tmp_path, spm_model):
    """Every supported tensor type, dequantized by gguf and by transformers' own loader, and the logits."""
    transformers = pytest.importorskip("transformers")
    weights = tiny_hf_weights(SPM_VOCAB, tied=False, seed=4)
    types = {"token_embd.weight": Q.F16, "output.weight": Q.BF16,
             "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1,
             "blk.0.attn_output.weight": Q.Q5_0, "blk.0.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_down.weight": Q.Q4_K,
             "blk.1.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q6_K}
    write_tiny_gguf(tmp_path / "q.gguf", spm_vocab_meta(spm_model), weights, types)
    conv.convert(tmp_path / "q.gguf", tmp_path / "out", progress=False)
    ours = Transformer.from_pretrained(tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, w in ours.state_dict().items():
        ref = hf_state["model." + name if name != "lm_head.weight" else name]
        assert torch.allclose(w, ref, atol=1e-6, rtol=0), f"{name}: max diff {(w - ref).abs().max()}"
    # the quantized weights really differ from the originals (the types were applied), yet Q/K are un-permuted
    q = ours.state_dict()["layers.0.self_attn.q_proj.weight"]
    assert 0 < (q - torch.from_numpy(weights["layers.0.self_attn.q_proj.weight"])).abs().max() < 0.05
    ids = torch.tensor([[1, 5, 17, 200, 3, 99, 42, 7]])
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours(ids) - ref).abs().max().item() < 1e-4


def test_config_from_metadata(tiny_spm_dir):
    cfg = json.loads((tiny_spm_dir / "config.json").read_text())
    assert cfg["vocab_size"] == SPM_VOCAB and cfg["dim"] == 64 and cfg["n_layers"] == 2 and cfg["head_dim"] == 16
    assert cfg["rope_theta"] == 10000.0 and cfg["norm_eps"] == 1e-05 and cfg["max_seq_len"] == 256
    assert cfg["bos_id"] == 1 and cfg["eos_id"] == 2 and cfg["tie_embeddings"] is False


# ---------------------------------------------------------------------------------------------
# fast: tokenizers rebuilt from GGUF metadata

def test_sentencepiece_vocab_becomes_tokenizer_model(tiny_spm_dir, spm_model):
    import sentencepiece as spm
    from test_tokenizer import varied_lines
    assert (tiny_spm_dir / "tokenizer.model").is_file() and not (tiny_spm_dir / "tokenizer.json").exists()
    tok = load_tokenizer(tiny_spm_dir)
    ref = spm.SentencePieceProcessor(model_proto=spm_model)
    assert tok.kind == "tokenizer.model" and tok.vocab_size == SPM_VOCAB and tok.add_bos
    assert (tok.bos_id, tok.eos_ids) == (1, (2,))
    for line in varied_lines(300, seed=11):
        if "<s>" in line or "</s>" in line or "<unk>" in line:
            continue  # sentencepiece itself does not match control pieces written in the text; we do
        assert tok.encode(line) == ref.encode(line, add_bos=True), repr(line)
        assert tok.decode(ref.encode(line), skip_special_tokens=True) == ref.decode(ref.encode(line))
    config = json.loads((tiny_spm_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{% for m in messages %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s><s>[assistant]"


def test_sentencepiece_gguf_tokenizer_matches_transformers(tiny_spm_gguf, tiny_spm_dir):
    transformers = pytest.importorskip("transformers")
    from test_tokenizer import varied_lines
    src = tiny_spm_gguf[0]
    hf = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok = load_tokenizer(tiny_spm_dir)
    lines = [l for l in varied_lines(300, seed=12) if l and not l[0].isspace()]
    assert len(lines) > 200
    for line in lines:
        # Hugging Face's Metaspace adds no dummy prefix to text that starts with whitespace,
        # sentencepiece does: those lines are compared with sentencepiece in the test above
        assert tok.encode(line, bos=False) == hf.encode(line, add_special_tokens=False), repr(line)
        ids = tok.encode(line)
        assert tok.decode(ids) == hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def _train_byte_level_bpe():
    from test_tokenizer import training_lines
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(training_lines(), trainer)
    return tok


def byte_level_vocab_meta(ref, pre: str) -> dict:
    """tokenizer.ggml.* metadata of the trained byte-level BPE `ref` (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2)."""
    spec = json.loads(ref.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t.startswith("<|") else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def test_gpt2_vocab_becomes_tokenizer_json(tmp_path):
    from test_tokenizer import varied_lines
    ref = _train_byte_level_bpe()
    meta = byte_level_vocab_meta(ref, "gpt2")
    tokens = meta["tokenizer.ggml.tokens"]
    write_tiny_gguf(tmp_path / "bpe.gguf", meta, tiny_hf_weights(len(tokens), tied=True))
    conv.convert(tmp_path / "bpe.gguf", tmp_path / "out", progress=False)
    tok = load_tokenizer(tmp_path / "out")
    assert tok.kind == "tokenizer.json" and not tok.add_bos and tok.vocab_size == len(tokens)
    for line in varied_lines(300, seed=13):
        assert tok.encode(line) == ref.encode(line).ids, repr(line)
        assert tok.decode(tok.encode(line)) == line  # byte-level BPE is lossless
    assert tok.encode("<|im_start|>hi<|im_end|>")[0] == 1  # control tokens are matched whole
    # an unknown pre-tokenizer is refused rather than guessed
    meta["tokenizer.ggml.pre"] = "some-future-model"
    write_tiny_gguf(tmp_path / "bad.gguf", meta, tiny_hf_weights(len(tokens), tied=True))
    with pytest.raises(conv.ConversionError, match="some-future-model"):
        conv.convert(tmp_path / "bad.gguf", tmp_path / "bad_out", progress=False)
    assert not (tmp_path / "bad_out").exists()


def test_qwen2_gguf_matches_transformers(tmp_path):
    """A tiny qwen2 GGUF as llama.cpp writes one: q/k/v biases, Q/K rows not permuted, an untied head, quantized
    types, and a token list padded with UNUSED placeholders to the embedding's rows. Weights, logits and the
    tokenizer against transformers' own GGUF loader; the padding ids get logit -inf (transformers scores them)."""
    transformers = pytest.importorskip("transformers")
    import unicodedata

    from test_tokenizer import varied_lines
    meta = byte_level_vocab_meta(_train_byte_level_bpe(), "qwen2")
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] += [f"[PAD{i}]" for i in range(n, n + 8)]
    meta["tokenizer.ggml.token_type"] += [conv.UNUSED] * 8
    meta["tokenizer.ggml.add_bos_token"] = False
    weights = tiny_hf_weights(n + 8, tied=False, seed=5, bias=True)
    types = {"token_embd.weight": Q.Q5_0, "output.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q5_0,
             "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K, "blk.1.attn_v.weight": Q.Q8_0}
    write_tiny_gguf(tmp_path / "qwen2.gguf", meta, weights, types, arch="qwen2")
    cfg = conv.convert(tmp_path / "qwen2.gguf", tmp_path / "out", progress=False)
    assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.vocab_size == n + 8 and cfg.sampled_vocab_size == n
    assert cfg.eos_id == [2, 0]  # <|im_end|>, then <|endoftext|>: Qwen2's second stop token
    ours = Transformer.from_pretrained(tmp_path / "out")
    # an F32 tensor comes back bit-exact: nothing un-permuted
    for name in ("layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight",
                 "layers.0.self_attn.k_proj.bias"):
        assert torch.equal(ours.state_dict()[name], torch.from_numpy(weights[name])), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="qwen2.gguf", dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, w in ours.state_dict().items():
        ref = hf_state["model." + name if name != "lm_head.weight" else name]
        assert torch.allclose(w, ref, atol=1e-6, rtol=0), f"{name}: max diff {(w - ref).abs().max()}"
    ids = torch.tensor([[1, 5, 17, 200, 3, 99, 42, 7]])
    with torch.no_grad():
        ref = hf(ids).logits
    logits = ours(ids)
    assert (logits[..., :n] - ref[..., :n]).abs().max().item() < 1e-4
    assert torch.isneginf(logits[..., n:]).all() and torch.isfinite(ref[..., n:]).all()
    # the tokenizer: Qwen2's split regex and byte-level BPE, as transformers builds it from the same file, and
    # NFC first, as Qwen2's own tokenizer.json (transformers' GGUF loader skips it: it differs only on text
    # that NFC changes, so those lines are compared after normalising)
    tok = load_tokenizer(tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="qwen2.gguf")
    lines = varied_lines(600, seed=14) + ["cafe\u0301 \u212b \uf900", "e\u0301\u0301"]
    for line in lines:
        nfc = unicodedata.normalize("NFC", line)
        assert tok.encode(line) == hf_tok.encode(nfc, add_special_tokens=False), repr(line)
        assert tok.decode(tok.encode(line)) == nfc
    assert sum(unicodedata.normalize("NFC", line) != line for line in lines) >= 2
    assert tok.encode("<|im_start|>user\n12345<|im_end|>")[0] == 1 and tok.eos_ids == (2,)


# ---------------------------------------------------------------------------------------------
# fast: failures leave nothing behind

def test_truncated_file_is_refused(tmp_path, tiny_spm_gguf):
    data = tiny_spm_gguf[0].read_bytes()
    for cut in (len(data) - 1000, len(data) // 2, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(conv.ConversionError, match="truncated|cannot be read as GGUF"):
            conv.convert(bad, tmp_path / "out", progress=False)
        assert leftovers(tmp_path, "out") == []


def test_unsupported_architecture_is_refused(tmp_path, spm_model):
    write_tiny_gguf(tmp_path / "gpt2.gguf", spm_vocab_meta(spm_model), tiny_hf_weights(SPM_VOCAB, True), arch="falcon")
    with pytest.raises(conv.ConversionError, match="architecture 'falcon' is not supported"):
        conv.convert(tmp_path / "gpt2.gguf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_unsupported_tensor_type_is_refused(tmp_path, spm_model):
    src = tmp_path / "iq.gguf"
    weights = tiny_hf_weights(SPM_VOCAB, True)
    write_tiny_gguf(src, spm_vocab_meta(spm_model), weights, skip=("blk.1.ffn_up.weight",))
    # rewrite with one tensor in a type the converter does not handle (IQ4_NL: 32 weights in 18 bytes)
    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    reader = gguf.GGUFReader(str(src))
    add_metadata(w, {key: conv._field_value(field) for key, field in reader.fields.items()
                     if not key.startswith("GGUF.") and key != "general.architecture"})
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.1.ffn_up.weight", np.zeros((256, 64 // 32 * 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(conv.ConversionError, match="blk.1.ffn_up.weight.*IQ4_NL"):
        conv.convert(tmp_path / "iq2.gguf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []
    # and the file without that tensor at all: a missing tensor
    with pytest.raises(conv.ConversionError, match="missing tensor.*layers.1.mlp.up_proj.weight"):
        conv.convert(src, tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_existing_destination_is_refused_or_replaced_whole(tmp_path, tiny_spm_gguf):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "marker").write_text("old")
    with pytest.raises(conv.ConversionError, match="already exists.*--overwrite"):
        conv.convert(tiny_spm_gguf[0], dst, progress=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_spm_gguf[0].read_bytes()[:5000])
    with pytest.raises(conv.ConversionError):
        conv.convert(bad, dst, overwrite=True, progress=False)
    assert (dst / "marker").read_text() == "old"  # a failed conversion leaves the old one alone
    conv.convert(tiny_spm_gguf[0], dst, overwrite=True, progress=False)  # a good one replaces it whole
    assert (dst / "marker").read_text() == "old" and (dst / "model.safetensors").is_file()  # only its own files
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]


def test_converter_command_line(tmp_path, tiny_spm_gguf):
    script = str(TOOLS / "convert_gguf.py")
    ok = subprocess.run([sys.executable, script, str(tiny_spm_gguf[0]), str(tmp_path / "out"), "--dtype", "bfloat16",
                         "--quiet"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert Transformer.from_pretrained(tmp_path / "out").dtype == torch.bfloat16
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    bad = subprocess.run([sys.executable, script, str(tmp_path / "junk.gguf"), str(tmp_path / "junk_out")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "junk.gguf" in bad.stderr
    assert not (tmp_path / "junk_out").exists()
    usage = subprocess.run([sys.executable, script, "--dtype", "int3", "a", "b"], capture_output=True, text=True)
    assert usage.returncode == 2


# ---------------------------------------------------------------------------------------------
# the generate CLI on the tiny checkpoint

def run_cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minispec", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_cli_generate_streams_text_and_reports_speed(tiny_spm_dir):
    r = run_cli("generate", "--target", str(tiny_spm_dir), "--prompt", "hi", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert re.search(r"\d+ tokens in [0-9.]+ s: [0-9.]+ tokens/s", r.stderr), r.stderr
    # what was streamed is exactly the decoded greedy continuation (the CLI stops at eos, as generate does)
    model = Transformer.from_pretrained(tiny_spm_dir)
    new = model.generate(model.tokenizer.encode("hi"), max_new_tokens=8)
    assert r.stdout == model.tokenizer.decode(new, skip_special_tokens=True) + "\n"


def test_cli_generate_variants_in_process(tiny_spm_dir, capsys):
    target = str(tiny_spm_dir)
    base = ["generate", "--target", target, "--prompt", "hi there", "--max-new-tokens", "12", "--device", "cpu"]
    assert run_main(base) == 0
    plain = capsys.readouterr()
    # greedy speculative decoding emits exactly the greedy tokens, with a draft model or prompt lookup
    for draft in (target, "prompt-lookup"):
        assert run_main(base + ["--draft", draft, "--k", "3"]) == 0
        out = capsys.readouterr()
        assert out.out == plain.out
        assert "acceptance rate" in out.err and "tokens per round" in out.err
    assert run_main(base + ["--chat", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]) == 0
    assert capsys.readouterr().err.count("tokens/s") == 1


def test_cli_refuses_a_draft_with_another_tokenizer(tiny_spm_dir, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_spm_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<unk>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    rc = run_main(["generate", "--target", str(tiny_spm_dir), "--draft", str(other), "--prompt", "hi",
                   "--device", "cpu"])
    assert rc == 1 and "tokenizers differ" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["generate", "--target", "{dir}", "--prompt", "hi", "--max-new-tokens", "-1"],
    ["generate", "--target", "{dir}", "--prompt", "hi", "--top-p", "0"],
    ["generate", "--target", "{dir}", "--prompt", "hi", "--top-k", "0"],
    ["generate", "--target", "{dir}", "--prompt", "hi", "--temperature", "-0.5"],
    ["generate", "--target", "{dir}", "--prompt", "hi", "--k", "0"],
    ["generate", "--target", "{dir}/nope", "--prompt", "hi"],
    ["generate", "--target", "{dir}"],
    ["generate", "--target", "{dir}", "--prompt", "hi", "--draft", "{dir}/nope"],
    ["generate", "--bogus"],
    ["no-such-command"],
    [],
])
def test_cli_bad_arguments_exit_2(tiny_spm_dir, args):
    assert run_main([a.replace("{dir}", str(tiny_spm_dir)) for a in args]) == 2


# ---------------------------------------------------------------------------------------------
# slow: the real SmolLM2-135M-Instruct GGUF against transformers

PROMPTS = ["Once upon a time", "The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smol_gguf):
    src = smol_gguf
    dst = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    conv.convert(src, dst, progress=False)
    return src, dst


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    transformers = pytest.importorskip("transformers")
    src, _ = smollm2
    return transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    model = Transformer.from_pretrained(smollm2[1])
    assert model.config.n_kv_heads == 3 and model.config.n_heads == 9 and model.config.tie_embeddings
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([ids])).logits
        diff = (model(torch.tensor([ids])) - ref).abs().max().item()
        assert diff <= 1e-3, f"{prompt!r}: logits differ by {diff}"


@pytest.mark.slow
def test_smollm2_greedy_generation_matches_transformers(smollm2, smollm2_hf):
    model = Transformer.from_pretrained(smollm2[1])
    for prompt in PROMPTS[:3]:
        ids = model.tokenizer.encode(prompt)
        ours = model.generate(ids, max_new_tokens=64, temperature=0.0, stop_tokens=[])
        # 64 tokens without stopping at eos on either side (min_new_tokens would instead forbid eos in HF)
        ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
        assert len(ours) == len(ref) == 64
        decode = model.tokenizer.decode
        assert ours == ref, f"{prompt!r}:\n ours {decode(ours)!r}\n   hf {decode(ref)!r}"


@pytest.mark.slow
def test_smollm2_cli_generate(smollm2):
    r = run_cli("generate", "--target", str(smollm2[1]), "--prompt", "hi", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "tokens/s" in r.stderr
    r = run_cli("generate", "--target", str(smollm2[1]), "--chat", "--prompt", "What is the capital of France?",
                "--max-new-tokens", "16", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
