"""safetensors checkpoints: bit-exact round trip, clear errors on corrupt input, atomic saves."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import minispec.checkpoint as ckpt
from minispec import CheckpointError, Transformer

from helpers import tiny_model


def saved(tmp_path, **kw):
    model = tiny_model(seed=0, **kw)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_bit_exact(tmp_path, tied):
    model, path = saved(tmp_path, tie_embeddings=tied, qkv_bias=not tied)
    loaded = Transformer.from_pretrained(path)
    assert loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x), loaded(x))
    assert ("lm_head.weight" in load_file(path / "model.safetensors")) == (not tied)


def test_dtype_chosen_at_load(tmp_path):
    model, path = saved(tmp_path)
    assert Transformer.from_pretrained(path, dtype=torch.bfloat16).dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "half", dtype=torch.float16)
    assert Transformer.from_pretrained(tmp_path / "half").dtype == torch.float16  # default: the stored dtype


def test_truncated_file(tmp_path):
    _, path = saved(tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Transformer.from_pretrained(path)


def rewrite(path, fn):
    state = load_file(path / "model.safetensors")
    fn(state)
    save_file(state, path / "model.safetensors")


def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    _, path = saved(tmp_path)
    rewrite(path, lambda s: s.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(3, 32)))
    shape = r"'layers.1.mlp.up_proj.weight' has shape \(3, 32\), the config expects \(256, 32\)"
    with pytest.raises(CheckpointError, match=shape):
        Transformer.from_pretrained(path)


def test_missing_and_extra_tensors(tmp_path):
    _, path = saved(tmp_path)
    rewrite(path, lambda s: s.pop("norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['norm.weight'\]"):
        Transformer.from_pretrained(path)
    rewrite(path, lambda s: s.update({"norm.weight": torch.ones(32), "bogus": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['bogus'\]"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("content, msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({"vocab_size": 32, "dim": 32}), "missing"),
    (json.dumps({"vocab_size": 32, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128,
                 "colour": "red"}), r"unknown ModelConfig field\(s\) \['colour'\]"),
    (json.dumps({"vocab_size": 32, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128}),
     r"missing tensor\(s\) \['layers.2"),
])
def test_bad_config_json(tmp_path, content, msg):
    _, path = saved(tmp_path)
    (path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=msg):
        Transformer.from_pretrained(path)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Transformer.from_pretrained(tmp_path / "nope")
    _, path = saved(tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Transformer.from_pretrained(path)


def test_interrupted_save_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    old, path = saved(tmp_path)
    new = tiny_model(seed=9)

    def dies_halfway(state, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # a partial file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(path)
    monkeypatch.undo()
    loaded = Transformer.from_pretrained(path)  # still the old, complete checkpoint
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in old.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind
    new.save_pretrained(path)  # and a later save replaces it
    assert torch.equal(Transformer.from_pretrained(path).norm.weight, new.norm.weight)
