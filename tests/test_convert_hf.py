"""tools/convert_hf.py and tools/export_hf.py on tiny random checkpoints written by transformers.

- Conversion of every weights layout transformers and the Hub use (one
  model.safetensors, sharded safetensors with an index, pytorch_model.bin,
  sharded .bin) gives transformers' logits.
- Export to LlamaForCausalLM / Qwen2ForCausalLM loads in transformers with
  minispec's logits, and converting the export back gives the same tensors.
- Bad input fails with a message that says what is wrong, and leaves no
  DST directory (and no temporary directory) behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minispec import ModelConfig, Transformer
from minispec.checkpoint import CheckpointError
from minispec.hf_export import ExportWarning

import convert_hf
from convert_hf import ConversionError, convert
from export_hf import export
from helpers import HF_VOCAB, LLAMA3, TOOLS, hf_logits, leftovers, make_hf, scramble_

transformers = pytest.importorskip("transformers")

VOCAB, TOL = HF_VOCAB, 1e-4


def save_hf(model, path: Path, layout: str) -> None:
    """Write `model` the way Hugging Face checkpoints come: "single", "sharded", "bin" or "bin_sharded"."""
    if layout == "single":
        model.save_pretrained(path)
    elif layout == "sharded":
        model.save_pretrained(path, max_shard_size="100KB")
        assert (path / "model.safetensors.index.json").is_file()
    else:  # transformers 5 no longer writes .bin (safe_serialization is gone): write it as older versions did
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        state = {k: v.clone() for k, v in model.state_dict().items()}  # clone: tied tensors saved once each
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        if layout == "bin":
            torch.save(state, path / "pytorch_model.bin")
        else:
            names = list(state)
            shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
            for fname, keys in shards.items():
                torch.save({k: state[k] for k in keys}, path / fname)
            index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
            (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def tokens(seed: int = 1, T: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


# ---- conversion ----

CONVERT_CASES = {
    # name: (architecture, layout, HF config overrides)
    "llama_single": ("llama", "single", dict(rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama_sharded": ("llama", "sharded", dict(num_key_value_heads=1)),
    "llama_bin": ("llama", "bin", dict(tie_word_embeddings=True)),
    "llama_bin_sharded": ("llama", "bin_sharded", dict(num_key_value_heads=4)),
    "qwen2_single": ("qwen2", "single", dict(tie_word_embeddings=True)),
    "qwen2_sharded": ("qwen2", "sharded", dict()),
    "qwen2_bin": ("qwen2", "bin", dict(rope_theta=1000000.0)),
}


@pytest.mark.parametrize("case", sorted(CONVERT_CASES))
def test_convert_matches_transformers(tmp_path, case):
    arch, layout, overrides = CONVERT_CASES[case]
    hf = make_hf(arch, seed=sorted(CONVERT_CASES).index(case), **overrides)
    save_hf(hf, tmp_path / "hf", layout)
    cfg = convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    model = Transformer.from_pretrained(tmp_path / "ms")
    x = tokens()
    torch.testing.assert_close(model(x), hf_logits(hf, x), atol=TOL, rtol=0, msg=lambda m: f"{case}: {m}")
    with safe_open(str(tmp_path / "ms" / "model.safetensors"), framework="pt") as f:
        # tied: config.json says lm_head is the embedding, so no second copy is written
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_embeddings) == (not hf.config.tie_word_embeddings)
    assert cfg.qkv_bias == (arch == "qwen2")


def test_untied_checkpoint_with_equal_lm_head_stays_untied(tmp_path):
    hf = make_hf("llama")
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    hf.save_pretrained(tmp_path / "hf")
    cfg = convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    assert not cfg.tie_embeddings  # do what config.json says, not what the numbers happen to be
    assert "lm_head.weight" in load_file(str(tmp_path / "ms" / "model.safetensors"))


def test_cli_dtype_and_generation_config_eos_list(tmp_path, capsys):
    hf = make_hf("llama")
    hf.generation_config.eos_token_id = [2, 5]  # Llama 3 instruct stops on several tokens
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main([str(tmp_path / "hf"), str(tmp_path / "ms"), "--dtype", "bfloat16", "--quiet"]) == 0
    with safe_open(str(tmp_path / "ms" / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    model = Transformer.from_pretrained(tmp_path / "ms")
    assert model.dtype == torch.bfloat16
    assert (model.config.bos_id, model.config.eos_id) == (1, [2, 5])
    x = tokens()
    assert (model(x) - hf_logits(hf, x)).abs().max() < 0.2  # bf16 weights: close, not equal
    # DST exists: refused without --overwrite, and left as it was
    assert convert_hf.main([str(tmp_path / "hf"), str(tmp_path / "ms"), "--quiet"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert ModelConfig.load(str(tmp_path / "ms" / "config.json")).eos_id == [2, 5]


def test_tokenizer_files_are_copied_and_special_ids_read(tmp_path):
    hf = make_hf("llama", bos_token_id=None, eos_token_id=None)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    (src / "generation_config.json").unlink()  # no ids there or in config.json: tokenizer_config.json names them
    files = {
        # a tokenizer.json the tokenizers library reads: a conversion checks that its output loads
        "tokenizer.json": json.dumps({"version": "1.0", "added_tokens": [
            {"id": 3, "content": "<|end|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}], "model": {"type": "BPE", "vocab": {"<s>": 0, "a": 1, "b": 2}, "merges": []}}),
        "tokenizer_config.json": json.dumps({"bos_token": "<s>", "eos_token": {"content": "<|end|>"},
                                             "added_tokens_decoder": {"3": {"content": "<|end|>"}}}),
        "special_tokens_map.json": json.dumps({"eos_token": "<|end|>"}),
        "tokenizer.model": "not really sentencepiece",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    cfg = convert(src, tmp_path / "ms", progress=False)
    for name, text in files.items():
        assert (tmp_path / "ms" / name).read_text() == text
    assert (cfg.bos_id, cfg.eos_id) == (0, 3)


def test_chat_template_jinja_survives_convert_and_export(tmp_path):
    """transformers keeps the chat template in chat_template.jinja: it must reach the minispec checkpoint, load
    as the tokenizer's template, and come back out of export_hf."""
    from minispec.tokenizer import load_tokenizer

    hf = make_hf("llama")
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    (src / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": [],
                                                    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1,
                                                                                             "</s>": 2, "a": 3},
                                                              "unk_token": "<unk>"}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (src / "chat_template.jinja").write_text(template)
    convert(src, tmp_path / "ms", progress=False)
    assert (tmp_path / "ms" / "chat_template.jinja").read_text() == template
    tok = load_tokenizer(tmp_path / "ms")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=False) == "<user>a"
    export(tmp_path / "ms", tmp_path / "back", progress=False)
    assert (tmp_path / "back" / "chat_template.jinja").read_text() == template


# ---- export ----

EXPORT_CASES = {
    # name: ModelConfig overrides; qkv_bias exports as Qwen2ForCausalLM
    "llama_gqa_llama3_untied": dict(n_kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3, tie_embeddings=False,
                                    eos_id=[2, 5]),
    "llama_mqa_tied_head_dim32": dict(n_kv_heads=1, head_dim=32, tie_embeddings=True),
    "qwen2_qkv_bias": dict(n_kv_heads=2, qkv_bias=True, tie_embeddings=False, rope_theta=1000000.0),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_round_trip(tmp_path, case):
    base = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=128, norm_eps=1e-6,
                bos_id=1, eos_id=2)
    cfg = ModelConfig(**{**base, **EXPORT_CASES[case]})
    torch.manual_seed(0)
    model = Transformer(cfg)
    scramble_(model, seed=sorted(EXPORT_CASES).index(case))
    model.save_pretrained(tmp_path / "ms")
    hf_cfg = export(tmp_path / "ms", tmp_path / "hf", progress=False)
    assert hf_cfg["architectures"] == ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    x = tokens(T=48)
    torch.testing.assert_close(hf_logits(hf, x), model(x), atol=TOL, rtol=0, msg=lambda m: f"{case}: {m}")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_id, cfg.eos_id)
    # and back: the converter reads the export as the same model, tensor for tensor
    back = convert(tmp_path / "hf", tmp_path / "back", progress=False)
    assert back == cfg
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ms", "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- bad input: a clear error and nothing left behind ----

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "llama"
    make_hf("llama").save_pretrained(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path: Path) -> None:
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


BAD_INPUTS = {
    # name: (how to spoil a good checkpoint, words the error must contain)
    "unsupported_architecture": (lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"], model_type="gpt2"),
                                 ["GPT2LMHeadModel", "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"]),
    "mistral_sliding_window": (lambda p: _edit_config(p, architectures=["MistralForCausalLM"], model_type="mistral",
                                                      sliding_window=32),
                               ["MistralForCausalLM", "sliding_window=32", "unsupported"]),
    "qwen2_sliding_window": (lambda p: _edit_config(p, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                    use_sliding_window=True, sliding_window=32),
                             ["Qwen2ForCausalLM", "sliding", "unsupported"]),
    "missing_tensor": (_drop_tensor, ["missing tensor", "layers.1.mlp.up_proj.weight"]),
    "wrong_shape": (lambda p: _edit_config(p, intermediate_size=128), ["has shape (64, 96)", "expects (64, 128)"]),
    "truncated_safetensors": (_truncate, ["model.safetensors", "truncated"]),
    "no_weights": (lambda p: (p / "model.safetensors").unlink(), ["no model.safetensors"]),
    "yarn_rope": (lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
                  ["'yarn'", "not supported"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_clearly_and_leaves_nothing(tmp_path, llama_dir, case):
    spoil, needles = BAD_INPUTS[case]
    src = _copy(llama_dir, tmp_path / "src")
    spoil(src)
    with pytest.raises((ConversionError, CheckpointError)) as e:
        convert(src, tmp_path / "out", progress=False)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in the error: {e.value}"
    assert leftovers(tmp_path, "out") == []


def test_mistral_saved_by_transformers_with_window_is_refused(tmp_path):
    make_hf("mistral", sliding_window=16).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"sliding_window=16 < max_position_embeddings=128\) is unsupported"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_truncated_bin_fails_clearly(tmp_path):
    save_hf(make_hf("llama"), tmp_path / "hf", "bin")
    data = (tmp_path / "hf" / "pytorch_model.bin").read_bytes()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="pytorch_model.bin cannot be read.*truncated"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_failure_while_writing_leaves_nothing(tmp_path, llama_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(convert_hf, "copy_files", fail)  # fails after the weights are written to the temp dir
    with pytest.raises(OSError, match="simulated"):
        convert(llama_dir, tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_script_reports_errors_on_stderr(tmp_path, llama_dir):
    src = _copy(llama_dir, tmp_path / "src")
    _edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    r = subprocess.run([sys.executable, str(TOOLS / "convert_hf.py"), str(src), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "error: architecture GPT2LMHeadModel is not supported" in r.stderr
    assert leftovers(tmp_path, "out") == []


def test_export_of_a_subset_head_draft(tmp_path):
    """A draft with a frequent-token head exports with its rows scattered into a full head (other ids: logit 0)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      tie_embeddings=False, head_vocab_size=6)
    m = Transformer(cfg)
    with torch.no_grad():
        m.head_ids.copy_(torch.tensor([5, 1, 33, 7, 20, 0]))
    m.save_pretrained(tmp_path / "draft")
    with pytest.warns(ExportWarning, match="6-id subset lm_head"):  # the user is told what the export changes
        export(tmp_path / "draft", tmp_path / "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.tensor([[3, 9, 27, 1]])
    ours, theirs = m(x), hf(x).logits
    ids = m.head_ids
    assert (ours[..., ids] - theirs[..., ids]).abs().max() < 1e-4
    others = [i for i in range(40) if i not in ids.tolist()]
    assert torch.isinf(ours[..., others]).all() and (theirs[..., others] == 0).all()
