"""speculate at temperature 0 returns generate's greedy tokens; caches stay clean; batching, streaming, limits.

Greedy speculation is the sampling rule with one-hot p and q, so its output
must equal target-only greedy decoding token for token, whatever the draft.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec import Transformer
from minispec.speculative import PromptLookupDrafter

from helpers import peaked_model, require_smollm2, truncated

V = 16


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = peaked_model(0, V, n_layers=3)
    return {"target": target, "truncated": truncated(target), "small": peaked_model(1, V, dim=16, n_layers=1)}


prompt_st = st.lists(st.integers(0, V - 1), min_size=1, max_size=12)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(prompt=prompt_st, k=st.integers(1, 6), block_size=st.sampled_from([1, 2, 3, 4, 16]),
       max_new=st.integers(0, 20), stops=st.lists(st.integers(0, V - 1), max_size=2),
       draft=st.sampled_from(["truncated", "small", "target", "prompt-lookup"]))
def test_greedy_equals_generate(models, prompt, k, block_size, max_new, stops, draft):
    target = models["target"]
    drafter = models.get(draft, draft)
    want = target.generate(prompt, max_new_tokens=max_new, temperature=0.0, stop_tokens=stops)
    res = target.speculate(drafter, prompt, k=k, max_new_tokens=max_new, temperature=0.0, stop_tokens=stops,
                           block_size=block_size)
    assert res.tokens == want
    assert res.stats.committed == len(want)


@pytest.fixture(scope="module")
def bf16_models(models):
    target = peaked_model(0, V, n_layers=3).to(torch.bfloat16)
    return {"target": target, "truncated": truncated(target).to(torch.bfloat16), "small": models["small"]}


@settings(derandomize=True, deadline=None, max_examples=60)
@given(prompt=prompt_st, k=st.integers(1, 6), block_size=st.sampled_from([1, 4, 16]), max_new=st.integers(1, 20),
       draft=st.sampled_from(["truncated", "small"]))
def test_greedy_equals_generate_for_a_bfloat16_target(bf16_models, prompt, k, block_size, max_new, draft):
    """bf16 rounds a row's logits by how its pass was computed unless every row is computed alike
    (test_model: a decode step computes the bits of a verify pass); then greedy speculation is generation."""
    target = bf16_models["target"]
    want = target.generate(prompt, max_new_tokens=max_new, temperature=0.0, stop_tokens=[])
    res = target.speculate(bf16_models[draft], prompt, k=k, max_new_tokens=max_new, temperature=0.0, stop_tokens=[],
                           block_size=block_size)
    assert res.tokens == want


def test_greedy_paths_are_not_trivial(models):
    # guards the test above: greedy continuations vary and the drafts are sometimes right, sometimes wrong
    target = models["target"]
    outs = [target.generate([t], max_new_tokens=12, stop_tokens=[]) for t in range(V)]
    assert len({tuple(o) for o in outs}) > V // 2
    assert max(len(set(o)) for o in outs) >= 3
    res = target.speculate(models["truncated"], [[t] for t in range(V)], k=4, max_new_tokens=12, stop_tokens=[])
    assert 0.25 < res.stats.acceptance_rate < 0.75  # 0.40 when written


def test_greedy_batch_equals_generate(models):
    target = models["target"]
    prompts = [[3], [1, 2, 3, 4, 5, 6, 7], [9, 9], [1, 2, 3, 4, 5, 6, 7], list(range(16)) * 2]
    want = [target.generate(p, max_new_tokens=15, stop_tokens=[4]) for p in prompts]
    for draft in ("truncated", "small"):
        res = target.speculate(models[draft], prompts, k=3, max_new_tokens=15, stop_tokens=[4], block_size=4)
        assert res.tokens == want


def test_stop_token_and_budget_cut_inside_an_accepted_run(models):
    target = models["target"]
    full = target.generate([5], max_new_tokens=20, stop_tokens=[])
    stop = full[6]  # a token the greedy path reaches: the run must end at its first occurrence
    cut = full[:full.index(stop) + 1]
    res = target.speculate(target, [5], k=8, max_new_tokens=20, stop_tokens=[stop])  # draft == target: all accepted
    assert res.tokens == cut
    for n in range(1, 12):
        res = target.speculate(target, [5], k=5, max_new_tokens=n, stop_tokens=[])
        assert res.tokens == full[:n]


def test_context_window_caps_k(models):
    target = peaked_model(0, V, n_layers=3, max_seq_len=20)
    prompt = [1, 2, 3, 4, 5, 6]
    want = target.generate(prompt, max_new_tokens=50, stop_tokens=[])
    assert len(want) == 20 - len(prompt)  # generation stops at max_seq_len
    draft_short = truncated(target, max_seq_len=12)  # the draft's window ends first: later rounds are plain steps
    for draft in (target, draft_short, truncated(target, max_seq_len=4)):  # 4: shorter than the prompt
        res = target.speculate(draft, prompt, k=4, max_new_tokens=50, stop_tokens=[])
        assert res.tokens == want


def test_caches_hold_exactly_the_committed_tokens(models):
    target, draft = models["target"], models["truncated"]
    prompts = [[1, 2, 3], [7] * 9, [4], [1, 2, 3]]
    res = target.speculate(draft, prompts, k=4, max_new_tokens=11, temperature=1.0, seed=3, block_size=4,
                           keep_caches=True, stop_tokens=[])
    tgt, dft = res.caches
    for rows, model in ((tgt, target), (dft, draft)):
        rows.cache.check_consistency()
        for i, p in enumerate(prompts):
            committed = p + res.tokens[i]
            s = rows.seq[i]
            L = rows.cache.length(s)
            assert committed[L:] == rows.pending[i] and len(rows.pending[i]) >= 1
            # the K/V the cache holds are those of the committed tokens: no stale draft left behind
            fresh = model.new_cache(num_blocks=8, block_size=4)
            f = fresh.new_sequence()
            model.step(fresh, [f], [committed[:L]])
            torch.testing.assert_close(rows.cache.k[:, rows.cache.slots(s)], fresh.k[:, fresh.slots(f)])
            torch.testing.assert_close(rows.cache.v[:, rows.cache.slots(s)], fresh.v[:, fresh.slots(f)])
        assert all(len(rows.pending[i]) == 1 for i in range(len(prompts))) or rows is dft
        for i in range(len(prompts)):
            rows.free(i)
        rows.cache.check_consistency()
        assert rows.cache.allocator.num_free == rows.cache.num_blocks  # every block came back


def test_on_tokens_streams_the_committed_tokens(models):
    target = models["target"]
    seen: dict[int, list[int]] = {}
    calls = []
    res = target.speculate(models["truncated"], [[1, 2], [3]], k=3, max_new_tokens=10, temperature=1.0, seed=0,
                           stop_tokens=[], on_tokens=lambda i, t: (seen.setdefault(i, []).extend(t), calls.append(i)))
    assert seen == {0: res.tokens[0], 1: res.tokens[1]}
    assert len(calls) == res.stats.sequence_rounds  # one call per sequence per round


def test_batch_row_i_matches_single_run_with_seed_plus_i(models):
    target, draft = models["target"], models["truncated"]
    prompts = [[1, 2, 3], [5], [1, 2, 3]]
    res = target.speculate(draft, prompts, k=3, max_new_tokens=12, temperature=1.0, seed=10, stop_tokens=[])
    for i, p in enumerate(prompts):
        single = target.speculate(draft, p, k=3, max_new_tokens=12, temperature=1.0, seed=10 + i, stop_tokens=[])
        assert single.tokens == res.tokens[i]
    again = target.speculate(draft, prompts, k=3, max_new_tokens=12, temperature=1.0, seed=10, stop_tokens=[])
    assert again.tokens == res.tokens  # same seed, same tokens


def test_no_new_tokens(models):
    target = models["target"]
    assert target.speculate(models["small"], [1, 2], max_new_tokens=0).tokens == []
    full = [1] * target.config.max_seq_len  # no room left in the window
    assert target.speculate(models["small"], [full, [2]], max_new_tokens=0).tokens == [[], []]
    assert target.speculate(models["small"], [full], max_new_tokens=3).tokens == [[]]


def test_stats(models):
    target = models["target"]
    res = target.speculate(models["truncated"], [1, 2, 3], k=4, max_new_tokens=30, stop_tokens=[])
    s = res.stats
    assert s.rounds == s.sequence_rounds > 0
    assert s.committed == 30 == s.accepted + s.rounds  # greedy, no stop: each round adds its accepted + 1
    assert s.mean_accepted == pytest.approx(30 / s.rounds)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert sum(s.position_accepted) == s.accepted and sum(s.position_drafted) == s.drafted
    assert len(s.position_drafted) == 4 and all(0 <= r <= 1 for r in s.position_acceptance)
    assert s.draft_time_s > 0 and s.verify_time_s > 0


def test_prompt_lookup_drafts_repeats(models):
    target = models["target"]
    prompt = target.generate([6], max_new_tokens=20, stop_tokens=[])  # a greedy path, fed back as the prompt
    want = target.generate(prompt, max_new_tokens=20, stop_tokens=[])
    res = target.speculate(PromptLookupDrafter(ngram=4, min_ngram=2), prompt, k=5, max_new_tokens=20, stop_tokens=[])
    assert res.tokens == want
    assert res.stats.drafted > 0


@pytest.mark.slow
def test_smollm2_greedy_equals_generate():
    torch.set_num_threads(1)
    target = Transformer.from_pretrained(require_smollm2())
    prompt = target.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    want = target.generate(prompt, max_new_tokens=24, temperature=0.0)
    # prompt lookup: some drafts accepted, some rejected (0.24 when written); the target itself: all accepted
    for draft in ("prompt-lookup", target):
        res = target.speculate(draft, prompt, k=4, max_new_tokens=24, temperature=0.0)
        assert res.tokens == want
        assert res.stats.accepted > 0 and res.stats.rounds < 24


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 7])
def test_greedy_verify_any_chunk_matches_full_argmax(chunk):
    """greedy_verify scores `chunk` positions per lm_head product and stops at the first rejection;
    whatever the chunk, it returns what the argmax over all positions says."""
    from minispec.speculative import greedy_verify
    model = peaked_model(3, V, n_layers=3)
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    h = torch.randn(B, T, model.config.dim, generator=g)
    top = model.logits(h).argmax(-1)  # (B, T)
    n_pending = [1, 2, 1, 1, 2]
    accept_upto = [0, 2, 5, 6, 3]  # row b's drafts agree with the target for its first accept_upto[b] positions
    drafts, want = [], []
    for b in range(B):
        k = T - n_pending[b]
        agree = top[b, n_pending[b] - 1:n_pending[b] - 1 + k].tolist()
        d = [t if j < accept_upto[b] else (t + 1) % V for j, t in enumerate(agree)][:k]
        drafts.append(d)
        n = min(accept_upto[b], k)
        want.append((n, int(top[b, n_pending[b] - 1 + n])))
    drafts[4] = drafts[4][:2]  # a shorter draft: all accepted, the bonus token comes from its next position
    want[4] = (2, int(top[4, n_pending[4] - 1 + 2]))
    n_acc, nxt = greedy_verify(model, h, n_pending, drafts, chunk=chunk)
    assert list(zip(n_acc, nxt)) == want
