"""Monte Carlo on the real code path, tree rounds: speculate(tree=...)'s joint distribution of new tokens equals
target-only sampling, over tree shapes, temperatures, top-k and top-p; the negative control "tree-independent" (each
sibling tested against p instead of the residual its earlier siblings left) is rejected at the same sample size.

The machinery (tiny random pairs, the enumerated target distribution, the chi-square test) is
tests/test_speculative_mc.py's; the thresholds too: p > 1e-4 to pass, p < 1e-6 to reject.
"""

from __future__ import annotations

import pytest
import torch
from test_speculative_mc import PROMPT, N, V, chi_square_p, exact_distribution, truncated

from minispec import DynamicTree, SamplingParams

from helpers import peaked_model


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = peaked_model(0, V)
    return {"target": target, "truncated": truncated(target), "truncated-peaked": truncated(target, logit_scale=4.0),
            "small": peaked_model(1, V, dim=16, n_layers=1),
            "near-uniform": peaked_model(2, V, dim=16, n_layers=1, logit_scale=0.05)}


def run(models, draft, tree, temperature, top_k=None, top_p=None, sampler="exact", n_new=3, stops=()):
    """p-value of one batched tree speculate run against the enumerated target distribution; also the stats."""
    target = models["target"]
    res = target.speculate(models[draft], [PROMPT] * N, tree=tree, max_new_tokens=n_new, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=1234, stop_tokens=list(stops), sampler=sampler)
    exact = exact_distribution(target, PROMPT, n_new, SamplingParams(temperature, top_k, top_p), set(stops))
    return chi_square_p([tuple(t) for t in res.tokens], exact), res.stats


EXACT_FAST = [  # (draft, tree, temperature, top_k, top_p)
    ("truncated", (2, 2), 1.0, None, None),
    ("small", (3, 1), 1.0, 4, None),
    ("truncated-peaked", (2, 1, 1), 0.5, 3, None),
    ("truncated", DynamicTree(3, 3), 1.0, None, None),  # each round's shape chosen by the draft
]
EXACT_SLOW = [
    ("near-uniform", (4,), 1.5, None, 0.9),
    ("truncated", (2, 2), 0.7, None, 0.8),
    ("target", (3, 2), 1.0, None, None),  # draft == target: the first child is always accepted
    ("small", (2, 2, 2), 1.5, None, None),
    ("truncated", (4, 1), 0.5, 2, None),  # top-k 2 leaves a node at most 2 children of the 4 asked for
    ("near-uniform", (1, 3), 1.0, 5, 0.8),
    ("small", DynamicTree(2, 3), 0.7, 4, None),
    ("near-uniform", DynamicTree(4, 2), 1.5, None, 0.9),
]


@pytest.mark.parametrize("draft,tree,temperature,top_k,top_p", EXACT_FAST)
def test_a_tree_is_exact(models, draft, tree, temperature, top_k, top_p):
    p, stats = run(models, draft, tree, temperature, top_k, top_p)
    assert stats.drafted > 0 and 0 < stats.accepted
    assert p > 1e-4, f"tree {tree}: speculate's distribution differs from the target's: chi-square p = {p:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("draft,tree,temperature,top_k,top_p", EXACT_SLOW)
def test_a_tree_is_exact_more(models, draft, tree, temperature, top_k, top_p):
    p, stats = run(models, draft, tree, temperature, top_k, top_p)
    assert stats.drafted > 0
    assert p > 1e-4, f"tree {tree}: speculate's distribution differs from the target's: chi-square p = {p:.3g}"


def test_a_stop_token_inside_an_accepted_path(models):
    p, stats = run(models, "truncated", (2, 2, 1), 1.0, stops=(2,), n_new=4)
    assert stats.committed < 4 * N
    assert p > 1e-4, f"p = {p:.3g}"


@pytest.mark.parametrize("draft,tree", [("truncated", (2, 2)), ("near-uniform", (4, 2)),
                                        ("near-uniform", DynamicTree(4, 2))])
def test_tree_independent_is_rejected(models, draft, tree):
    p_exact, _ = run(models, draft, tree, 1.0)
    p_broken, _ = run(models, draft, tree, 1.0, sampler="tree-independent")
    assert p_exact > 1e-4, f"the exact sampler fails these settings: p = {p_exact:.3g}"
    assert p_broken < 1e-6, f"the test cannot tell tree-independent from exact: p = {p_broken:.3g}"


def test_rounds_of_mixed_shapes_are_exact(models):
    """tree="auto" changes the shape from round to round (plain decoding, chains, trees): a run cycling through such
    shapes is exact too, since each round's shape is fixed before its drafts are drawn."""
    from test_tree import Cycle

    mixed = [(), (1, 1), (3, 1), (2, 2)]  # a round commits at least a token: every row sees the first three
    p, stats = run(models, "truncated", Cycle(mixed), 1.0, top_k=5, n_new=4)
    assert set(stats.tree_chosen) == set(mixed) and stats.accepted > 0
    assert p > 1e-4, f"mixed shapes: speculate's distribution differs from the target's: chi-square p = {p:.3g}"
