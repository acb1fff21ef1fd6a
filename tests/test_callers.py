"""Ordinary callers meeting the API and the command lines: iterables of stop tokens, callbacks that edit their
list, numpy ids, devices and dtypes given as strings, custom drafters that break the protocol, environment
settings, samples files and tool inputs that once escaped as tracebacks, and the reproducible k="auto-fixed"."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from minispec import Transformer
from minispec.adaptive import AdaptiveK, fixed_cost_ratio
from minispec.drafters import Drafter, one_hot
from minispec.errors import GenerationError, InputError
from minispec.threads import fixed_threads, usable_cpus

from helpers import run_main, tiny_model
from tiny_files import tiny_checkpoint, tiny_tokenizer_dir


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return tiny_model(seed=0, scale=5.0), tiny_model(seed=1, scale=5.0)


def _greedy_run(model, n=12):
    return model.generate([1, 2, 3], max_new_tokens=n, stop_tokens=[])


# ---- stop tokens, callbacks, prompts

@pytest.mark.parametrize("make", [iter, tuple, lambda s: (t for t in s), np.array, torch.tensor, set])
def test_stop_tokens_may_be_any_iterable(models, make):
    target, draft = models
    free = _greedy_run(target)
    stop = free[4]
    expected = free[:free.index(stop) + 1]
    assert target.generate([1, 2, 3], max_new_tokens=12, stop_tokens=make([stop])) == expected
    res = target.speculate(draft, [1, 2, 3], k=3, max_new_tokens=12, stop_tokens=make([stop]))
    assert res.tokens == expected


def test_one_stop_token_may_be_a_numpy_or_torch_integer(models):
    target, _ = models
    free = _greedy_run(target)
    expected = free[:free.index(free[4]) + 1]
    for stop in (np.int64(free[4]), torch.tensor(free[4])):
        assert target.generate([1, 2, 3], max_new_tokens=12, stop_tokens=stop) == expected


def test_a_callback_that_edits_its_list_does_not_change_the_output(models):
    target, draft = models
    plain = target.speculate(draft, [1, 2, 3], k=3, max_new_tokens=16, temperature=1.0, seed=5, stop_tokens=[])
    seen = []

    def clear(i, tokens):
        seen.extend(tokens)
        tokens.clear()

    edited = target.speculate(draft, [1, 2, 3], k=3, max_new_tokens=16, temperature=1.0, seed=5, stop_tokens=[],
                              on_tokens=clear)
    assert edited.tokens == plain.tokens == seen
    assert target.generate([1, 2, 3], max_new_tokens=8, stop_tokens=[], on_tokens=lambda i, t: t.clear()) == \
        _greedy_run(target, 8)


@pytest.mark.parametrize("prompts, match", [
    (None, "got NoneType"), ({"a": 1}, "got dict"), ({0: 1}, "got dict"), (5, "got int"), ({1, 2}, "got set"),
    (b"ab", "got bytes"), ("text", "encode text"), ([[1], 2], "prompt 1 is 2"), ([1, [2]], "holds \\[2\\]"),
    ([1.0, 2.0], "must be integers"), ([True], "must be integers"), ([np.float32(1)], "must be integers"),
])
def test_prompts_of_a_type_not_taken_get_a_generation_error(models, prompts, match):
    target, draft = models
    with pytest.raises(GenerationError, match=match):
        target.generate(prompts, max_new_tokens=2)
    with pytest.raises(GenerationError, match=match):
        target.speculate(draft, prompts, max_new_tokens=2)


def test_numpy_and_torch_integer_ids_are_token_ids(models):
    target, draft = models
    expected = _greedy_run(target, 6)
    for ids in ([np.int64(1), np.int32(2), np.uint8(3)], np.array([1, 2, 3]), [torch.tensor(1), 2, 3]):
        assert target.generate(ids, max_new_tokens=6, stop_tokens=[]) == expected
        assert target.speculate(draft, ids, k=2, max_new_tokens=6, stop_tokens=[]).tokens == expected
    batch = target.generate([np.array([1, 2, 3]), torch.tensor([4, 5])], max_new_tokens=6, stop_tokens=[])
    assert batch[0] == expected and batch[1] == target.generate([4, 5], max_new_tokens=6, stop_tokens=[])


# ---- devices and dtypes

def test_dtype_names_are_taken_and_other_dtypes_refused(tmp_path):
    cfg = tiny_model().config
    assert Transformer(cfg, dtype="float16").dtype == torch.float16
    tiny_checkpoint(tmp_path / "m")
    assert Transformer.from_pretrained(tmp_path / "m", dtype="bfloat16").dtype == torch.bfloat16
    for bad in ("half", "fp16", torch.int8, 16):
        with pytest.raises(InputError, match="dtype must be None, a floating torch.dtype or one of float32"):
            Transformer(cfg, dtype=bad)
        with pytest.raises(InputError, match="dtype must be"):
            Transformer.from_pretrained(tmp_path / "m", dtype=bad)


@pytest.mark.parametrize("device, match", [
    ("potato", "'potato' is not a device"), ("meta", "cannot run a model"),
    ("cuda:7" if torch.cuda.is_available() else "cuda", "cuda"), (3.5, "is not a device"),
])
def test_devices_that_cannot_be_used_are_refused(tmp_path, device, match):
    cfg = tiny_model().config
    with pytest.raises(InputError, match=match):
        Transformer(cfg, device=device)
    tiny_checkpoint(tmp_path / "m")
    with pytest.raises(InputError, match=match):
        Transformer.from_pretrained(tmp_path / "m", device=device)
    assert Transformer(cfg, device="cpu").device.type == "cpu"


# ---- custom drafters

class BrokenDrafter(Drafter):
    """Proposes the token `token` each round, with a q of width `width` (None: the vocabulary's)."""

    def __init__(self, token=1, width=None, proposal=None):
        self.token, self.width, self.proposal = token, width, proposal

    def start(self, prompts, params, block_size, vocab_size):
        self.vocab_size = vocab_size

    def propose(self, rows, ks, contexts, gens):
        if self.proposal is not None:
            return self.proposal
        tokens = [[self.token] if k > 0 else [] for k in ks]
        width = self.width or self.vocab_size
        return tokens, [torch.full((len(t), width), 1.0 / width, dtype=torch.float64) for t in tokens]


@pytest.mark.parametrize("drafter, match", [
    (BrokenDrafter(width=7), r"BrokenDrafter returned q of shape \(1, 7\) for sequence 0; it must be a \(1, 32\)"),
    (BrokenDrafter(token=32), "BrokenDrafter proposed token 32 for sequence 0, not an id in the vocabulary"),
    (BrokenDrafter(token=-1), "BrokenDrafter proposed token -1"),
    (BrokenDrafter(token=1.5), "BrokenDrafter proposed token 1.5"),
    (BrokenDrafter(proposal=[[1]]), r"BrokenDrafter.propose must return \(tokens, q\)"),
    (BrokenDrafter(proposal=([[1]], [])), r"BrokenDrafter.propose must return \(tokens, q\)"),
    (BrokenDrafter(proposal=([[1, 2, 3, 4, 5]], [one_hot([1, 2, 3, 4, 5], 32)])), "proposed 5 tokens .* the 2"),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafters_output_is_checked_and_the_error_names_it(models, drafter, match, temperature):
    target, _ = models
    with pytest.raises(GenerationError, match=match):
        target.speculate(drafter, [1, 2, 3], k=2, max_new_tokens=4, temperature=temperature, seed=0)


def test_a_drafter_may_propose_numpy_ids(models):
    target, _ = models
    drafter = BrokenDrafter(token=np.int64(3))
    res = target.speculate(drafter, [1, 2, 3], k=2, max_new_tokens=6, stop_tokens=[])
    assert res.tokens == _greedy_run(target, 6) and all(type(t) is int for t in res.tokens)


def test_k_of_a_type_not_taken_is_refused(models):
    target, draft = models
    for k in ("fast", 0, True, 2.0, None):
        with pytest.raises(GenerationError, match="k \\(draft tokens per round\\) must be"):
            target.speculate(draft, [1, 2], k=k, max_new_tokens=2)


# ---- reproducible adaptive k

def test_auto_fixed_gives_the_same_tokens_for_a_seed_whatever_the_clock(models, monkeypatch):
    """k="auto-fixed" reads no clock: a clock that makes drafting look free or ruinous changes nothing."""
    from minispec import speculative

    target, draft = models
    run = lambda: target.speculate(draft, [[1, 2, 3], [4, 5]], k="auto-fixed", max_new_tokens=24,  # noqa: E731
                                   temperature=1.0, seed=11, stop_tokens=[])
    first = run()
    assert run().tokens == first.tokens
    for clock in (_fake_time(draft_s=1e-6, verify_s=1.0), _fake_time(draft_s=1.0, verify_s=1e-3)):
        monkeypatch.setattr(speculative, "time", clock)
        again = run()
        assert again.tokens == first.tokens and again.stats.k_chosen == first.stats.k_chosen
    assert 0 < fixed_cost_ratio(target, draft) == fixed_cost_ratio(target, target) == 1.0
    assert fixed_cost_ratio(target, "prompt-lookup") == 0.0


def test_the_timed_mode_follows_the_clock(models, monkeypatch):
    """What --seed cannot fix with k="auto": the same seed and estimator, other timings, other k's."""
    from minispec import speculative

    target, draft = models
    chosen = []
    for clock in (_fake_time(draft_s=1e-6, verify_s=1.0), _fake_time(draft_s=1.0, verify_s=1e-3)):
        monkeypatch.setattr(speculative, "time", clock)
        res = target.speculate(draft, [1, 2, 3], k=AdaptiveK(), max_new_tokens=24, temperature=1.0, seed=11,
                               stop_tokens=[])
        chosen.append(res.stats.k_chosen)
    assert chosen[0] != chosen[1]
    assert max(chosen[0][2:]) >= 3 and min(chosen[1][2:]) == 0  # free drafts: long rounds; ruinous ones: plain steps


def _fake_time(draft_s: float, verify_s: float):
    """A stand-in for the time module whose perf_counter reads t0, t0 + draft_s, t0 + draft_s + verify_s, in turn
    (speculate reads it before drafting, after drafting and after verifying, each round)."""
    steps, state = [0.0, draft_s, verify_s], {"t": 0.0, "i": 0}

    def perf_counter():
        state["t"] += steps[state["i"] % 3]
        state["i"] += 1
        return state["t"]
    return types.SimpleNamespace(perf_counter=perf_counter)


# ---- command lines

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, and a second one (another seed) as its draft."""
    root = tmp_path_factory.mktemp("cli")
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_checkpoint(root / name, seed=seed, eos_id=2)
        tiny_tokenizer_dir(root / name)
    return root


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("value", ["abc", "0", "-1", "100000", "1.5", "+2", " "])
def test_minispec_threads_is_checked_and_bounded(monkeypatch, value):
    monkeypatch.setenv("MINISPEC_THREADS", value)
    if not value.strip():
        assert fixed_threads() is None
        return
    with pytest.raises(ValueError, match=f"MINISPEC_THREADS must be a positive integer no larger than {usable_cpus()}"):
        fixed_threads()


def test_minispec_threads_up_to_the_usable_cpus_is_taken(monkeypatch):
    monkeypatch.setenv("MINISPEC_THREADS", str(usable_cpus()))
    assert fixed_threads() == usable_cpus()
    monkeypatch.setenv("MINISPEC_THREADS", str(usable_cpus() + 1))
    with pytest.raises(ValueError, match="no larger than"):
        fixed_threads()


@pytest.mark.parametrize("value", ["abc", "0", "100000"])
def test_cli_refuses_a_bad_minispec_threads_with_status_2(ckpt, capsys, monkeypatch, value):
    monkeypatch.setenv("MINISPEC_THREADS", value)
    assert run_main(["generate", "--target", str(ckpt / "target"), "--prompt", "a b", "--max-new-tokens", "2"]) == 2
    assert "MINISPEC_THREADS" in _one_line_error(capsys)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_cli_refuses_an_infinite_temperature_with_status_2(ckpt, capsys, value):
    rc = run_main(["generate", "--target", str(ckpt / "target"), "--prompt", "a", f"--temperature={value}"])
    err = capsys.readouterr().err
    assert rc == 2 and "--temperature" in err and "Traceback" not in err


SETTINGS = {"temperature": 1.0, "top_k": None, "top_p": None, "new_tokens": 2, "engine": "x", "engine_version": None}


@pytest.mark.parametrize("line, match", [
    ("[" * 100000 + "]" * 100000, "line 4 nests its JSON too deeply"),
    ('{"prompt": [1, ' + "9" * 5000 + '], "tokens": [3, 4]}', "line 4 holds a number too long to read"),
])
def test_samples_file_lines_that_json_cannot_hold_are_one_line_errors(ckpt, tmp_path, capsys, line, match):
    path = tmp_path / "s.jsonl"
    good = json.dumps({"prompt": [1, 2], "tokens": [3, 4]})
    path.write_text("\n".join([json.dumps(SETTINGS), good, good, line, good]) + "\n")
    assert run_main(["equivalence", "--target", str(ckpt / "target"), "--samples-file", str(path)]) == 2
    err = _one_line_error(capsys)
    assert str(path) in err and match in err


@pytest.mark.parametrize("content", [b"[1, 2", b"\xff", b"[" * 100000, b"[" + b"9" * 5000 + b"]", b'{"a": 1}'])
def test_draft_head_counts_that_cannot_be_read_are_one_line_errors(ckpt, tmp_path, capsys, content):
    import draft_head

    (tmp_path / "counts.json").write_bytes(content)
    rc = draft_head.main([str(ckpt / "target"), str(tmp_path / "out"), "--tokens", "8", "--counts",
                          str(tmp_path / "counts.json")])
    assert rc == 1 and "--counts" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_distill_export_of_a_checkpoint_whose_dims_overflow_is_a_one_line_error(ckpt, tmp_path, capsys):
    from distill.checkpoint import CKPT_NAME, save_checkpoint
    from distill.cli import main as distill_main

    big = 2**31 - 1
    config = dict(vocab_size=big, dim=2**30, n_layers=1, n_heads=2**20, n_kv_heads=2**20, ffn_dim=big, max_seq_len=64)
    state = {"model": {f"t{i}": torch.zeros(1) for i in range(12)}, "optimizer": {}, "step": 1, "epoch": 0,
             "order": None, "pos": 0, "best": 0.0, "rng": torch.zeros(4, dtype=torch.uint8), "model_config": config,
             "train_config": {}}
    save_checkpoint(tmp_path / "run" / CKPT_NAME, state)
    rc = distill_main(["export", "--run", str(tmp_path / "run"), "--target", str(ckpt / "target"),
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and "model_config cannot be used" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_cli_auto_fixed_gives_one_text_per_seed(ckpt, capsys):
    args = ["generate", "--target", str(ckpt / "target"), "--draft", str(ckpt / "draft"), "--prompt", "a b c d",
            "--max-new-tokens", "24", "--temperature", "1.0", "--seed", "3", "--k", "auto-fixed"]
    outs = []
    for _ in range(2):
        assert run_main(args) == 0
        captured = capsys.readouterr()
        assert "speculation k=auto-fixed (mean" in captured.err
        outs.append(captured.out)
    assert outs[0] == outs[1]
    assert run_main(["generate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "auto-fixed" in help_text and "the tokens can differ run to run" in help_text
