"""Power, stated: the smallest bias a run would have caught, by simulation on the run's own target distributions.

A verdict "passed" means little without the size of error it could have seen.
`power` answers it for the run at hand: same N samples, same T positions, same
settings, and the very distributions p the target pass computed for the run's
samples. Each sampled row (sample, position) keeps its `head` most likely
tokens (`head_rows`, in `target_pit`), with their probabilities and where each
sits in token-id order; that is what the simulation draws from.

The bias family is modelled on the bug classes speculative samplers have shipped.
Every position's distribution is mixed toward a distorted one,

    p_eps = (1 - eps) p + eps r,    TV(p, p_eps) = eps TV(p, r),

with r one of
- "greedy": all mass on the top token (a draft proposing its argmax while the
  acceptance divides by its softmax, transformers 4.41-4.44; an always-accepted
  near-greedy draft);
- "sharpened": p^2 renormalised over the head (mass moved toward the tokens a
  draft likes: a residual replaced by p, an acceptance ratio over an unprocessed
  q that is flatter than the q sampled from);
- "flattened": sqrt(p) renormalised over the head (mass moved toward the tail:
  a temperature or filter applied to one side only).

For a given r and eps, `RUNS` seeded simulated runs draw one token per row from
p_eps, transform it with the run's PIT (u = F(x-) + U p(x) in each token order
of the run) and apply the run's tests (KS and chi-square per position and pooled,
Holm over the whole family at the run's alpha, `stats.uniformity_batch`, the code
the verdict uses). Bisection on eps (in log scale, with the same random numbers
at every eps, so the rejection rate moves smoothly) finds the smallest eps
rejected in at least POWER of the runs; the figure is its mean TV per position
over the run's rows. The headline is the largest over the family: the run
would have caught any bias of the family at least that large.

Approximations, both small: a row's tail beyond its `head` tokens is one block
(a token drawn from p's tail gets u uniform over the tail's part of [0, 1] in
each order: exact for each order alone), and the rows are the run's own (a
biased sampler's prefixes would differ). tests/test_power.py checks the figure
by injecting the bias into real sampling through the real pipeline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .stats import MIN_EXPECTED, TESTS, chi2_bins, chi2_statistic, chi2_table, ks_statistic, token_columns

HEAD = 64  # tokens kept per row (top_k <= HEAD keeps every row whole)
KINDS = ("greedy", "sharpened", "flattened")
POWER = 0.9  # the rejection probability the stated bias reaches
RUNS = 100  # simulated runs per eps
# the bracket's steps; a bias below the last is reported as the last
GRID = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 3e-4, 1e-4)
REFINE_STEPS = 4  # bisections in log(eps) within a bracket step of 3.3x: about 8% resolution


def head_rows(probs: torch.Tensor, head: int = HEAD) -> tuple[np.ndarray, np.ndarray]:
    """Distributions (..., V) -> their `head` largest probabilities (..., M) in descending order and the mass
    before each of those tokens in token-id order, F_id(x-) (..., M); float64."""
    m = min(head, probs.shape[-1])
    vals, idx = probs.topk(m, dim=-1)  # descending
    f_id = probs.cumsum(-1, dtype=torch.float64).gather(-1, idx) - vals.double()
    return vals.double().cpu().numpy(), f_id.cpu().numpy()


def distorted(p: np.ndarray, kind: str) -> np.ndarray:
    """r for each row of head probabilities p (rows, M), descending: the distribution the bias mixes toward."""
    if kind == "greedy":
        r = np.zeros_like(p)
        r[:, 0] = 1.0
        return r
    if kind == "sharpened":
        r = p ** 2
    elif kind == "flattened":
        r = np.sqrt(p)
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    return r / r.sum(1, keepdims=True)


class Simulation:
    """Seeded simulated runs on fixed rows: the u's each row gets when its token is drawn from p and (after
    `distort`) when it is drawn from r, and which rows take r at a given eps (common random numbers: a row takes
    r iff its uniform w < eps, so raising eps only moves more rows to r)."""

    def __init__(self, p: np.ndarray, f_id: np.ndarray, orders, runs: int = RUNS, seed: int = 0):
        n, T, M = p.shape
        self.shape, self.orders = (n, T), tuple(orders)
        p, f_id = p.reshape(-1, M), f_id.reshape(-1, M)
        self.p, self.f_id = p, f_id
        self.tau = np.clip(1.0 - p.sum(1), 0.0, 1.0)  # the tail's mass
        self.f_prob = np.cumsum(p, 1) - p  # F(x-) in descending-probability order
        self.tail = _TailMap(p, f_id)
        draw_p = _InverseCDF(np.cumsum(p, 1))
        u_p = []
        self.w, self.c_r, self.U = np.random.default_rng([seed, 0]).random((3, runs, p.shape[0]))
        for rho in range(runs):
            c = np.random.default_rng([seed, 1, rho]).random(p.shape[0])
            u_p.append(self._u(draw_p(c), self.U[rho]))  # rank M: a tail token
        # (runs, rows, orders); float32 halves the sorting's memory traffic (the critical D's are ~1e-2)
        self.u_p = np.stack(u_p).astype(np.float32)
        self.u_r, self.tv = None, None

    def distort(self, kind: str) -> Simulation:
        """Draw every run's r tokens for this kind (the same uniforms for every kind); sets tv = TV(p, r) per row."""
        r = distorted(self.p, kind)
        self.tv = 0.5 * (np.abs(self.p - r).sum(1) + self.tau)
        draw_r = _InverseCDF(np.cumsum(r, 1))
        m = self.p.shape[1]
        self.u_r = np.stack([self._u(np.minimum(draw_r(c), m - 1), U)
                             for c, U in zip(self.c_r, self.U)]).astype(np.float32)
        return self

    def _u(self, j: np.ndarray, U: np.ndarray) -> np.ndarray:
        """Each row's u in each order (rows, orders) when its token is head rank j (M: a tail token), with PIT
        uniforms U: u = F(x-) + U p(x) for a head token; uniform over the tail's part of [0, 1] for a tail token."""
        rows = np.arange(len(j))
        in_tail = np.flatnonzero(j >= self.p.shape[1])
        jj = np.minimum(j, self.p.shape[1] - 1)
        px = self.p[rows, jj]
        out = []
        for o in self.orders:
            u = (self.f_prob if o == "prob" else self.f_id)[rows, jj] + U * px
            if in_tail.size:
                t = self.tau[in_tail]
                u[in_tail] = 1.0 - t + U[in_tail] * t if o == "prob" else self.tail(U[in_tail], in_tail)
            out.append(u)
        return np.stack(out, -1)

    def rejects(self, eps: float, alpha: float, bins: int, runs: int | None = None) -> np.ndarray:
        """(runs,) bool: does each of the first `runs` simulated runs at this eps fail the run's test family?"""
        runs = runs or len(self.w)
        u = np.where((self.w[:runs] < eps)[..., None], self.u_r[:runs], self.u_p[:runs])  # (runs, rows, orders)
        return family_rejects(u.reshape(u.shape[0], *self.shape, len(self.orders)), alpha, bins)


def family_rejects(u: np.ndarray, alpha: float, bins: int) -> np.ndarray:
    """u (runs, n, T, orders) -> (runs,) bool: rejected by the verdict's family (KS and chi-square per position and
    pooled, per order) under Holm at alpha? Holm rejects something iff its smallest p is <= alpha / m, and each
    test's p is <= alpha / m iff its statistic reaches the critical value at alpha / m: the statistics are those
    of the verdict (stats.ks_statistic, stats.chi2_statistic), compared with scipy's inverse of the same p."""
    from scipy import stats

    runs, n, T, n_orders = u.shape
    level = alpha / (n_orders * len(TESTS) * (T + 1))
    out = np.zeros(runs, dtype=bool)
    for size, sets in ((n, lambda uo: np.swapaxes(uo, 1, 2)), (n * T, lambda uo: uo.reshape(runs, 1, -1))):
        b = chi2_bins(size, bins)
        d_crit, c_crit = stats.kstwo.isf(level, size), stats.chi2.isf(level, b - 1)
        for o in range(n_orders):
            x = sets(u[..., o])  # (runs, sets, size)
            out |= (ks_statistic(x) >= d_crit).any(-1) | (chi2_statistic(x, b) >= c_crit).any(-1)
    return out


class _InverseCDF:
    """Per row, the index of the first cumulative value above c (the row's length: past its end) for rows of
    non-decreasing cumulative values in [0, 1]: one searchsorted over all rows, each shifted by its row index."""

    def __init__(self, cum: np.ndarray):
        self.rows, self.m = cum.shape
        self.flat = (np.clip(cum, 0.0, 1.0) + np.arange(self.rows)[:, None]).ravel()  # increasing over every row

    def __call__(self, c: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        rows = np.arange(self.rows) if rows is None else rows
        i = np.searchsorted(self.flat, c + rows, side="right") - rows * self.m
        return np.clip(i, 0, self.m)  # c + row past the row's end lands in the next row: the row's length


class _TailMap:
    """Maps s in [0, 1) to a point of the tail's part of [0, 1] in token-id order: the gaps between the head
    tokens' intervals [F_id(x-), F_id(x-) + p(x)), walked in id order. Uniform s gives uniform u over the tail."""

    def __init__(self, p: np.ndarray, f_id: np.ndarray):
        order = np.argsort(f_id, 1)
        starts = np.take_along_axis(f_id, order, 1)
        ends = starts + np.take_along_axis(p, order, 1)
        self.gap_starts = np.concatenate([np.zeros((p.shape[0], 1)), ends], 1)  # (rows, M + 1)
        gaps = np.clip(np.concatenate([starts, np.ones((p.shape[0], 1))], 1) - self.gap_starts, 0.0, None)
        self.cum = np.cumsum(gaps, 1)
        self.total = self.cum[:, -1]
        self.search = _InverseCDF(self.cum / np.maximum(self.total, 1e-300)[:, None])

    def __call__(self, s: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """s (k,) uniforms for rows (k,) -> u (k,) in those rows' tails."""
        g = np.minimum(self.search(s, rows), self.cum.shape[1] - 1)
        v = s * self.total[rows]
        before = np.where(g > 0, self.cum[rows, np.maximum(g - 1, 0)], 0.0)  # the gaps' length before gap g
        return self.gap_starts[rows, g] + (v - before)


@dataclass
class Power:
    """What a run could have detected: per distortion kind, the smallest eps rejected with probability `power`
    and its mean TV per position (None: not reached even at eps = 1); `tv` is the largest of them."""
    tv: float | None
    kinds: dict = field(default_factory=dict)  # kind -> {"eps", "tv", "tv_at_full_strength", "rate"}
    power: float = POWER
    runs: int = RUNS
    head: int = HEAD
    seconds: float = 0.0  # the simulation's time (reported with the run's speed, as power_s)

    def add(self, kind: str, eps: float | None, rate: float, full: float) -> None:
        """One kind's result: the smallest eps reached (None: not even at 1), its rate, TV(p, r) at eps = 1."""
        self.kinds[kind] = {"eps": eps, "tv": None if eps is None else eps * full, "tv_at_full_strength": full,
                            "rate": rate}

    def finish(self, t0: float) -> Power:
        """The headline (the largest TV over the kinds) and the simulation's time since t0."""
        found = [v["tv"] for v in self.kinds.values() if v["tv"] is not None]
        self.tv = max(found) if found else None
        self.seconds = time.perf_counter() - t0
        return self

    @property
    def undetected(self) -> list[str]:
        return [k for k, v in self.kinds.items() if v["eps"] is None]

    def to_dict(self) -> dict:
        return {"tv": self.tv, "power": self.power, "runs": self.runs, "head_tokens": self.head,
                "family": "p_eps = (1 - eps) p + eps r at every position", "kinds": self.kinds}

    def phrase(self) -> str:
        """'would have caught a bias of TV >= x' (and what it would not have caught)."""
        parts = []
        if self.tv is not None:
            caught = ", ".join(k for k in self.kinds if k not in self.undetected)
            parts.append(f"would have caught a bias of TV >= {self.tv:.3g} per position (with probability "
                         f"{self.power:.0%}, bias family {caught})")
        for k in self.undetected:
            parts.append(f"would not reliably catch the {k} bias even at full strength "
                         f"(TV {self.kinds[k]['tv_at_full_strength']:.3g})")
        return "; ".join(parts)


def detectable_bias(p: np.ndarray, f_id: np.ndarray, alpha: float, bins: int, orders, kinds=KINDS,
                    runs: int = RUNS, target: float = POWER, seed: int = 0) -> Power:
    """The run's power (see the module docstring): p, f_id (n samples, T positions, M) from head_rows; alpha, bins
    and orders those of the run's verdict."""
    t0 = time.perf_counter()
    support = max(int((p > 0).sum(-1).max()), 1)  # columns past every row's support carry nothing
    p, f_id = p[..., :support], f_id[..., :support]
    out = Power(None, {}, target, runs, p.shape[-1])
    base = Simulation(p, f_id, orders, runs, seed)
    for kind in kinds:
        sim = base.distort(kind)
        eps, rate = smallest_eps(lambda e, r, sim=sim: float(sim.rejects(e, alpha, bins, r).mean()), runs, target)
        out.add(kind, eps, rate, float(sim.tv.mean()))
    return out.finish(t0)


def smallest_eps(rate, runs: int, target: float = POWER, grid=GRID, refine: int = REFINE_STEPS):
    """The smallest eps with rate(eps, runs) >= target, assuming the rate grows with eps; rate(eps, r) is the
    fraction of the first r simulated runs rejected. Returns (eps, its rate), or (None, rate(1)) when even eps = 1
    falls short.

    First a bracket, cheaply: walk down `grid` with a quarter of the runs while they still reject. Then all the
    runs: confirm the bracket's top (walking back up if the quarter was lucky) and bisect in log(eps) `refine`
    times. The eps returned is the smallest tried that reached the target with all the runs."""
    coarse = max(1, runs // 4)
    i = 0
    while i < len(grid) and rate(grid[i], coarse) >= target:
        i += 1
    # grid[i - 1] is the smallest grid eps the quarter rejected; check it (and those above) with every run
    j = max(i - 1, 0)
    while True:
        r_hi = rate(grid[j], runs)
        if r_hi >= target:
            break
        if j == 0:
            return None, r_hi
        j -= 1
    hi = grid[j]
    lo = grid[j + 1] if j + 1 < len(grid) else None
    if lo is None:  # even the grid's floor is caught: report the floor
        return hi, r_hi
    for _ in range(refine):
        mid = math.sqrt(lo * hi)
        r = rate(mid, runs)
        if r >= target:
            hi, r_hi = mid, r
        else:
            lo = mid
    return hi, r_hi


def two_sample_power(a, b, alpha: float, groups_a=None, groups_b=None, kinds=KINDS, runs: int = RUNS,
                     target: float = POWER, seed: int = 0, min_expected: float = MIN_EXPECTED) -> Power:
    """The power of stats.homogeneity on two runs a (n_a, T) and b (n_b, T) of token ids, stated as for the PIT:
    the smallest bias p_eps = (1 - eps) p + eps r of each position's token distribution (p: both runs' counts in
    the test's own columns, r: KINDS) that the per-position tests reject, under Holm over the T + 1 tests at alpha,
    in `target` of `runs` simulated pairs of runs of the same sizes (run A from p_eps, run B from p). The pooled
    test is left out of the simulation, so the figure understates the power slightly."""
    from scipy import stats as sps

    t0 = time.perf_counter()
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    x = np.concatenate([a, b])
    g = np.concatenate([np.zeros(len(a), np.int64) if groups_a is None else np.asarray(groups_a),
                        np.zeros(len(b), np.int64) if groups_b is None else np.asarray(groups_b)])
    n_a, n_b, T = len(a), len(b), a.shape[1]
    rows = []
    for i in range(T):
        c, k = token_columns(x[:, i], g, min(n_a, n_b), min_expected)
        rows.append(np.sort(np.bincount(c, minlength=k) / len(x))[::-1])
    m = max(len(r) for r in rows)
    p = np.stack([np.pad(r, (0, m - len(r))) for r in rows])  # (T, m), descending
    dfs = np.array([max(len(r) - 1, 1) for r in rows])
    level = alpha / (T + 1)
    rng = np.random.default_rng([seed, 4])
    draw_p = _InverseCDF(np.cumsum(p, 1))
    pos = np.arange(T)

    def tokens(draw, n):  # (runs, n, T) column indices drawn from each position's row
        c = rng.random((runs, n, T))
        return np.minimum(draw(c.reshape(-1, T).T.ravel(), np.repeat(pos, runs * n)).reshape(T, runs, n)
                          .transpose(1, 2, 0), m - 1)

    def counts(cols):  # (runs, n, T) -> (runs, T, m)
        flat = (np.arange(runs)[:, None, None] * T + pos) * m + cols
        return np.bincount(flat.ravel(), minlength=runs * T * m).reshape(runs, T, m).astype(np.float64)

    in_b = counts(tokens(draw_p, n_b))
    a_p, w = tokens(draw_p, n_a), rng.random((runs, n_a, T))
    out = Power(None, {}, target, runs, m)
    for kind in kinds:
        r = distorted(p, kind)
        a_r = tokens(_InverseCDF(np.cumsum(r, 1)), n_a)

        def rate(eps, k_runs, a_r=a_r):
            in_a = counts(np.where(w < eps, a_r, a_p))[:k_runs]
            stat = chi2_table(in_a, in_a + in_b[:k_runs], n_a, n_a + n_b)  # (k_runs, T)
            return float((sps.chi2.sf(stat, dfs) <= level).any(-1).mean())

        eps, hit = smallest_eps(rate, runs, target)
        out.add(kind, eps, hit, float((0.5 * np.abs(p - r).sum(1)).mean()))
    return out.finish(t0)
