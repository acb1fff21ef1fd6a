"""minispec.load_draft: every kind of draft directory the project writes, checked against its target.

A tiny target with a word-level tokenizer; drafts of each kind written to disk: a Transformer checkpoint,
the same with a subset head (tools/draft_head.py), a feature draft. Each loads into something speculate
takes (greedy speculation equals generation with it), and the command line's --draft uses the same loader.
A draft made for another target (another tokenizer, width or vocabulary) is refused in one line.
"""

from __future__ import annotations

import json
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
