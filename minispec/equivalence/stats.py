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
# sampling and the target's own probabilities
# ---------------------------------------------------------------------------
