"""The statistics of the harness, as pure functions: the randomized PIT, uniformity tests, Holm's correction.

`pit` maps each sampled token to u in [0, 1), uniform exactly when the token was
drawn from the distribution it is scored against; `uniformity` tests one set of
u's (Kolmogorov-Smirnov and a histogram chi-square); `holm` corrects a family of
p-values; `analyse` runs all of them over the positions of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TESTS = ("ks", "chi2")  # per position and pooled; Holm corrects over all of them

ORDERS = ("id", "prob")  # the token order the CDF runs over: token ids, or descending probability
# Sequential early stop of a clear failure, for the PIT harness and the two-sample audit alike: after each batch of
# samples but the last (an interim look), the samples so far are tested at EARLY_ALPHA * alpha / (number of interim
# looks); the final test runs at the alpha left, (1 - EARLY_ALPHA) * alpha. By Bonferroni over the looks a correct
# sampler still fails with probability at most alpha, a passing run loses almost nothing (alpha 0.0099 instead of
# 0.01), and a broken sampler whose first batch already fails by a wide margin stops there instead of drawing
# every sample.
EARLY_ALPHA = 0.01


def look_alphas(alpha: float, looks: int) -> tuple[float, float]:
    """(the level of each of `looks` interim looks, the final test's level) for an audit at level alpha."""
    a_look = EARLY_ALPHA * alpha / looks if looks > 0 else 0.0
    return a_look, alpha - a_look * max(looks, 0)


def pit(probs: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor, order: str = "id") -> torch.Tensor:
    """Randomized probability integral transform.

    probs: (..., V) the distribution each token was supposedly drawn from;
    tokens: (...) the drawn ids; uniforms: (...) independent U(0, 1).
    order: the token order F runs over: "id" (token ids), or "prob" (descending probability, ties
    by id). Any order fixed by the prefix alone keeps u uniform; "prob" puts the head of the
    distribution first, so an error that moves mass between head and tail accumulates in F.
    Returns u = F(x-) + U * p(x) as float64 (...): iid U(0, 1) iff each token ~ its probs.
    Each row of probs is renormalised (sums in float64).
    """
    if probs.shape[:-1] != tokens.shape or tokens.shape != uniforms.shape:
        raise ValueError(f"pit needs probs (..., V), tokens (...) and uniforms (...) with matching leading shapes; "
                         f"got probs {tuple(probs.shape)}, tokens {tuple(tokens.shape)}, "
                         f"uniforms {tuple(uniforms.shape)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")
    V = probs.shape[-1]
    tokens = tokens.long()
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
        raise ValueError(f"pit: token ids must be in [0, {V}), got range [{int(tokens.min())}, {int(tokens.max())}]")
    # sums accumulate in float64 without a float64 copy of probs: (..., V) is large for a real vocabulary
    p = probs if probs.dtype == torch.float64 else probs.float()
    total = p.sum(-1, dtype=torch.float64)  # (...): renormalise, so u stays within [0, 1]
    x = tokens.unsqueeze(-1)  # (..., 1)
    px = p.gather(-1, x)  # (..., 1): p(x)
    ids = torch.arange(V, device=p.device)
    before = ids < x if order == "id" else (p > px) | ((p == px) & (ids < x))  # (..., V): tokens ahead of x
    below = torch.where(before, p, 0).sum(-1, dtype=torch.float64)  # F(x-), unnormalised
    u = (below + uniforms.double() * px.squeeze(-1).double()) / total
    return u.clamp(0.0, 1.0)


@dataclass
class Uniformity:
    """Tests of one set of u's against Uniform(0, 1)."""
    n: int  # number of u's
    ks_stat: float  # Kolmogorov-Smirnov D: the largest gap between the empirical CDF and the diagonal
    ks_p: float
    chi2_stat: float  # Pearson chi-square over `bins` equal-width bins
    chi2_p: float
    bins: int


def chi2_bins(n: int, bins: int) -> int:
    """Bins for the histogram chi-square: at most `bins`, and at least 5 expected per bin (the usual validity rule)."""
    return max(2, min(bins, n // 5))


def ks_statistic(u: np.ndarray) -> np.ndarray:
    """Kolmogorov-Smirnov D of each set of u's over the last axis (..., n) against Uniform(0, 1): the largest gap
    between the empirical CDF and the diagonal (as scipy.stats.kstest computes it)."""
    x = np.sort(np.clip(u, 0.0, 1.0), axis=-1)
    n = x.shape[-1]
    hi = np.arange(1, n + 1, dtype=x.dtype) / x.dtype.type(n)  # the empirical CDF just after each point
    lo = np.arange(0, n, dtype=x.dtype) / x.dtype.type(n)  # and just before it
    return np.maximum((hi - x).max(-1), (x - lo).max(-1))


def chi2_statistic(u: np.ndarray, b: int) -> np.ndarray:
    """Pearson's chi-square of each set of u's over the last axis (..., n): b equal-width bins over [0, 1] (1.0 in
    the last), equal expected counts."""
    n = u.shape[-1]
    cell = np.minimum((u * b).astype(np.int64), b - 1).reshape(-1, n)
    rows = cell.shape[0]
    counts = np.bincount((cell + b * np.arange(rows)[:, None]).ravel(), minlength=b * rows).reshape(rows, b)
    e = n / b
    return (((counts - e) ** 2).sum(-1) / e).reshape(u.shape[:-1])


def uniformity_batch(u, bins: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The tests of `uniformity` over the last axis of u (..., n) at once: (ks_stat, ks_p, chi2_stat, chi2_p, bins),
    each an array of the leading shape. KS p is the exact two-sided one (scipy's kstwo, as stats.kstest);
    chi-square p from b - 1 degrees of freedom (as stats.chisquare)."""
    from scipy import stats

    u = np.asarray(u, dtype=np.float64)
    n = u.shape[-1]
    if n < 2:
        raise ValueError(f"uniformity needs at least 2 values, got {n}")
    b = chi2_bins(n, bins)
    d, c = ks_statistic(u), chi2_statistic(u, b)
    return d, stats.kstwo.sf(d, n), c, stats.chi2.sf(c, b - 1), b


def uniformity(u, bins: int = 20) -> Uniformity:
    """KS and histogram chi-square tests of u (1-D, values in [0, 1]) against Uniform(0, 1)."""
    u = np.asarray(u, dtype=np.float64).ravel()
    ks_stat, ks_p, chi2_stat, chi2_p, b = uniformity_batch(u, bins)
    return Uniformity(int(u.size), float(ks_stat), float(ks_p), float(chi2_stat), float(chi2_p), b)


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control, any dependence between the tests).

    Reject test j at level alpha iff adjusted[j] <= alpha; in the input order.
    """
    p = [float(x) for x in pvalues]
    m = len(p)
    adjusted = [0.0] * m
    running = 0.0
    for rank, j in enumerate(sorted(range(m), key=lambda j: p[j])):
        running = max(running, min(1.0, (m - rank) * p[j]))  # monotone: never below a smaller p's adjustment
        adjusted[j] = running
    return adjusted


@dataclass
class RunStats:
    """The PIT statistics of one run (speculative or target-only): per token order, per position and pooled,
    each with KS and chi-square; Holm-adjusted over all of them together."""
    label: str
    tests: dict[str, list[Uniformity]]  # order -> [position 1, ..., position T, pooled]
    adjusted: dict[str, dict[str, list[float]]]  # order -> test ("ks", "chi2") -> Holm-adjusted p per row
    alpha: float

    @property
    def row_names(self) -> list[str]:
        n = len(next(iter(self.tests.values())))
        return [str(i + 1) for i in range(n - 1)] + ["all"]

    def row_min_adjusted(self, r: int) -> float:
        return min(a[t][r] for a in self.adjusted.values() for t in TESTS)

    @property
    def min_adjusted(self) -> float:
        return min(self.row_min_adjusted(r) for r in range(len(self.row_names)))

    @property
    def min_raw(self) -> float:
        """The smallest p-value before the correction (for scale: with m tests, about 1/m is typical)."""
        return min(getattr(s, f"{t}_p") for rows in self.tests.values() for s in rows for t in TESTS)

    @property
    def passed(self) -> bool:
        return self.min_adjusted > self.alpha

    @property
    def n_tests(self) -> int:
        return sum(len(v) for a in self.adjusted.values() for v in a.values())

    def to_dict(self) -> dict:
        rows = []
        for r, where in enumerate(self.row_names):
            row = {"position": where, "n": next(iter(self.tests.values()))[r].n,
                   "min_p_holm": self.row_min_adjusted(r)}
            for order, stats_ in self.tests.items():
                s, a = stats_[r], self.adjusted[order]
                row[order] = {"ks_stat": s.ks_stat, "ks_p": s.ks_p, "ks_p_holm": a["ks"][r], "chi2_stat": s.chi2_stat,
                              "chi2_p": s.chi2_p, "chi2_p_holm": a["chi2"][r], "chi2_bins": s.bins}
            rows.append(row)
        return {"label": self.label, "passed": self.passed, "min_p_holm": self.min_adjusted, "min_p": self.min_raw,
                "n_tests": self.n_tests, "orders": list(self.tests), "rows": rows}


def analyse(u, alpha: float = 0.01, bins: int = 20, label: str = "") -> RunStats:
    """PIT values -> per-position and pooled KS and chi-square tests, Holm-adjusted over all of them.

    u: an array (n samples, T positions), or a dict token order -> such an array (the same samples
    transformed in several orders; all their tests join one Holm family).
    """
    by_order = u if isinstance(u, dict) else {"id": u}
    tests = {}
    for order, a in by_order.items():
        a = np.asarray(a, dtype=np.float64)
        if a.ndim != 2 or a.shape[0] < 2 or a.shape[1] < 1:
            raise ValueError(f"analyse needs u of shape (n >= 2 samples, T >= 1 positions), got {a.shape} "
                             f"for order {order!r}")
        tests[order] = [uniformity(a[:, i], bins) for i in range(a.shape[1])] + [uniformity(a, bins)]
    keys = [(o, t, r) for o, rows in tests.items() for t in TESTS for r in range(len(rows))]
    adj = holm([getattr(tests[o][r], f"{t}_p") for o, t, r in keys])
    adjusted = {o: {t: [0.0] * len(rows) for t in TESTS} for o, rows in tests.items()}
    for (o, t, r), a in zip(keys, adj):
        adjusted[o][t][r] = a
    return RunStats(label, tests, adjusted, alpha)



# ---------------------------------------------------------------------------
# two samples, no model: are the token counts of two runs alike?
# ---------------------------------------------------------------------------

MIN_EXPECTED = 5.0  # the chi-square's validity rule: every cell's expected count at least this
PERMUTATIONS = 2000  # label permutations for the pooled test's p-value (its smallest possible value: 1 / 2001)


def token_columns(tokens: np.ndarray, groups: np.ndarray, n_small: int, min_expected: float = MIN_EXPECTED):
    """The contingency table's columns at one position: tokens (N,) of both runs and their prompt groups (N,) ->
    (column of each sample (N,), number of columns). A (prompt, token) pair is its own column when the smaller run
    expects at least `min_expected` of it (n_small * its share of both runs); the rarer pairs share one column,
    which joins the smallest kept column when it is still short of `min_expected`. The columns depend on both runs
    together only, so relabelling samples between the runs keeps them."""
    n = len(tokens)
    keys, inverse, counts = np.unique(np.stack([groups, tokens], 1), axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    kept = counts * n_small / n >= min_expected
    order = np.argsort(-counts, kind="stable")  # kept columns by descending count: the smallest kept is last
    col = np.full(len(keys), -1)
    n_kept = int(kept.sum())
    col[order[:n_kept]] = np.arange(n_kept)
    rare = ~kept
    if rare.any():
        if counts[rare].sum() * n_small / n >= min_expected or n_kept == 0:
            col[rare] = n_kept
            n_kept += 1
        else:
            col[rare] = n_kept - 1
    return col[inverse], max(n_kept, 1)


def chi2_table(in_a: np.ndarray, total: np.ndarray, n_a: int, n: int) -> np.ndarray:
    """Pearson's chi-square of 2 x K tables from run A's counts in_a (..., K) and both runs' totals (K,): the
    homogeneity statistic, sum over cells of (observed - expected)^2 / expected."""
    e_a = total * (n_a / n)
    e_b = total - e_a
    d = in_a - e_a  # run B's deviation is -d
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, d * d / np.maximum(e_a, 1e-300) + d * d / np.maximum(e_b, 1e-300), 0.0).sum(-1)


@dataclass
class TwoSample:
    """Homogeneity of two runs' token counts, per position and pooled, Holm-adjusted over all of them."""
    n_a: int
    n_b: int
    stats: list[float]  # chi-square per position, then the pooled statistic (their sum)
    dfs: list[int]  # degrees of freedom per position (columns - 1); the pooled row: their sum
    p: list[float]  # per position from the chi-square distribution; pooled by permutation
    adjusted: list[float]
    alpha: float
    permutations: int
    labels: tuple[str, str] = ("A", "B")

    @property
    def row_names(self) -> list[str]:
        return [str(i + 1) for i in range(len(self.stats) - 1)] + ["all"]

    @property
    def min_adjusted(self) -> float:
        return min(self.adjusted)

    @property
    def passed(self) -> bool:
        return self.min_adjusted > self.alpha

    def to_dict(self) -> dict:
        rows = [{"position": w, "chi2": s, "df": d, "p": p, "p_holm": a}
                for w, s, d, p, a in zip(self.row_names, self.stats, self.dfs, self.p, self.adjusted)]
        return {"test": "chi-square homogeneity of token counts (rare tokens pooled), Holm over positions and pooled",
                "runs": list(self.labels), "samples": [self.n_a, self.n_b], "passed": self.passed,
                "min_p_holm": self.min_adjusted, "alpha": self.alpha, "pooled_permutations": self.permutations,
                "rows": rows}


def homogeneity(a, b, groups_a=None, groups_b=None, alpha: float = 0.01, permutations: int = PERMUTATIONS,
                seed: int = 0, min_expected: float = MIN_EXPECTED, labels=("A", "B")) -> TwoSample:
    """Do two runs' samples come from one distribution? a (n_a, T) and b (n_b, T): token ids, one row per sample;
    groups_*: each sample's prompt index (default all 0: one prompt), compared prompt by prompt.

    Per position: Pearson's chi-square on the 2 x K table of (prompt, token) counts, rare ones pooled
    (token_columns), p from K - 1 degrees of freedom. Pooled: the sum of the positions' statistics, whose null
    distribution (the positions of one sample are dependent) comes from `permutations` seeded relabellings of the
    samples between the runs within each prompt. Holm over the T + 1 tests at alpha: two runs drawn from one
    distribution fail with probability at most alpha (up to the chi-square's approximation)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2 or a.shape[1] < 1:
        raise ValueError(f"homogeneity needs two runs of shape (n >= 2, T) with the same T, got {a.shape} and "
                         f"{b.shape}")
    ga = np.zeros(len(a), np.int64) if groups_a is None else np.asarray(groups_a, dtype=np.int64)
    gb = np.zeros(len(b), np.int64) if groups_b is None else np.asarray(groups_b, dtype=np.int64)
    if ga.shape != (len(a),) or gb.shape != (len(b),):
        raise ValueError("homogeneity: groups_a / groups_b need one prompt index per sample")
    from scipy import stats as sps

    x, g = np.concatenate([a, b]), np.concatenate([ga, gb])
    n_a, n, T = len(a), len(x), a.shape[1]
    cols, offsets, dfs = [], [0], []
    for i in range(T):
        c, k = token_columns(x[:, i], g, min(n_a, n - n_a), min_expected)
        cols.append(c + offsets[-1])
        offsets.append(offsets[-1] + k)
        dfs.append(k - 1)
    cols = np.stack(cols, 1)  # (n, T): every sample's column at each position, unique over positions
    total = np.bincount(cols.ravel(), minlength=offsets[-1]).astype(np.float64)

    def per_position(in_a):  # (..., columns) -> (..., T) statistics
        return np.stack([chi2_table(in_a[..., offsets[i]:offsets[i + 1]], total[offsets[i]:offsets[i + 1]], n_a, n)
                         for i in range(T)], -1)

    observed = per_position(np.bincount(cols[:n_a].ravel(), minlength=offsets[-1]).astype(np.float64))
    p = [float(sps.chi2.sf(s, d)) if d > 0 else 1.0 for s, d in zip(observed, dfs)]
    rng = np.random.default_rng([seed, 3])
    labels_perm = np.zeros((permutations, n), dtype=bool)
    for grp in np.unique(g):  # relabel within each prompt: the same number of run-A samples per prompt
        idx = np.flatnonzero(g == grp)
        k = int((g[:n_a] == grp).sum())
        keys = rng.random((permutations, len(idx)))
        chosen = idx[np.argsort(keys, 1)[:, :k]]
        np.put_along_axis(labels_perm, chosen, True, 1)
    run, member = np.nonzero(labels_perm)
    flat = (run[:, None] * offsets[-1] + cols[member]).ravel()  # every relabelled run-A sample's columns
    in_a = np.bincount(flat, minlength=permutations * offsets[-1]).reshape(permutations, -1).astype(np.float64)
    pooled = float(observed.sum())
    null = per_position(in_a).sum(-1)
    p.append(float((1 + (null >= pooled - 1e-9 * max(pooled, 1.0)).sum()) / (1 + permutations)))
    return TwoSample(n_a, n - n_a, [*map(float, observed), pooled], [*dfs, int(sum(dfs))], p, holm(p), alpha,
                     permutations, tuple(labels))
