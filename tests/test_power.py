"""The power figure (minispec/equivalence/power.py): the smallest bias a run would have caught.

First the pieces (head rows, the simulation's u's, the family's rejection rule, the eps search), then the
figure itself checked two ways: a bias of the stated size, simulated afresh with other seeds, is rejected in at
least 85 of 100 runs; and the same bias injected into real sampling from a tiny target, scored by the real
pipeline (target_pit, analyse), is rejected in at least 85 of 100 runs too. A run's own rows come from a tiny
random pair's exact run. Every run uses fixed seeds, so every figure here is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minispec.equivalence import KINDS, analyse, detectable_bias, run_equivalence, target_pit, uniformity
from minispec.equivalence.power import HEAD, Simulation, distorted, family_rejects, head_rows, smallest_eps
from minispec.sampling import SamplingParams, logits_to_probs

PROMPT = [1, 5, 2, 7, 3]
N, T, ALPHA = 200, 3, 0.01
PARAMS = SamplingParams(0.7, 50)  # the harness's defaults


@pytest.fixture(scope="module")
def exact_run(pair):
    """An exact speculative run of N x T on the tiny pair, with its power figure (no early looks: one batch)."""
    target, draft = pair
    r = run_equivalence(target, draft, PROMPT, samples=N, tokens=T, batch_size=N, reference=False, seed=3)
    assert r.passed and r.power is not None, r.format()
    return r


def test_head_rows_keep_the_largest_probabilities_and_their_place_in_id_order():
    probs = torch.tensor([[0.1, 0.5, 0.0, 0.4], [0.25, 0.25, 0.25, 0.25]])
    p, f_id = head_rows(probs, 2)
    np.testing.assert_allclose(p, [[0.5, 0.4], [0.25, 0.25]])
    np.testing.assert_allclose(f_id[0], [0.1, 0.6])  # token 1 starts after token 0's 0.1; token 3 after 0.1+0.5
    assert f_id.shape == (2, 2)


def test_distortions_are_distributions_that_move_mass_as_named():
    p = np.array([[0.5, 0.3, 0.2, 0.0]])
    g, s, f = (distorted(p, k) for k in KINDS)
    for r in (g, s, f):
        np.testing.assert_allclose(r.sum(1), 1.0)
        assert r[0, 3] == 0.0  # no mass outside p's support
    assert g[0, 0] == 1.0 and s[0, 0] > 0.5 > f[0, 0]  # greedy and sharpened toward the head, flattened away
    with pytest.raises(ValueError, match="kind must be one of"):
        distorted(p, "blurred")


def test_simulated_u_are_uniform_without_a_bias():
    # rows with a tail beyond the head (V = 200, head 16) and rows whose support fits: u uniform in each order
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(2.5 * torch.randn(400, 3, 200, generator=g), -1)
    probs[:200, :, 20:] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    p, f_id = head_rows(probs, 16)
    sim = Simulation(p, f_id, ("id", "prob"), runs=20, seed=0)
    for o in range(2):
        assert uniformity(sim.u_p[:, :, o].ravel()).ks_p > 0.01
    rate = sim.distort("greedy").rejects(0.0, ALPHA, 20).mean()
    assert rate <= 0.05, f"an unbiased simulated run is rejected in {rate:.0%} of runs at alpha {ALPHA}"


def test_family_rejection_rule_is_holm_on_the_verdicts_tests():
    # runs with no, a small and a large bias: the critical-value rule gives analyse's verdict run by run
    rng = np.random.default_rng(1)
    u = rng.random((12, 300, 3, 2))
    u[4:8, :, 1, 0] **= 1.15
    u[8:, :, :, 1] **= 1.6
    rejected = family_rejects(u, ALPHA, 20)
    expect = [not analyse({"id": u[i, ..., 0], "prob": u[i, ..., 1]}, ALPHA, 20).passed for i in range(len(u))]
    assert list(rejected) == expect and 0 < sum(expect) < len(u)


def test_smallest_eps_search():
    # a step function: found within the refinement's 8%, from above (conservative)
    eps, rate = smallest_eps(lambda e, r: float(e >= 0.0123), 100)
    assert 0.0123 <= eps <= 0.0123 * 1.08 and rate == 1.0
    assert smallest_eps(lambda e, r: 0.5, 100) == (None, 0.5)  # never reaches 90%
    assert smallest_eps(lambda e, r: 1.0, 100)[0] == 1e-4  # always: the grid's floor


def test_a_bias_no_run_can_see_is_reported_as_such():
    # nearly one-hot rows: moving their mass onto the top token is a TV of about 0.001, too small for N = 200
    p = np.zeros((200, 2, 8))
    p[..., 0], p[..., 1:] = 0.993, 0.001
    f_id = np.cumsum(p, -1) - p
    pw = detectable_bias(p, f_id, ALPHA, 20, ("id", "prob"), kinds=("greedy", "flattened"), runs=40)
    assert pw.undetected == ["greedy"] and pw.kinds["greedy"]["tv"] is None
    assert pw.tv == pw.kinds["flattened"]["tv"] > 0
    assert "would not reliably catch the greedy bias" in pw.phrase()


def test_the_report_states_the_power(exact_run):
    r = exact_run
    pw = r.power
    assert set(pw.kinds) == set(KINDS) and pw.tv == max(v["tv"] for v in pw.kinds.values())
    assert all(v["rate"] >= 0.9 for v in pw.kinds.values())
    assert 0 < pw.tv < 0.5 and r.verdict.startswith(f"passed; would have caught a bias of TV >= {pw.tv:.3g}")
    d = r.to_dict()
    assert d["power"]["tv"] == pw.tv and d["speed"]["power_s"] > 0 and d["verdict"] == r.verdict
    assert "would have caught a bias of TV >=" in r.format()


def test_the_stated_bias_is_rejected_in_85_of_100_fresh_simulated_runs(exact_run):
    p, f_id = exact_run.head
    base = Simulation(p, f_id, ("id", "prob"), runs=100, seed=12345)  # seeds the figure's search did not use
    for kind, v in exact_run.power.kinds.items():
        hits = int(base.distort(kind).rejects(v["eps"], exact_run.speculative.alpha, 20).sum())
        assert hits >= 85, f"{kind} at the stated eps {v['eps']:.3g}: rejected in only {hits} of 100 fresh runs"


def _biased_samples(target, kind: str, eps: float, n: int, seed: int, params: SamplingParams = PARAMS):
    """n samples of T tokens whose every token is drawn from (1 - eps) p + eps r(p): the bias, injected."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([PROMPT] * n)
    for _ in range(T):
        probs = logits_to_probs(target(x)[:, -1], params).double()  # (n, V) the target's p
        top, idx = probs.topk(min(HEAD, probs.shape[-1]), -1)
        r = torch.zeros_like(probs).scatter_(-1, idx, torch.from_numpy(distorted(top.numpy(), kind)))
        mix = torch.where(torch.rand(n, 1, generator=g, dtype=torch.float64) < eps, r, probs)
        x = torch.cat([x, torch.multinomial(mix, 1, generator=g)], 1)
    return x[:, len(PROMPT):].tolist()


@pytest.mark.slow
def test_the_stated_bias_injected_into_real_sampling_is_rejected_in_85_of_100_runs(pair, exact_run):
    # the headline kind (the one whose figure is the largest TV), at its stated eps, through target_pit and analyse
    target, _ = pair
    kind = max(exact_run.power.kinds, key=lambda k: exact_run.power.kinds[k]["tv"])
    eps = exact_run.power.kinds[kind]["eps"]
    alpha, params = exact_run.speculative.alpha, PARAMS
    hits = 0
    for run in range(100):
        samples = _biased_samples(target, kind, eps, N, seed=1000 + run)
        u, _, _ = target_pit(target, [PROMPT], samples, params, np.random.default_rng([run, 7]))
        hits += not analyse(u, alpha, 20).passed
    assert hits >= 85, f"{kind} at eps {eps:.3g} (TV {exact_run.power.tv:.3g}): rejected in only {hits} of 100 runs"
    # and without the bias the same pipeline rejects about alpha of the runs: the hits are the bias's
    clean = sum(not analyse(target_pit(target, [PROMPT], _biased_samples(target, kind, 0.0, N, seed=run), params,
                                       np.random.default_rng([run, 8]))[0], alpha, 20).passed for run in range(20))
    assert clean <= 2
