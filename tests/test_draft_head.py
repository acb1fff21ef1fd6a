"""tools/draft_head.py: a draft with a subset head proposes only its kept tokens and speculation stays exact."""

from __future__ import annotations

import json

import pytest
import torch

from minispec import Transformer

import draft_head
from helpers import peaked_model


@pytest.fixture
def saved(tmp_path):
    model = peaked_model(0, 48)
    model.config.eos_id = 40
    model.save_pretrained(tmp_path / "full")
    return model, tmp_path


def test_subset_head_keeps_the_rows_it_names(saved):
    model, tmp = saved
    draft_head.make_subset_head(str(tmp / "full"), str(tmp / "sub"), n=12)
    sub = Transformer.from_pretrained(tmp / "sub")
    ids = sub.head_ids.tolist()
    assert sub.config.head_vocab_size == len(ids) == 12 and 40 in ids and ids == sorted(ids)
    assert ids[:11] == list(range(11))  # without counts: the lowest ids, then the stop id
    x = torch.tensor([[1, 5, 9, 3]])
    full, part = model(x), sub(x)
    torch.testing.assert_close(part[..., ids], full[..., ids])
    outside = [i for i in range(48) if i not in ids]
    assert torch.isinf(part[..., outside]).all()


def test_counts_rank_the_tokens(saved, tmp_path):
    _, tmp = saved
    counts = [30] * 5 + [31] * 3 + [2]
    (tmp / "counts.json").write_text(json.dumps(counts))
    args = [str(tmp / "full"), str(tmp / "sub"), "--tokens", "3", "--counts", str(tmp / "counts.json")]
    assert draft_head.main(args) == 0
    assert Transformer.from_pretrained(tmp / "sub").head_ids.tolist() == [30, 31, 40]


def test_speculation_with_a_subset_draft_stays_exact(saved):
    """Greedy: the target's tokens, including those the draft can never propose; sampled: tokens outside the
    subset still come out (through the residual)."""
    model, tmp = saved
    draft_head.make_subset_head(str(tmp / "full"), str(tmp / "sub"), n=16)
    sub = Transformer.from_pretrained(tmp / "sub")
    prompts = [[1, 2, 3], [7, 8]]
    greedy = model.speculate(sub, prompts, k=3, max_new_tokens=20, stop_tokens=[])
    assert greedy.tokens == model.generate(prompts, max_new_tokens=20, stop_tokens=[])
    sampled = model.speculate(sub, [[1, 2, 3]] * 16, k=3, max_new_tokens=8, temperature=1.0, seed=0, stop_tokens=[])
    kept = set(sub.head_ids.tolist())
    assert any(t not in kept for row in sampled.tokens for t in row)
    assert sampled.stats.accepted > 0


def test_bad_requests_are_one_line_errors(saved, capsys):
    _, tmp = saved
    assert draft_head.main([str(tmp / "full"), str(tmp / "x"), "--tokens", "48"]) == 1
    assert "--tokens must be in [1, 47]" in capsys.readouterr().err
    draft_head.make_subset_head(str(tmp / "full"), str(tmp / "sub"), n=8)
    assert draft_head.main([str(tmp / "sub"), str(tmp / "y")]) == 1
    assert "already has a subset head" in capsys.readouterr().err
    assert not (tmp / "x").exists() and not (tmp / "y").exists()


def test_a_float16_draft_is_stored_and_loaded_as_float16_and_speculation_stays_exact(saved):
    """The draft's precision is free: greedy speculation with an fp16 draft gives the fp32 target's tokens."""
    model, tmp = saved
    assert draft_head.main([str(tmp / "full"), str(tmp / "sub16"), "--tokens", "16", "--dtype", "float16"]) == 0
    sub = Transformer.from_pretrained(tmp / "sub16")  # no dtype given: as stored
    assert sub.dtype == torch.float16 and sub.head_ids.dtype == torch.long
    prompts = [[1, 2, 3], [7, 8]]
    spec = model.speculate(sub, prompts, k=3, max_new_tokens=20, stop_tokens=[])
    assert spec.tokens == model.generate(prompts, max_new_tokens=20, stop_tokens=[])
    assert spec.stats.accepted > 0
