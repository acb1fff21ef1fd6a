"""Monte Carlo on the real code path: speculate's joint distribution of new tokens equals target-only sampling.

A tiny random target and drafts of other configs; the exact target
distribution over whole continuations is enumerated from full forward passes
(`model(tokens)`, no cache) through `logits_to_probs`; many samples come from
ONE batched `speculate` call (copies of the prompt share its prefill by fork).
A Pearson chi-square test (cells with expected count < 5 pooled) must pass
(p > 1e-4) for the exact sampler, and must reject (p < 1e-6) each deliberately
broken sampler at the same sample size: the test has power.
Every run uses fixed seeds, so every p-value is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from minispec import SamplingParams, Transformer, ggml
from minispec.controls import BrokenDraw
from minispec.sampling import logits_to_probs
from minispec.speculative import AdaptiveK, PromptLookupDrafter

from helpers import kept_blocks, kept_int4, peaked_model
from helpers import truncated as shared_truncated

V = 8  # vocabulary: V**3 = 512 possible continuations of 3 tokens
N = 3000  # samples per run: enough power for the negative controls
PROMPT = [1, 5, 2, 7, 3]


def truncated(target: Transformer, n_layers: int = 1, logit_scale: float = 1.0) -> Transformer:
    """helpers.truncated's draft (the target's first n_layers), its head logits scaled by logit_scale."""
    m = shared_truncated(target, n_layers)
    with torch.no_grad():
        m.lm_head.weight.mul_(logit_scale)
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    target = peaked_model(0, V)  # mean entropy ~1.2 nats (uniform: ln 8 = 2.08), argmax depends on the context
    return {
        # the target's matrices in int4 groups, computed by the int4 kernel as a kept GGUF's are (the head,
        # of 8 rows, is a shape the kernel does not take: multiplied row by row in fp32)
        "int4-target": kept_int4(target, tmp_path_factory.mktemp("int4") / "target"),
        # the target's matrices as a GGUF's Q8_0 blocks, multiplied by ggml's kernels (activations rounded to Q8_0)
        "ggml-target": kept_blocks(target, tmp_path_factory.mktemp("ggml") / "target") if ggml.available() else None,
        "target": target,  # draft == target: every draft is accepted
        "truncated": truncated(target),  # acceptance ~0.5-0.7
        "truncated-peaked": truncated(target, logit_scale=4.0),  # near-deterministic draft
        "small": peaked_model(1, V, dim=16, n_layers=1),  # an unrelated smaller config: acceptance ~0.2
        "near-uniform": peaked_model(2, V, dim=16, n_layers=1, logit_scale=0.05),
    }


def exact_distribution(target, prompt, n_new, params, stops=()) -> dict[tuple, float]:
    """P(continuation) under target-only sampling, by enumerating the tree of continuations (zero branches cut)."""
    done, frontier = {}, {(): 1.0}
    for depth in range(n_new):
        seqs = list(frontier)
        logits = target(torch.tensor([prompt + list(s) for s in seqs]))[:, -1]  # (S, V)
        probs = logits_to_probs(logits, params).double()
        nxt = {}
        for s, row in zip(seqs, probs):
            for t in torch.nonzero(row).flatten().tolist():
                c, pr = s + (t,), frontier[s] * float(row[t])
                (done if t in stops or depth == n_new - 1 else nxt)[c] = pr
        frontier = nxt
    return done


def chi_square_p(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Pearson chi-square p-value of the samples against `exact`; a sample outside the support gives 0."""
    counts: dict[tuple, int] = {}
    for s in samples:
        if s not in exact:
            return 0.0
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    cells = sorted(exact, key=exact.get)
    obs, exp = [], []
    pool_o, pool_e = 0, 0.0
    for c in cells:  # ascending expected count: the small ones pool together until the pool reaches 5
        e = n * exact[c]
        if e < 5:
            pool_o, pool_e = pool_o + counts.get(c, 0), pool_e + e
            if pool_e >= 5:
                obs.append(pool_o), exp.append(pool_e)
                pool_o, pool_e = 0, 0.0
        else:
            obs.append(counts.get(c, 0)), exp.append(e)
    if pool_e > 0:  # a leftover pool joins the smallest full cell
        obs[0] += pool_o
        exp[0] += pool_e
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def run(models, draft, k, temperature, top_k=None, top_p=None, sampler="exact", prompt=PROMPT, n_new=3,
        stops=(), n=N, seed=1234, target="target"):
    """p-value of one batched speculate run against the enumerated target distribution; also the stats."""
    target = models[target]
    drafter = models[draft] if draft in models else draft
    if k == "adaptive":  # fixed costs, so the k's chosen (and the test) are deterministic; k per round
        k = AdaptiveK(k_max=3, cost_ratio=0.1, k_start=1)
    res = target.speculate(drafter, [prompt] * n, k=k, max_new_tokens=n_new, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, stop_tokens=list(stops), sampler=sampler)
    exact = exact_distribution(target, prompt, n_new, SamplingParams(temperature, top_k, top_p), set(stops))
    return chi_square_p([tuple(t) for t in res.tokens], exact), res.stats


# k larger than the budget allows is capped: with 3 new tokens a round drafts at most 2
EXACT_FAST = [  # (draft, k, temperature, top_k, top_p)
    ("truncated", 2, 1.0, None, None),
    ("truncated-peaked", 3, 0.5, 3, None),
    ("near-uniform", 1, 1.5, None, 0.9),
    ("target", 5, 1.0, None, None),
    ("truncated", "adaptive", 1.0, None, None),  # k chosen per round from the acceptance so far
]
EXACT_SLOW = [
    ("small", 2, 1.5, 4, 0.8),
    ("near-uniform", 3, 1.0, None, None),
    ("truncated", 5, 0.5, None, 0.9),
    ("truncated-peaked", 1, 1.5, None, None),
    ("small", 3, 1.0, 3, None),
    ("truncated", 3, 1.5, 2, 0.7),
]


@pytest.mark.parametrize("draft,k,temperature,top_k,top_p", EXACT_FAST)
def test_exact_matches_target_distribution(models, draft, k, temperature, top_k, top_p):
    p, stats = run(models, draft, k, temperature, top_k, top_p)
    assert stats.drafted > 0
    assert p > 1e-4, f"speculate's distribution differs from the target's: chi-square p = {p:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("draft,k,temperature,top_k,top_p", EXACT_SLOW)
def test_exact_matches_target_distribution_more(models, draft, k, temperature, top_k, top_p):
    p, stats = run(models, draft, k, temperature, top_k, top_p)
    assert stats.drafted > 0
    assert p > 1e-4, f"speculate's distribution differs from the target's: chi-square p = {p:.3g}"


NEGATIVE = [  # (sampler, draft, k, temperature, top_k): settings where the bug has a real effect
    ("no-residual", "near-uniform", 2, 1.0, None),
    ("always-accept", "truncated", 2, 1.0, None),
    ("unprocessed-q", "small", 3, 0.5, 2),
    # the draft's argmax with its softmax as q (transformers 4.41-4.44): at temperature 1 the truncated draft is far
    # from one-hot, so its argmax is accepted far more often than p gives it
    ("greedy-draft", "truncated", 2, 1.0, None),
    # the historical bug classes (minispec.controls names each one's engine and issue)
    ("target-at-t1", "truncated", 2, 0.7, 3),  # vLLM #9834: the target's p at temperature 1, unfiltered
    ("residual-drafted-only", "small", 3, 0.5, 2),  # xLLM PR #2175: max(0, p - q) at the drafted token only
    ("argmax", "truncated", 2, 1.0, None),  # mistral.rs PR #2424: the target's "sample" is its argmax
    ("one-hot-q", "truncated", 2, 1.0, None),  # vLLM PR #41044: a sampled draft verified as a greedy one
]


@pytest.mark.parametrize("sampler,draft,k,temperature,top_k", NEGATIVE)
def test_broken_samplers_are_rejected(models, sampler, draft, k, temperature, top_k):
    p_exact, _ = run(models, draft, k, temperature, top_k)
    p_broken, _ = run(models, draft, k, temperature, top_k, sampler=sampler)
    assert p_exact > 1e-4, f"the exact sampler fails these settings: p = {p_exact:.3g}"
    assert p_broken < 1e-6, f"the test cannot tell sampler={sampler!r} from exact: p = {p_broken:.3g}"


class OneHotOwnToken(BrokenDraw):
    """A sampled draft reporting q one-hot on the token it drew: looks like a bug, and is exact (accept with p(x),
    else resample from p without x, gives p for any proposal), so it is no negative control."""
    name = "one-hot-own-token"

    def draw(self, logits, probs, u):
        tokens, _ = super().draw(logits, probs, u)
        return tokens, torch.zeros_like(probs).scatter_(-1, torch.tensor(tokens).unsqueeze(-1), 1.0)


@pytest.mark.parametrize("draft,k,temperature,top_k", [("truncated", 2, 1.0, None), ("small", 3, 0.5, 2)])
def test_a_sampled_draft_with_one_hot_q_on_its_own_token_is_exact(models, draft, k, temperature, top_k):
    p, stats = run(models, draft, k, temperature, top_k, sampler=OneHotOwnToken())
    assert stats.drafted > 0 and 0 < stats.acceptance_rate < 1
    assert p > 1e-4, f"q one-hot on the drafted token should be exact: p = {p:.3g}"


# an int4 target (a GGUF's kept quantization), drafted by its own float original and by an unrelated model
INT4 = [("target", 2, 1.0, None, None), ("small", 3, 0.7, 4, 0.9)]


KEPT_TARGETS = ["int4-target", "ggml-target"]


def kept_target(models, target: str) -> str:
    if models[target] is None:
        pytest.skip("the quantized product is not built (python tools/build_ggml.py)")
    return target


@pytest.mark.parametrize("target", KEPT_TARGETS)
@pytest.mark.parametrize("draft,k,temperature,top_k,top_p", INT4)
def test_an_int4_target_is_exact(models, draft, k, temperature, top_k, top_p, target):
    p, stats = run(models, draft, k, temperature, top_k, top_p, target=kept_target(models, target))
    assert stats.drafted > 0 and 0 < stats.acceptance_rate < 1
    assert p > 1e-4, f"speculate's distribution differs from the int4 target's: chi-square p = {p:.3g}"


@pytest.mark.parametrize("target", KEPT_TARGETS)
@pytest.mark.parametrize("sampler,draft,k,temperature,top_k", [NEGATIVE[1], NEGATIVE[3]])
def test_broken_samplers_are_rejected_with_an_int4_target(models, sampler, draft, k, temperature, top_k, target):
    target = kept_target(models, target)
    p_exact, _ = run(models, draft, k, temperature, top_k, target=target)
    p_broken, _ = run(models, draft, k, temperature, top_k, sampler=sampler, target=target)
    assert p_exact > 1e-4, f"the exact sampler fails these settings: p = {p_exact:.3g}"
    assert p_broken < 1e-6, f"the test cannot tell sampler={sampler!r} from exact: p = {p_broken:.3g}"


def test_stop_token_inside_accepted_run(models):
    # stop on token 2 (likely under this target): continuations end early, cut inside accepted runs
    p, stats = run(models, "truncated", 3, 1.0, stops=(2,), n_new=4)
    assert stats.committed < 4 * N  # some sequences did stop early
    assert p > 1e-4, f"p = {p:.3g}"


@pytest.mark.slow
def test_ragged_batch_gives_each_sequence_its_own_distribution(models):
    target = models["target"]
    prompts = [[4], [1, 5, 2, 7, 3], [6, 6, 0]]
    batch = [prompts[i % 3] for i in range(3 * 1500)]
    res = target.speculate(models["truncated"], batch, k=3, max_new_tokens=3, temperature=1.0, seed=99, stop_tokens=[])
    for j, prompt in enumerate(prompts):
        exact = exact_distribution(target, prompt, 3, SamplingParams(1.0))
        p = chi_square_p([tuple(t) for i, t in enumerate(res.tokens) if i % 3 == j], exact)
        assert p > 1e-4, f"prompt {prompt} within the batch: p = {p:.3g}"


def lookup_prompt(target) -> list[int]:
    """The target's greedy path from token 1: it repeats itself, so the lookup proposes plausible tokens."""
    return [1] + target.generate([1], max_new_tokens=9, stop_tokens=[])


def test_prompt_lookup_is_exact(models):
    p, stats = run(models, "prompt-lookup", 3, 1.0, prompt=lookup_prompt(models["target"]))
    assert stats.drafted > N and 0.2 < stats.acceptance_rate < 0.9  # it drafts, and is both right and wrong
    assert p > 1e-4, f"p = {p:.3g}"


@pytest.mark.slow
def test_prompt_lookup_is_exact_with_top_k(models):
    p, stats = run(models, PromptLookupDrafter(ngram=2), 4, 0.5, top_k=3, prompt=lookup_prompt(models["target"]))
    assert stats.drafted > N and 0.2 < stats.acceptance_rate < 0.9
    assert p > 1e-4, f"p = {p:.3g}"
