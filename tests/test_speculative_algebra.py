"""The pure functions of speculative sampling, and speculate's argument checks.

The core identity: a draft token x arrives with probability q(x) * min(1, p(x)/q(x)) = min(p, q)(x),
a rejection happens with probability sum max(0, p - q), and the residual
norm(max(0, p - q)) then supplies max(0, p - q); min(p, q) + max(0, p - q) = p.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec import Transformer
from minispec.sampling import SamplingParams, sample, sample_rows
from minispec.speculative import (
    SAMPLERS,
    AdaptiveK,
    PromptLookupDrafter,
    SpeculativeStats,
    acceptance,
    auto_k,
    best_k,
    expected_tokens,
    residual,
    verify,
)
from minispec.tree import chain

from helpers import tiny_model

# ---- hypothesis strategies: probability vectors with zeros, tiny entries, one-hots, equal and disjoint pairs ----

entry = st.one_of(st.just(0.0), st.floats(1e-30, 1e-6), st.floats(1e-3, 1.0))


def normalised(xs: list[float]) -> torch.Tensor:
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.sum()


@st.composite
def distribution_pairs(draw):
    V = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["independent", "equal", "disjoint", "one-hot p", "one-hot q", "one-hot both"]))

    def dist(allowed: list[int]) -> torch.Tensor:
        xs = [draw(entry) if i in allowed else 0.0 for i in range(V)]
        xs[draw(st.sampled_from(allowed))] += draw(st.floats(1e-3, 1.0))  # at least one positive entry
        return normalised(xs)

    def one_hot() -> torch.Tensor:
        return torch.zeros(V, dtype=torch.float64).index_fill_(0, torch.tensor(draw(st.integers(0, V - 1))), 1.0)

    if kind == "equal":
        p = dist(list(range(V)))
        return p, p.clone()
    if kind == "disjoint" and V >= 2:
        cut = draw(st.integers(1, V - 1))
        return dist(list(range(cut))), dist(list(range(cut, V)))
    p = one_hot() if kind in ("one-hot p", "one-hot both") else dist(list(range(V)))
    q = one_hot() if kind in ("one-hot q", "one-hot both") else dist(list(range(V)))
    return p, q


@settings(derandomize=True, deadline=None, max_examples=400)
@given(distribution_pairs())
def test_acceptance_plus_residual_is_p(pq):
    p, q = pq
    accept, reject, res = acceptance(p, q)
    emitted = q * accept + reject * res
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-9)
    assert ((accept >= 0) & (accept <= 1)).all()
    assert abs(float(reject) - (1 - float((q * accept).sum()))) < 1e-9  # reject is P(rejection)
    assert (res >= 0).all() and abs(float(res.sum()) - 1) < 1e-9  # the residual is a distribution
    if reject > 0:  # (with no rejection mass the residual is p itself, weighted by 0)
        assert (res[p <= q] == 0).all()  # it never proposes a token the draft already over-covers


def test_residual_edge_cases():
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(residual(p, p), p)  # no mass: p itself (a rejection cannot happen)
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(residual(p, torch.tensor([0.0, 0.0, 1.0])), torch.tensor([0.4, 0.6, 0.0], **f64))
    torch.testing.assert_close(residual(p, torch.tensor([0.0, 1.0, 0.0])), torch.tensor([2 / 7, 0.0, 5 / 7], **f64))
    accept, reject, _ = acceptance(p, torch.tensor([0.0, 0.5, 0.5]))
    assert accept.tolist() == [1.0, 0.6, 1.0] and float(reject) == pytest.approx(0.2)  # q = 0: accept 1 by convention


@settings(derandomize=True, deadline=None, max_examples=25)
@given(distribution_pairs(), st.data())
def test_verify_integrated_over_its_uniforms_emits_p(pq, data):
    # run the real `verify` (k = 1) on a midpoint grid of both uniforms, weighted by q(d): the
    # first emitted token is distributed as p, up to the grid's resolution
    p, q = pq
    V, G = p.shape[0], 200
    grid = ((torch.arange(G, dtype=torch.float64) + 0.5) / G).tolist()
    p_rows = torch.stack([p, normalised(data.draw(st.lists(st.floats(0.01, 1.0), min_size=V, max_size=V)))])
    emitted = torch.zeros(V, dtype=torch.float64)
    for d in torch.nonzero(q).flatten().tolist():
        rejected = [u0 for u0 in grid if verify([d], q[None], p_rows, torch.tensor([u0, 0.5]))[0] == 0]
        emitted[d] += q[d] * (G - len(rejected)) / G
        if rejected:  # the token after a rejection, over the second uniform's grid
            for u1 in grid:
                n, t = verify([d], q[None], p_rows, torch.tensor([rejected[0], u1]))
                emitted[t] += q[d] * len(rejected) / G / G
    assert torch.allclose(emitted, p, atol=4 / G), (emitted, p)


def test_verify_rules():
    V = 4
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    p = torch.tensor([[0.4, 0.1, 0.1, 0.4], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    # d_1 = 1: accept iff u < p/q = 0.5; d_2 = 2: p/q = 4, always accepted; then the bonus from p_3
    assert verify([1, 2], q, p, torch.tensor([0.49, 0.99, 0.3])) == (2, 3)
    # rejected at d_1: the residual max(0, p_1 - q_1) = (0.3, 0, 0, 0) is all on token 0
    assert verify([1, 2], q, p, torch.tensor([0.5, 0.0, 0.3])) == (0, 0)
    assert verify([1, 2], q, p, torch.tensor([0.5, 0.0, 0.99])) == (0, 0)
    assert verify([], q[:0], p[2:], torch.tensor([0.7])) == (0, 3)  # k = 0: a plain target step
    # greedy: one-hot p and q accept iff equal, and the residual is the target's argmax
    oh = torch.eye(V, dtype=torch.float64)
    assert verify([2, 1], oh[[2, 1]], oh[[2, 3, 0]], torch.tensor([0.9, 0.9, 0.9])) == (1, 3)
    assert verify([2, 3], oh[[2, 3]], oh[[2, 3, 0]], torch.tensor([0.9, 0.9, 0.9])) == (2, 0)
    # the broken variants do what their names say
    assert SAMPLERS["always-accept"].verify([1, 0], q, p, torch.tensor([0.99, 0.99, 0.0])) == (2, 3)
    # d = 2 (p/q = 1/3) rejected; resampling from p_1 (cdf 0.4, 0.5, 0.6, 1) at 0.55 returns the rejected token
    assert SAMPLERS["no-residual"].verify([2], q[:1], p[:2], torch.tensor([0.99, 0.55])) == (0, 2)
    assert verify([2], q[:1], p[:2], torch.tensor([0.99, 0.55])) == (0, 0)  # the residual never does


def test_verify_rejects_bad_inputs():
    q = torch.tensor([[0.0, 1.0]])
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="q = 0"):
        verify([0], q, p, torch.tensor([0.1, 0.1]))
    with pytest.raises(ValueError, match=r"p \(2, V\)"):
        verify([1], q, p[:1], torch.tensor([0.1, 0.1]))


def test_sample_rows_is_the_inverse_cdf():
    """The token drawn for uniform u is the first whose cumulative probability exceeds u."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    for _ in range(200):
        u = torch.rand(3, generator=gen, dtype=torch.float64)
        expected = [int((row.cumsum(0) > x).nonzero()[0]) for row, x in zip(probs, u)]
        assert sample_rows(probs, u) == expected
    # never a zero-probability token, even at the top of [0, 1)
    top = torch.tensor([1 - 2**-53] * 3, dtype=torch.float64)
    assert sample_rows(probs, top) == [3, 2, 1]
    # sampling.sample draws its uniform from the generator, and nothing else
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert sample(probs[0], g1) == sample_rows(probs[:1], torch.rand(1, generator=g2, dtype=torch.float64))[0]


def test_prompt_lookup():
    lk = PromptLookupDrafter(ngram=3, min_ngram=1)
    assert lk.lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # the most recent earlier match
    assert lk.lookup([5, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # longest n that matches: (2, 3)
    assert lk.lookup([4, 1, 2, 3], 2) == []  # no earlier occurrence of any tail
    assert lk.lookup([7, 7], 5) == [7]  # the continuation stops at the end of the context
    assert lk.lookup([7], 5) == []
    assert PromptLookupDrafter(ngram=3, min_ngram=2).lookup([5, 3, 6, 3], 2) == []  # 1-gram matches are off
    lk.start({}, None, 16, 10)
    tokens, qs = lk.propose([0, 1], [2, 0], {0: [1, 2, 1], 1: [1, 1]}, None)
    assert tokens == [[2, 1], []]
    assert qs[0].tolist() == torch.eye(10, dtype=torch.float64)[[2, 1]].tolist() and qs[1].shape == (0, 10)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(ngram=1, min_ngram=2)


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # brute force: tokens per unit cost over k = 0..8
    for a in (0.0, 0.3, 0.6, 0.8, 0.95, 1.0):
        for c in (0.0, 0.05, 0.2, 0.6, 1.5):
            rate = [expected_tokens(a, k) / (1 + k * c) for k in range(9)]
            assert rate[best_k(a, c)] == pytest.approx(max(rate))
    assert best_k(0.0, 0.1) == 0  # a draft that is never accepted: plain decoding
    assert best_k(0.9, 1.0) == 0  # a draft as slow as the target never pays
    assert best_k(1.0, 0.0) == 8 and best_k(0.8, 0.05) > best_k(0.5, 0.05) > 0


def test_best_k_with_verify_costs_that_grow_with_k():
    a, c = 0.8, 0.05
    flat = best_k(a, c)
    growing = [1.0 + 0.25 * k for k in range(9)]  # a CPU: checking k drafts costs 1 + k/4 plain steps
    k = best_k(a, c, verify=growing)
    rate = [expected_tokens(a, j) / (growing[j] + j * c) for j in range(9)]
    assert rate[k] == pytest.approx(max(rate)) and 0 < k < flat
    assert best_k(a, c, verify=[1.0] * 9) == flat


def test_adaptive_k_measures_verify_cost_per_k():
    ak = AdaptiveK(k_max=8)
    for _ in range(20):
        ak.update([2], [2], draft_s=0.002, draft_steps=2, verify_s=0.010)
        ak.update([6], [5], draft_s=0.006, draft_steps=6, verify_s=0.030)
    assert ak.verify_cost(2) == pytest.approx(0.010) and ak.verify_cost(6) == pytest.approx(0.030)
    assert ak.verify_cost(4) == pytest.approx(0.020)  # interpolated
    assert ak.verify_cost(0) == pytest.approx(0.010)  # below: the smallest measured
    assert ak.verify_cost(8) == pytest.approx(0.040)  # above: the last slope (0.005 per draft) continued
    verify = [ak.verify_cost(j) / ak.verify_cost(0) for j in range(9)]
    assert ak.choose() == best_k(ak.acceptance, 0.001 / 0.010, 8, verify)


def test_adaptive_k_extrapolates_verify_cost_never_downhill():
    ak = AdaptiveK(k_max=8)
    ak.update([2], [1], draft_s=0.002, draft_steps=2, verify_s=0.010)
    assert ak.verify_cost(7) == pytest.approx(0.010)  # one k measured: flat
    ak.update([3], [1], draft_s=0.003, draft_steps=3, verify_s=0.008)  # noise: k=3 measured cheaper than k=2
    assert ak.verify_cost(7) == pytest.approx(0.008)  # a negative slope is not continued
    for _ in range(40):
        ak.update([3], [1], draft_s=0.003, draft_steps=3, verify_s=0.014)
    assert ak.verify_cost(5) == pytest.approx(ak.verify_cost(3) + 2 * (ak.verify_cost(3) - ak.verify_cost(2)))
    verify = [ak.verify_cost(j) / ak.verify_cost(0) for j in range(9)]
    assert ak.choose() == best_k(ak.acceptance, 0.001 / 0.010, 8, verify)


def test_adaptive_k_follows_its_estimates():
    ak = AdaptiveK(k_max=8, probe_every=4)
    assert ak.choose() == ak.k_start == 2  # nothing measured yet
    for _ in range(30):  # a good cheap draft: 4 of 4 accepted most rounds
        ak.update([4, 4], [4, 3], draft_s=0.04, draft_steps=4, verify_s=0.1)
    assert ak.acceptance == pytest.approx(7 / 8) and ak.choose() == best_k(7 / 8, 0.1) >= 4
    for _ in range(200):  # the text changes: nothing is accepted any more
        ak.update([1], [0], draft_s=0.01, draft_steps=1, verify_s=0.1)
    # plain decoding, with a probe round after 4, then 8, then 16 plain rounds (the gap doubles up to probe_max)
    assert [ak.choose() for _ in range(31)] == [0] * 3 + [1] + [0] * 7 + [1] + [0] * 15 + [1] + [0] * 3
    for _ in range(30):  # the draft is good again: speculation, and probes at the first gap once plain again
        ak.update([4], [4], draft_s=0.04, draft_steps=4, verify_s=0.1)
    assert ak.choose() >= 4
    for _ in range(200):
        ak.update([1], [0], draft_s=0.01, draft_steps=1, verify_s=0.1)
    assert [ak.choose() for _ in range(4)] == [0, 0, 0, 1]
    capped = AdaptiveK(probe_every=2, probe_max=4, cost_ratio=1.0)
    capped.update([1], [0], draft_s=0.01, draft_steps=1, verify_s=0.1)
    assert [capped.choose() for _ in range(15)] == [0, 1] + [0, 0, 0, 1] * 3 + [0]


def test_plain_rounds_leave_the_acceptance_estimate_alone():
    # while plain decoding is chosen only the probe rounds draft: decaying on every round would leave the
    # estimate a handful of probes deep (on SmolLM2 at one thread it then swung between k = 0 and 2)
    ak = AdaptiveK(k_max=8)
    for _ in range(30):
        ak.update([1], [1], draft_s=0.01, draft_steps=1, verify_s=0.1)
        ak.update([1], [0], draft_s=0.01, draft_steps=1, verify_s=0.1)
    weight, a = ak.successes + ak.failures, ak.acceptance
    for _ in range(100):
        ak.update([0], [0], draft_s=0.0, draft_steps=0, verify_s=0.08)
    assert ak.successes + ak.failures == weight and ak.acceptance == a
    assert ak.verify_cost(0) == pytest.approx(0.08)  # its cost is still measured


def test_auto_k_is_carried_across_calls():
    """k="auto" keeps one estimator per (target, draft, sampling settings, batch size) from call to call."""
    target, draft = tiny(vocab_size=32), tiny(vocab_size=32)
    greedy, warm = SamplingParams(0.0), SamplingParams(0.7)
    ak = auto_k(target, draft, greedy, 1)
    assert auto_k(target, draft, greedy, 1) is ak and auto_k(target, draft, SamplingParams(0.0), 1) is ak
    assert auto_k(target, draft, warm, 1) is not ak and auto_k(target, draft, greedy, 4) is not ak
    assert auto_k(target, "prompt-lookup", greedy, 1) is not ak
    assert auto_k(tiny(vocab_size=32), draft, greedy, 1) is not ak
    target.speculate(draft, [1, 2, 3], k="auto", max_new_tokens=12)
    seen = ak.successes + ak.failures
    assert seen > 0  # the call updated the shared estimator ...
    target.speculate(draft, [3, 2, 1], k="auto", max_new_tokens=12)
    assert auto_k(target, draft, greedy, 1) is ak and ak.successes + ak.failures != seen  # ... and the next one too
    del draft
    gc.collect()  # a new draft never inherits a dead one's estimates, even at the same address
    assert all(auto_k(target, tiny(vocab_size=32), greedy, 1).successes == 0 for _ in range(3))


def test_stats():
    stats = SpeculativeStats()
    stats.record_row(chain(3), 1)
    stats.record_row(chain(2), 2, 5)
    assert (stats.drafted, stats.accepted, stats.sequence_rounds) == (5, 3, 2)
    assert stats.position_drafted == [2, 2, 1] and stats.position_accepted == [2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.6) and stats.mean_accepted == pytest.approx(2.5)
    assert stats.position_acceptance == [1.0, 0.5, 0.0]
    assert SpeculativeStats().acceptance_rate == 0.0 and SpeculativeStats().mean_accepted == 0.0
    tree = SpeculativeStats()
    tree.record_row([-1, -1, 0, 1, 2], 2, 3)  # five nodes, three deep; a path of two accepted
    assert (tree.drafted, tree.accepted, tree.committed, tree.sequence_rounds) == (5, 2, 3, 1)
    assert tree.position_drafted == [1, 1, 1] and tree.position_accepted == [1, 1, 0]


# ---- argument checks: clear errors ----

def tiny(vocab_size=16) -> Transformer:
    """helpers.tiny_model at its smallest: one layer of two heads over 16 dimensions."""
    return tiny_model(vocab_size=vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


class FakeTokenizer:
    def __init__(self, fingerprint):
        self.fingerprint = fingerprint


def test_errors():
    target, draft = tiny(), tiny()
    with pytest.raises(ValueError, match="vocab_size=12 differs from target vocab_size=16"):
        target.speculate(tiny(vocab_size=12), [1, 2])
    for kk in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="k .* must be an integer >= 1"):
            target.speculate(draft, [1, 2], k=kk)
    res = target.speculate(draft, [1, 2], k="auto", max_new_tokens=20, stop_tokens=[])  # adaptive k is exact too
    assert res.tokens == target.generate([1, 2], max_new_tokens=20, stop_tokens=[])
    assert len(res.stats.k_chosen) == res.stats.rounds and res.stats.k_chosen[0] == AdaptiveK().k_start
    with pytest.raises(ValueError, match="temperature"):
        target.speculate(draft, [1, 2], temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        target.speculate(draft, [1, 2], top_k=0)
    for tp in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            target.speculate(draft, [1, 2], top_p=tp)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.speculate(draft, [1, 2], max_new_tokens=-1)
    with pytest.raises(ValueError, match=f"sampler must be one of {', '.join(SAMPLERS)};"):
        target.speculate(draft, [1, 2], sampler="greedy")
    assert list(SAMPLERS)[0] == "exact"
    with pytest.raises(ValueError, match="unknown drafter 'ngram'"):
        target.speculate("ngram", [1, 2])
    with pytest.raises(ValueError, match="draft must be a Transformer"):
        target.speculate(42, [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target.speculate(draft, [1, 99])


def test_tokenizer_mismatch():
    target, draft = tiny(), tiny()
    target.tokenizer = FakeTokenizer("abc")
    with pytest.raises(ValueError, match="only the target has a tokenizer"):
        target.speculate(draft, [1, 2], max_new_tokens=2)
    draft.tokenizer = FakeTokenizer("xyz")
    with pytest.raises(ValueError, match="tokenizers differ"):
        target.speculate(draft, [1, 2], max_new_tokens=2)
    draft.tokenizer = FakeTokenizer("abc")  # another object, the same fingerprint: fine
    assert len(target.speculate(draft, [1, 2], max_new_tokens=2, stop_tokens=[]).tokens) == 2
    target.tokenizer = None
    with pytest.raises(ValueError, match="only the draft has a tokenizer"):
        target.speculate(draft, [1, 2], max_new_tokens=2)


def test_the_first_round_of_a_call_counts_its_outcome_but_not_its_times():
    """A call's first round also prefills the target and the draft: timing it as a round of k drafts would
    make that k look several times dearer than it is (Qwen2.5-Coder-1.5B: a 47-token prefill is ~6 steps)."""
    class Recorder(AdaptiveK):
        def __init__(self):
            super().__init__()
            self.calls = []

        def update(self, drafted, accepted, draft_s, draft_steps, verify_s):
            self.calls.append((draft_steps, verify_s))
            super().update(drafted, accepted, draft_s, draft_steps, verify_s)
    target, draft = tiny(vocab_size=32), tiny(vocab_size=32)
    ak = Recorder()
    for _ in range(2):
        before = len(ak.calls)
        target.speculate(draft, [1, 2, 3], k=ak, max_new_tokens=12, stop_tokens=[])
        first, *rest = ak.calls[before:]
        assert first == (0, None) and rest and all(v is not None for _, v in rest)  # later rounds: timed
    assert ak.draft_step_s is not None and ak.verify_s and ak.successes + ak.failures > 0
