"""The two-sample audit's statistics (no model): stats.homogeneity and power.two_sample_power.

Two runs from one distribution pass at the stated rate (at most alpha); two runs of different samplers (minispec's
exact speculative sampler and its always-accept control, on the tiny pair) are rejected; the stated power holds
when the stated bias is injected. Every run uses fixed seeds, so every p-value here is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest

from minispec.equivalence.power import two_sample_power
from minispec.equivalence.stats import homogeneity, token_columns

from helpers import tiny_pair

V, T = 40, 4
BROKEN = ("no-residual", "always-accept", "unprocessed-q", "greedy-draft", "target-at-t1", "residual-drafted-only",
          "argmax", "one-hot-q")


def rows(seed: int) -> np.ndarray:
    """T token distributions over V tokens, lumpy (a few likely tokens, a long tail of rare ones)."""
    return np.random.default_rng([seed, 0]).dirichlet(np.full(V, 0.3), size=T)


def draw(p: np.ndarray, n: int, rng) -> np.ndarray:
    return np.stack([rng.choice(V, n, p=p[i]) for i in range(len(p))], 1)


def test_rare_tokens_share_a_column():
    # 100 samples per run, so a (prompt, token) needs >= 10 of 200 to be its own column
    tokens = np.array([0] * 120 + [1] * 50 + [2] * 12 + [3] * 9 + [4] * 9)
    col, k = token_columns(tokens, np.zeros(200, np.int64), 100)
    assert k == 4 and col[0] == 0 and col[120] == 1 and col[170] == 2
    assert set(col[182:]) == {3}  # tokens 3 and 4 (9 each) pooled: 18 >= 10, a column of their own
    col, k = token_columns(np.array([0] * 191 + [1] * 5 + [2] * 4), np.zeros(200, np.int64), 100)
    assert k == 1 and set(col) == {0}  # the short pool joins the smallest kept column: nothing left to compare
    # the same token after another prompt is another column
    col, k = token_columns(np.zeros(200, np.int64), np.repeat([0, 1], 100), 100)
    assert k == 2 and col[0] != col[-1]


def test_one_distribution_passes_at_the_stated_rate():
    p = rows(0)
    rng = np.random.default_rng(1)
    alpha = 0.2  # a large alpha, so the false-alarm rate shows in 100 runs
    fails = sum(not homogeneity(draw(p, 300, rng), draw(p, 300, rng), alpha=alpha, permutations=200, seed=s).passed
                for s in range(100))
    assert fails <= 28, f"{fails} of 100 false alarms at alpha {alpha}"  # Binomial(100, 0.2): P(> 28) < 0.03


def test_a_shifted_distribution_is_rejected():
    p = rows(0)
    q = p.copy()
    q[2] = 0.85 * p[2] + 0.15 * np.eye(V)[p[2].argmax()]  # position 3 only: 15% of its mass on its top token
    rng = np.random.default_rng(2)
    r = homogeneity(draw(q, 1000, rng), draw(p, 1000, rng))
    assert not r.passed and r.row_names[int(np.argmin(r.adjusted))] == "3", r.to_dict()
    assert r.adjusted[2] < 1e-4 and min(r.adjusted[:2] + r.adjusted[3:-1]) > 0.01


def test_several_prompts_are_compared_prompt_by_prompt():
    # the same token mixture over both prompts, but run A has prompt 0's tokens after prompt 1 and vice versa:
    # alike when pooled, different prompt by prompt
    p0, p1 = rows(3), rows(4)
    rng = np.random.default_rng(5)
    a = np.concatenate([draw(p1, 400, rng), draw(p0, 400, rng)])
    b = np.concatenate([draw(p0, 400, rng), draw(p1, 400, rng)])
    g = np.repeat([0, 1], 400)
    assert homogeneity(a, b).passed  # prompts ignored
    assert not homogeneity(a, b, g, g).passed


@pytest.fixture(scope="module")
def speculative_runs():
    """600 samples x 4 tokens after one prompt from minispec's exact sampler, its always-accept control and plain
    sampling, on the tiny pair at temperature 0.7, top-k 8."""
    target, draft = tiny_pair()
    kw = dict(max_new_tokens=4, temperature=0.7, top_k=8, stop_tokens=[])
    prompt = [[1, 5, 2, 7, 3]] * 600
    runs = {s: np.array(target.speculate(draft, prompt, k=3, seed=0, sampler=s, **kw).tokens)
            for s in ("exact", *BROKEN)}
    runs["plain"] = np.array(target.generate(prompt, seed=10_000, **kw))
    return runs


def test_exact_speculation_and_plain_sampling_pass(speculative_runs):
    r = homogeneity(speculative_runs["exact"], speculative_runs["plain"], labels=("speculative", "plain"))
    assert r.passed and r.min_adjusted > 0.05, r.to_dict()
    assert r.to_dict()["runs"] == ["speculative", "plain"] and len(r.to_dict()["rows"]) == 5


@pytest.mark.parametrize("control", BROKEN)
def test_a_broken_sampler_against_plain_sampling_fails(speculative_runs, control):
    # the negative controls: another sampler's output. p_holm here: no-residual 2e-12, always-accept 7e-110,
    # unprocessed-q 7e-4, greedy-draft 1e-31, target-at-t1 6e-22, residual-drafted-only 7e-7, argmax 2e-66,
    # one-hot-q 1e-8 (exact: 0.36)
    r = homogeneity(speculative_runs[control], speculative_runs["plain"])
    assert not r.passed and r.min_adjusted < 1e-3, r.to_dict()


def test_the_stated_power_holds():
    # the greedy bias at the eps the simulation states is rejected in at least 85 of 100 (stated: 90)
    p = rows(6)
    rng = np.random.default_rng(7)
    power = two_sample_power(draw(p, 500, rng), draw(p, 500, rng), alpha=0.01, kinds=("greedy",), runs=100)
    eps = power.kinds["greedy"]["eps"]
    assert 0 < eps < 1 and power.tv == power.kinds["greedy"]["tv"] > 0
    q = (1 - eps) * p + eps * np.eye(V)[p.argmax(1)]
    caught = sum(not homogeneity(draw(q, 500, rng), draw(p, 500, rng), permutations=200, seed=s).passed
                 for s in range(100))
    assert caught >= 85, f"caught {caught} of 100 at the stated eps {eps:.3g}"


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="same T"):
        homogeneity(np.zeros((5, 3)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="one prompt index per sample"):
        homogeneity(np.zeros((5, 3)), np.zeros((5, 3)), groups_a=[0, 1])
