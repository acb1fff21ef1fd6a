"""The feature draft: drafting from the target's hidden states is exact, training it runs, resumes and repeats.

A tiny peaked target; a feature draft trained on its own greedy continuations for a few seconds
(tools/train_feature_draft.py), and an untrained one. Greedy speculation must equal greedy generation
whatever the draft; the trained draft must be accepted far more often than the untrained one (the states
it is handed are the right ones); the Monte Carlo test (test_speculative_mc.py) covers sampling.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec import Transformer, ggml, load_draft
from minispec.feature_draft import FeatureDrafter, build_feature_draft
from minispec.forms import GgmlWeight
from minispec.speculative import get_sampler

from helpers import ROOT, TOOLS, peaked_model

sys.path.insert(0, str(TOOLS))
import feature_data  # noqa: E402
import train_feature_draft as tfd  # noqa: E402
from test_speculative_mc import run as mc_run  # noqa: E402

V = 16


def tiny_data(target, run_dir, n: int = 24, max_new: int = 24) -> None:
    """The target's greedy continuations of n random prompts, with its states, as the collect stage writes them."""
    g = torch.Generator().manual_seed(5)
    v = target.config.vocab_size
    items = [(f"gen-{i}", torch.randint(0, v, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist())
             for i in range(n)]
    for i in range(0, n, 8):
        feature_data.save_shard(run_dir / "data", feature_data.generate_batch(target, items[i:i + 8], max_new))


CFG = dict(head_vocab=12, ffn_dim=64, lr=3e-3, batch=4, warmup=5)


def train(target, run_dir, steps, seed=0):
    return tfd.train(target, run_dir, tfd.TrainConfig(**CFG, seed=seed), steps=steps, progress=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    target = peaked_model(0, V, n_layers=3)
    run_dir = tmp_path_factory.mktemp("fd")
    tiny_data(target, run_dir)
    trained = train(target, run_dir, 150)
    untrained = build_feature_draft(target, trained.head_ids.clone(), ffn_dim=64, seed=1)
    return target, trained, untrained


@settings(derandomize=True, deadline=None, max_examples=40)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=8), k=st.integers(1, 5),
       block_size=st.sampled_from([1, 4, 16]), max_new=st.integers(0, 16), trained=st.booleans())
def test_greedy_equals_generate(pair, prompt, k, block_size, max_new, trained):
    target, draft = pair[0], pair[1 if trained else 2]
    want = target.generate(prompt, max_new_tokens=max_new, stop_tokens=[3])
    res = target.speculate(FeatureDrafter(draft, target), prompt, k=k, max_new_tokens=max_new, stop_tokens=[3],
                           block_size=block_size)
    assert res.tokens == want


def test_greedy_batch_equals_generate_and_the_trained_draft_is_accepted(pair):
    target, trained, untrained = pair
    prompts = [[3], [1, 2, 3, 4, 5, 6, 7], [9, 9], [1, 2, 3, 4, 5, 6, 7], [0, 15, 2]]
    want = [target.generate(p, max_new_tokens=20, stop_tokens=[]) for p in prompts]
    rates = []
    for draft in (trained, untrained):
        res = target.speculate(FeatureDrafter(draft, target), prompts, k=3, max_new_tokens=20, stop_tokens=[])
        assert res.tokens == want
        rates.append(res.stats.acceptance_rate)
    assert rates[0] > rates[1] + 0.1, rates  # 0.16 against 0.02 when written


def teacher_forced_rounds(target, draft, prompt: list[int], n: int) -> tuple[int, int]:
    """Greedy k=1 speculation replayed from one full causal pass of target and draft over the greedy sequence:
    a round at context length L drafts what the draft's entry L-2 (true states throughout) predicts."""
    x = torch.tensor([prompt + target.generate(prompt, max_new_tokens=n, stop_tokens=[])])
    with torch.no_grad():
        h = target._trunk(x, torch.arange(x.shape[1]).expand(1, -1))
        guess = draft.logits(draft.forward_states(h[:, :-1], target.embed_tokens(x[:, 1:])))[0].argmax(-1).tolist()
    L, drafted, accepted = len(prompt), 0, 0
    while L < len(prompt) + n:
        if L < 2 or L + 1 >= len(prompt) + n:  # no state to draft from yet, or no budget for a draft
            L += 1
            continue
        drafted += 1
        ok = guess[L - 2] == int(x[0, L])
        accepted += ok
        L += 2 if ok else 1
    return drafted, accepted


@pytest.mark.parametrize("prompt", [[3], [1, 2, 3, 4, 5, 6, 7], [0, 15, 2]])
def test_drafting_reads_the_states_of_the_right_positions(pair, prompt):
    # speculate's k=1 rounds accept exactly what a teacher-forced pass predicts at the same positions: the
    # prefill's and verify passes' states reach the draft at their positions, and predicted ones are rolled back
    target, draft, _ = pair
    res = target.speculate(FeatureDrafter(draft, target), prompt, k=1, max_new_tokens=20, stop_tokens=[])
    drafted, accepted = teacher_forced_rounds(target, draft, prompt, 20)
    assert (res.stats.drafted, res.stats.accepted) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_q_is_zero_outside_the_draft_vocabulary(pair):
    target, draft, _ = pair
    res = target.speculate(FeatureDrafter(draft, target), [[1, 2]] * 200, k=2, max_new_tokens=3, temperature=1.0,
                           seed=3, stop_tokens=[])
    outside = set(range(V)) - set(draft.head_ids.tolist())
    assert outside and res.stats.drafted > 0
    assert any(t in outside for row in res.tokens for t in row)  # the target still emits them, through the residual


def test_the_unrolled_pass_computes_the_second_drafting_step(pair):
    # training's unrolled pass (unroll 2) must compute what drafting does: its first T entries the causal pass,
    # its entry T + m what the cached draft predicts at position m + 1 from its own first prediction
    target, draft, _ = pair
    g = torch.Generator().manual_seed(2)
    T, D = 7, draft.target_dim
    states, embeds = torch.randn(1, T, D, generator=g), torch.randn(1, T, D, generator=g)
    with torch.no_grad():
        first = draft.forward_states(states, embeds)
        positions = torch.cat((torch.arange(T), torch.arange(1, T)))[None]
        both = draft.forward_states(torch.cat((states, first[:, :-1]), 1), torch.cat((embeds, embeds[:, 1:]), 1),
                                    positions=positions, attn_mask=tfd.unrolled_mask(T))
    torch.testing.assert_close(both[:, :T], first, atol=1e-5, rtol=1e-5)
    cache = draft.new_cache(block_size=4)
    s = cache.new_sequence()
    for m in range(T - 1):
        draft.step(cache, [s], [states[0, :m + 1]], [embeds[0, :m + 1]])
        second = draft.step(cache, [s], [first[0, m:m + 1]], [embeds[0, m + 1:m + 2]])
        torch.testing.assert_close(second[0], both[0, T + m], atol=1e-5, rtol=1e-5)
        cache.truncate(s, 0)


@pytest.mark.parametrize("unroll,decay_steps", [(1, 0), (2, 6)])
def test_training_resumes_and_repeats(tmp_path, unroll, decay_steps):
    torch.set_num_threads(1)
    target = peaked_model(0, V, n_layers=3)
    for d in ("a", "b", "c"):
        tiny_data(target, tmp_path / d, n=8, max_new=8)
    cfg = tfd.TrainConfig(**CFG, unroll=unroll, decay_steps=decay_steps)
    train = lambda run_dir, steps: tfd.train(target, run_dir, cfg, steps=steps, progress=False)  # noqa: E731
    straight = train(tmp_path / "a", 6)
    train(tmp_path / "b", 3)  # interrupted after 3 steps: its checkpoint is all that is left
    resumed = train(tmp_path / "b", 6)
    again = train(tmp_path / "c", 6)
    other = train(tmp_path / "c", 7)
    for name, w in straight.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[name]), name
        assert torch.equal(w, again.state_dict()[name]), name
    assert not torch.equal(straight.fc.weight, other.fc.weight)  # a step more changes the weights: not vacuous


def test_export_and_load(pair, tmp_path):
    target, draft, _ = pair
    draft.save(tmp_path / "d", None)
    loaded = load_draft(tmp_path / "d", target)
    assert isinstance(loaded, FeatureDrafter)
    res = target.speculate(loaded, [1, 2, 3], k=3, max_new_tokens=10, stop_tokens=[])
    assert res.tokens == target.generate([1, 2, 3], max_new_tokens=10, stop_tokens=[])


@pytest.fixture(scope="module")
def mc_models(tmp_path_factory):
    """test_speculative_mc's target (8 tokens) and a feature draft trained briefly on it, over 6 of its tokens."""
    torch.set_num_threads(1)
    target = peaked_model(0, 8)
    run_dir = tmp_path_factory.mktemp("fd-mc")
    tiny_data(target, run_dir, n=16, max_new=12)
    draft = tfd.train(target, run_dir, tfd.TrainConfig(**{**CFG, "head_vocab": 6}), steps=60, progress=False)
    return {"target": target, "draft": draft}


@pytest.mark.parametrize("k,temperature,top_k,top_p", [(2, 1.0, None, None), (3, 0.7, 4, 0.9)])
def test_a_feature_draft_is_exact(mc_models, k, temperature, top_k, top_p):
    drafter = FeatureDrafter(mc_models["draft"], mc_models["target"])
    p, stats = mc_run(mc_models, drafter, k, temperature, top_k, top_p)
    assert 0 < stats.acceptance_rate < 1
    assert p > 1e-4, f"speculate's distribution with a feature draft differs from the target's: p = {p:.3g}"


@pytest.mark.parametrize("sampler", ["always-accept", "no-residual", "greedy-draft"])
def test_broken_samplers_are_rejected_with_a_feature_draft(mc_models, sampler):
    # the controls that break the draw reach a feature draft through its own draw, as a model draft's through speculate
    broken = FeatureDrafter(mc_models["draft"], mc_models["target"], draw=get_sampler(sampler).draw)
    p_broken, _ = mc_run(mc_models, broken, 2, 1.0, sampler=sampler)
    assert p_broken < 1e-6, f"the test cannot tell sampler={sampler!r} from exact: p = {p_broken:.3g}"


@pytest.mark.slow
def test_the_real_pair_greedy_equals_generate():
    """The kept Q4_K_M 1.5B with its committed feature draft (make weights-coder): greedy speculation is generation."""
    target_dir, draft_dir = ROOT / "weights" / "qwen2.5-coder-1.5b-instruct-q4km", ROOT / "weights" / \
        "qwen2.5-coder-1.5b-q4km-draft"
    if not (target_dir / "model.safetensors").is_file():
        pytest.skip("make weights-coder writes the kept 1.5B")
    target = Transformer.from_pretrained(target_dir)
    drafter = load_draft(draft_dir, target)
    ids = target.tokenizer.encode_chat([{"role": "user", "content": "Write a Python function that reverses a list."}])
    res = target.speculate(drafter, ids, k=3, max_new_tokens=24, stop_tokens=[])
    assert res.tokens == target.generate(ids, max_new_tokens=24, stop_tokens=[])
    assert res.stats.accepted > 0


def a_run(tmp_path, best: float):
    """(target, run folder) with a training checkpoint as train() writes it, without training: `best` is the
    validation agreement it holds (-1: no validation pass measured one)."""
    from dataclasses import asdict

    target = peaked_model(0, V, n_layers=3)
    draft = build_feature_draft(target, torch.arange(12), ffn_dim=64)
    run_dir = tmp_path / "run"
    tfd.save_checkpoint(run_dir / "ckpt.pt", {
        "model": draft.state_dict(), "optimizer": {}, "step": 3, "epoch": 1, "order": None, "pos": 0,
        "best": best, "rng": torch.get_rng_state(), "train_config": asdict(tfd.TrainConfig(**CFG)),
        "model_config": {"layer": draft.config.to_dict(), "target_dim": draft.target_dim}})
    return target, run_dir


def test_export_refuses_a_folder_with_files_and_replaces_it_whole_with_overwrite(tmp_path, capsys):
    target, run_dir = a_run(tmp_path, 0.5)
    out = tmp_path / "draft"
    out.mkdir()
    (out / "notes.txt").write_text("an older draft's notes")
    argv = ["export", "--target", str(tmp_path / "absent"), "--run", str(run_dir), "--out", str(out)]
    assert tfd.main(argv) == 1  # refused before the target loads
    err = capsys.readouterr().err
    assert err == f"error: --out {out} exists and is not empty; pass --overwrite to replace it whole\n"
    with pytest.raises(ValueError, match="exists and is not empty"):
        tfd.export(target, run_dir, str(out))
    tfd.export(target, run_dir, str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "run"]  # no temporary sibling left
    assert isinstance(load_draft(out, target), FeatureDrafter)
    assert "validation top-1 agreement 0.500" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    tfd.export(target, run_dir, str(empty))  # an empty folder needs no --overwrite


def test_export_says_an_unmeasured_agreement_is_not_measured(tmp_path, capsys):
    import json

    target, run_dir = a_run(tmp_path, -1.0)
    tfd.export(target, run_dir, str(tmp_path / "draft"))
    err = capsys.readouterr().err
    assert "validation top-1 agreement not measured" in err and "-1.000" not in err, err
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["training"]["validation_top1_agreement"] is None


@pytest.mark.parametrize("option, value", [
    ("--steps", "-1"), ("--steps", "0"), ("--batch", "0"), ("--warmup", "0"), ("--head-vocab", "0"),
    ("--threads", "0"), ("--max-new-tokens", "0"), ("--n-prompts", "0"), ("--collect-batch", "0"), ("--lr", "0"),
    ("--train-minutes", "-1"), ("--collect-minutes", "nan"), ("--unroll", "0"), ("--gen", "-1"), ("--dim", "0"),
])
def test_counts_that_must_be_positive_are_argparse_errors(capsys, option, value):
    with pytest.raises(SystemExit) as e:
        tfd.main(["train", "--target", "absent", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f": error: argument {option}: " in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_the_default_prompts_are_the_repositorys():
    from pathlib import Path

    assert Path(tfd.PROMPTS) == ROOT / "data" / "distill" / "prompts.jsonl" and Path(tfd.PROMPTS).is_file()


needs_products = pytest.mark.skipif(not ggml.available(), reason="no product library built (tools/build_ggml.py)")


@needs_products
def test_a_draft_in_q8_0_blocks_is_loaded_by_default_and_still_exact(pair, tmp_path):
    target, draft, _ = pair
    draft.save(tmp_path / "d", None)
    blocks, plain = load_draft(tmp_path / "d", target), load_draft(tmp_path / "d", target, dtype="float32")
    kinds = {type(m.weight).__name__ for m in blocks.model.modules() if isinstance(m, torch.nn.Linear)}
    assert "GgmlWeight" in kinds and blocks.model.blocks == "q8_0"
    assert not any(isinstance(m.weight, GgmlWeight) for m in plain.model.modules() if isinstance(m, torch.nn.Linear))
    for prompt in ([1, 2, 3], [5], [7, 7, 2, 9, 4]):
        want = target.generate(prompt, max_new_tokens=12, stop_tokens=[])
        for k in (1, 3, 5):
            assert target.speculate(blocks, prompt, k=k, max_new_tokens=12, stop_tokens=[]).tokens == want


@needs_products
def test_a_draft_in_q8_0_blocks_keeps_the_targets_distribution(mc_models):
    draft = copy.deepcopy(mc_models["draft"]).to_blocks()
    assert any(isinstance(m.weight, GgmlWeight) for m in draft.modules() if isinstance(m, torch.nn.Linear))
    p, stats = mc_run(mc_models, FeatureDrafter(draft, mc_models["target"]), 3, 0.7, 4, 0.9)
    assert 0 < stats.acceptance_rate < 1
    assert p > 1e-4, f"speculate's distribution with a Q8_0 feature draft differs from the target's: p = {p:.3g}"
