"""minispec.load_draft: every kind of draft directory the project writes, checked against its target.

A tiny target with a word-level tokenizer; drafts of each kind written to disk: a Transformer checkpoint,
the same with a subset head (tools/draft_head.py), a feature draft. Each loads into something speculate
takes (greedy speculation equals generation with it), and the command line's --draft uses the same loader.
A draft made for another target (another tokenizer, width or vocabulary) is refused in one line.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from minispec import FeatureDrafter, Transformer, load_draft
from minispec.checkpoint import CheckpointError
from minispec.errors import GenerationError
from minispec.feature_draft import build_feature_draft

from helpers import TOOLS, peaked_model, run_main, truncated, write_word_tokenizer

sys.path.insert(0, str(TOOLS))
from draft_head import make_subset_head  # noqa: E402

V = 24
WORDS = ["<unk>"] + [f"w{i}" for i in range(V - 1)]


def with_tokenizer(model: Transformer, path, words=WORDS) -> Transformer:
    """model saved at path with a word-level tokenizer over `words`, and loaded back."""
    model.save_pretrained(path)
    write_word_tokenizer(path, words)  # after: a save replaces the tokenizer files with the model's (none)
    return Transformer.from_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("drafts")
    target = with_tokenizer(peaked_model(0, V, n_layers=3), root / "target")
    with_tokenizer(truncated(target, 1), root / "model")
    make_subset_head(str(root / "model"), str(root / "subset"), n=16)
    build_feature_draft(target, torch.arange(16), ffn_dim=64).save(root / "feature", target.tokenizer.fingerprint)
    # another target: the same sizes, another tokenizer (other words, so another fingerprint)
    other = with_tokenizer(peaked_model(0, V, n_layers=3), root / "other", ["<unk>"] + [f"x{i}" for i in range(V - 1)])
    build_feature_draft(other, torch.arange(16), ffn_dim=64).save(root / "feature-other", other.tokenizer.fingerprint)
    wide = peaked_model(0, V, dim=64, n_layers=1)
    wide.tokenizer = target.tokenizer
    build_feature_draft(wide, torch.arange(16), ffn_dim=64).save(root / "feature-wide", target.tokenizer.fingerprint)
    with_tokenizer(peaked_model(1, V + 8, n_layers=1), root / "model-vocab", WORDS + [f"y{i}" for i in range(8)])
    return root, target


@pytest.mark.parametrize("kind", ["model", "subset", "feature"])
def test_each_kind_loads_and_drafts(dirs, kind):
    root, target = dirs
    draft = load_draft(root / kind, target)
    assert isinstance(draft, FeatureDrafter if kind == "feature" else Transformer)
    if kind == "subset":
        assert draft.head_ids is not None and len(draft.head_ids) == 16
    prompt = [1, 5, 2]
    res = target.speculate(draft, prompt, k=3, max_new_tokens=12, stop_tokens=[])
    assert res.tokens == target.generate(prompt, max_new_tokens=12, stop_tokens=[])
    assert res.stats.drafted > 0


@pytest.mark.parametrize("kind,match", [
    ("feature-other", "tokenizer fingerprint"),  # a feature draft trained for another target
    ("feature-wide", "width 64; this target's is 32"),
    ("model-vocab", "vocab_size"),  # a model draft over another vocabulary
])
def test_a_draft_for_another_target_is_refused_in_one_line(dirs, kind, match):
    root, target = dirs
    with pytest.raises(GenerationError, match=match) as e:
        load_draft(root / kind, target)
    assert "\n" not in str(e.value)


def test_a_damaged_feature_draft_is_refused(dirs, tmp_path):
    root, target = dirs
    d = tmp_path / "bad"
    d.mkdir()
    config = json.loads((root / "feature" / "config.json").read_text())
    config["layer"]["ffn_dim"] = 128  # the tensors say 64
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes((root / "feature" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="does not match its config.json"):
        load_draft(d, target)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_draft(tmp_path, target)


def test_the_command_line_drafts_with_a_feature_draft(dirs, capsys):
    root, _ = dirs
    args = ["generate", "--target", str(root / "target"), "--prompt", "w1 w5 w2", "--max-new-tokens", "8",
            "--device", "cpu"]
    assert run_main(args) == 0
    plain = capsys.readouterr().out
    assert run_main([*args, "--draft", str(root / "feature"), "--k", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "speculation k=2" in out.err
    assert run_main([*args, "--draft", str(root / "feature-other")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "tokenizer fingerprint" in err


def feature_copy(root, tmp_path, name="copy", weights: bytes | None = None, **config_changes):
    """The feature draft copied to tmp_path/name, its config.json's top-level fields (or "layer.FIELD") changed (a
    value of ... removes the field) and its weights replaced by `weights` when given."""
    d = tmp_path / name
    d.mkdir()
    config = json.loads((root / "feature" / "config.json").read_text())
    for key, v in config_changes.items():
        where, _, field = key.rpartition("__")
        held = config["layer"] if where == "layer" else config
        if v is ...:
            held.pop(field, None)
        else:
            held[field] = v
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes((root / "feature" / "model.safetensors").read_bytes()
                                          if weights is None else weights)
    return d


@pytest.mark.parametrize("weights, match", [
    (b"", "header too small"),  # an empty file
    (None, "incomplete metadata"),  # truncated: its first half
])
def test_an_empty_or_truncated_feature_draft_is_one_line(dirs, tmp_path, capsys, weights, match):
    root, target = dirs
    whole = (root / "feature" / "model.safetensors").read_bytes()
    d = feature_copy(root, tmp_path, weights=whole[:len(whole) // 2] if weights is None else weights)
    with pytest.raises(CheckpointError, match=f"model.safetensors cannot be read .*{match}") as e:
        load_draft(d, target)
    assert "\n" not in str(e.value)
    args = ["--target", str(root / "target"), "--draft", str(d)]
    assert run_main(["generate", *args, "--prompt", "w1 w5", "--max-new-tokens", "4", "--device", "cpu"]) == 1
    assert run_main(["equivalence", *args, "--prompt", "w1 w5", "--samples", "64", "--tokens", "2",
                     "--power-runs", "0", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") and match in line for line in err), err


@pytest.mark.parametrize("changes, match", [
    ({"layer": 5}, '"layer" must be an object'),
    ({"layer": ...}, '"layer" must be an object .*got nothing'),
    ({"target_dim": "32"}, "target_dim must be an integer, got '32'"),
    ({"layer__vocab_size": 24.0}, "layer.vocab_size must be an integer, got 24.0"),
    ({"layer__vocab_size": ...}, "has no layer.vocab_size"),
    ({"target_dim": ...}, "has no target_dim"),
    ({"layer__n_layers": 3}, "layer.n_layers is 3; a feature draft is one decoder layer"),
    ({"layer__n_layers": ...}, "has no layer.n_layers"),
    ({"tokenizer_fingerprint": ...}, "has no tokenizer_fingerprint"),
])
def test_feature_draft_config_fields_are_typed_and_present(dirs, tmp_path, capsys, changes, match):
    root, target = dirs
    d = feature_copy(root, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match) as e:
        load_draft(d, target)
    assert "\n" not in str(e.value)
    assert run_main(["generate", "--target", str(root / "target"), "--draft", str(d), "--prompt", "w1",
                     "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_duplicate_head_ids_are_refused(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    root, target = dirs
    tensors = load_file(str(root / "feature" / "model.safetensors"))
    tensors["head_ids"][1] = tensors["head_ids"][0]  # two rows scoring one token
    save_file(tensors, str(tmp_path / "w.safetensors"))
    d = feature_copy(root, tmp_path, weights=(tmp_path / "w.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="head_ids must be distinct token ids"):
        load_draft(d, target)


@pytest.mark.parametrize("path", [None, 5, ["a"]])
def test_a_draft_path_that_is_no_path_is_refused(dirs, path):
    with pytest.raises(CheckpointError, match="a draft is a directory path"):
        load_draft(path, dirs[1])


def test_oversized_feature_draft_weights_are_refused_before_allocating(dirs, tmp_path):
    import struct

    root, target = dirs
    # a 50 GB sparse file (no disk used): refused by its size against what the config's tensors can take
    d = feature_copy(root, tmp_path, "sparse", weights=b"")
    os.truncate(d / "model.safetensors", 50 << 30)
    with pytest.raises(CheckpointError, match=r"is 53687091200 bytes, more than the \d+ its config.json's tensors"):
        load_draft(d, target)
    # a header declaring a 20 GB fc.weight over a small file: refused by safetensors' check of the file's size
    raw = (root / "feature" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    start = header["fc.weight"]["data_offsets"][0]
    header["fc.weight"].update(shape=[100_000, 100_000], data_offsets=[start, start + 2 * 10**10])
    for name, t in header.items():  # the tensors after it move along
        if name not in ("__metadata__", "fc.weight") and t["data_offsets"][0] > start:
            t["data_offsets"] = [o + 2 * 10**10 for o in t["data_offsets"]]
    text = json.dumps(header).encode()
    d = feature_copy(root, tmp_path, "header", weights=struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        load_draft(d, target)
    # the same header over a sparse file as large as it declares: refused by the size the config implies
    os.truncate(d / "model.safetensors", 8 + len(text) + max(t["data_offsets"][1] for k, t in header.items()
                                                              if k != "__metadata__"))
    with pytest.raises(CheckpointError, match="its config.json's tensors can take"):
        load_draft(d, target)


def test_a_feature_draft_drafts_no_tree(dirs, capsys):
    from minispec import DynamicTree

    root, target = dirs
    drafter = load_draft(root / "feature", target)
    for tree in ((2, 2), DynamicTree(2, 2), "auto"):
        with pytest.raises(GenerationError, match="FeatureDrafter drafts chains only"):
            target.speculate(drafter, [1, 5, 2], tree=tree, max_new_tokens=4)
    args = ["--target", str(root / "target"), "--draft", str(root / "feature"), "--prompt", "w1 w5", "--device", "cpu"]
    assert run_main(["generate", *args, "--tree", "4x3", "--max-new-tokens", "4"]) == 1
    assert run_main(["equivalence", *args, "--tree", "2x2", "--samples", "64", "--tokens", "2",
                     "--power-runs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: tree=") and "drafts chains only" in line for line in err), err
