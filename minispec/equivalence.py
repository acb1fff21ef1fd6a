"""The distribution-equivalence harness: do a real draft/target pair's speculative samples follow the target?

Method: the randomized probability integral transform (PIT; Smith 1985, Brockwell
2007). Draw N speculative continuations of T tokens per prompt. For each sample and
position i, p_i = the target's distribution of token i given the prompt and the
sampled tokens before it, from ONE batched target pass over the sampled sequences
(the prompt prefilled once and shared; the pass only appends, so a rollback bug in
the sampler cannot leak into the reference), processed by the same
`logits_to_probs` with the same SamplingParams. With F_i(x-) = the mass p_i puts
on the tokens before x in a fixed token order, and U ~ Uniform(0, 1) from a
seeded stream of its own,

    u_i = F_i(x_i-) + U * p_i(x_i)

is Uniform(0, 1) exactly when x_i ~ p_i, and by the chain rule (Rosenblatt 1952)
u_1..u_T of one sample are then independent. So under exactness each position's
u's, and all of them pooled, are iid uniform. Each set is tested with
Kolmogorov-Smirnov and with a histogram chi-square.

Any token order fixed by the prefix keeps u uniform; the order decides what the
test sees. Token-id order scatters the head of the distribution over the CDF;
descending-probability order puts it first, so an error that moves mass between
head and tail (what a wrong acceptance rule does) accumulates in F instead of
cancelling. On SmolLM2 the KS distance a broken sampler induces is 1.2-1.5x larger
in probability order (about half the samples for the same power); on a tiny random
pair the two are alike. Both run by default, on the same U, and the verdict is
Holm's correction over orders x (T positions + pooled) x 2 tests at level alpha:
a correct sampler fails with probability at most alpha.

Target-only samples (`target.generate`, same settings, same seeds) go through the
same tests as a calibration reference: if they fail, the harness is off, not the
sampler. Temperature 0 is handled apart: p is one-hot, so u is just U and says
nothing; greedy speculation must instead reproduce target greedy decoding token
for token, and that is what the harness checks there. Stop tokens are disabled
during the test (stop_tokens=[]), so every sample has exactly T tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .cli import k_argument  # --k: an integer >= 1 or "auto", as `python -m minispec generate` takes it
from .generate import normalize_prompts
from .sampling import SamplingParams, logits_to_probs
from .speculative import SAMPLERS, AdaptiveK, check_compatible

PROMPT_LOOKUP = "prompt-lookup"
MIN_SAMPLES = 10
# The defaults (Hugging Face's top_k=50, a common temperature) give each deliberately broken
# sampler a real effect: temperature != 1 and top-k make the processed q differ from the raw
# softmax ("unprocessed-q"; top-k more than doubles its effect on SmolLM2), and any draft that is
# not the target is rejected often enough for "no-residual" and "always-accept" to show.
DEFAULTS = dict(samples=2000, tokens=8, k=4, temperature=0.7, top_k=50, top_p=None, seed=0, sampler="exact",
                alpha=0.01, bins=20, batch_size=256)
TESTS = ("ks", "chi2")  # per position and pooled; Holm corrects over all of them


# ---------------------------------------------------------------------------
# the maths: pure functions
# ---------------------------------------------------------------------------

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
                         f"got probs {tuple(probs.shape)}, tokens {tuple(tokens.shape)}, uniforms {tuple(uniforms.shape)}")
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


def uniformity(u, bins: int = 20) -> Uniformity:
    """KS and histogram chi-square tests of u (1-D, values in [0, 1]) against Uniform(0, 1)."""
    from scipy import stats

    u = np.asarray(u, dtype=np.float64).ravel()
    if u.size < 2:
        raise ValueError(f"uniformity needs at least 2 values, got {u.size}")
    ks = stats.kstest(u, "uniform")
    b = chi2_bins(u.size, bins)
    counts, _ = np.histogram(u, bins=b, range=(0.0, 1.0))
    chi2 = stats.chisquare(counts)  # expected: equal counts
    return Uniformity(int(u.size), float(ks.statistic), float(ks.pvalue), float(chi2.statistic), float(chi2.pvalue), b)


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

@dataclass
class _Timed:
    tokens: list[list[int]]  # per prompt: the samples of that prompt, each T ids; flattened prompt-major
    seconds: float
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    sequence_rounds: int = 0


def _sample(target, draft, prompts: list[list[int]], n: int, T: int, params: SamplingParams, k: int, sampler: str,
            seed: int, batch_size: int, desc: str, progress: bool) -> _Timed:
    """n samples of T tokens per prompt, in chunks of batch_size; sample g (prompt-major) uses seed + g.

    draft None = target-only sampling (`generate`), the calibration reference.
    progress: show a progress bar labelled `desc` on stderr (it is not part of the timing).
    """
    bar = _progress_bar(n * len(prompts), desc, progress)
    out: list[list[int]] = []
    res = _Timed(out, 0.0)
    t0 = time.perf_counter()
    for j, prompt in enumerate(prompts):
        for start in range(0, n, batch_size):
            b = min(batch_size, n - start)
            kw = dict(max_new_tokens=T, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                      seed=seed + j * n + start, stop_tokens=[])
            if draft is None:
                tokens = target.generate([prompt] * b, **kw)
            else:
                r = target.speculate(draft, [prompt] * b, k=k, sampler=sampler, **kw)
                tokens, s = r.tokens, r.stats
                res.drafted += s.drafted
                res.accepted += s.accepted
                res.committed += s.committed
                res.sequence_rounds += s.sequence_rounds
            for t in tokens:
                if len(t) != T:
                    raise RuntimeError(f"a sample has {len(t)} tokens, expected {T} (stop tokens are disabled): "
                                       "the sampler ended a sequence early")
            out.extend(tokens)
            if bar is not None:
                bar.update(b)
    res.seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return res


def target_pit(target, prompts: list[list[int]], samples: list[list[int]], params: SamplingParams,
               rng: np.random.Generator, orders=ORDERS, max_logits_bytes: int = 1 << 26,
               block_size: int = 16) -> tuple[dict[str, np.ndarray], int]:
    """PIT values of samples (prompt-major, n per prompt) under the target: order -> (n_total, T);
    also how many sampled tokens had target probability 0 (impossible under target-only sampling).
    Every order uses the same uniforms U.

    One batched target pass over every sample: the prompt (all but its last token) is prefilled once
    into a paged cache and forked to every sample, then `step(..., all_logits=True)` runs
    [last prompt token, x_1 .. x_{T-1}] and returns the T distributions p_1..p_T in one call.
    The pass only appends, never rolls back, so a rollback bug in the sampler under test cannot
    reach the reference. Chunked so the logits stay under max_logits_bytes.
    """
    n = len(samples) // len(prompts)
    T = len(samples[0])
    V = target.config.vocab_size
    chunk = max(1, max_logits_bytes // (T * V * 4))
    us, impossible = {o: [] for o in orders}, 0
    for j, prompt in enumerate(prompts):
        P = len(prompt)
        x = torch.tensor(samples[j * n:(j + 1) * n], dtype=torch.long)  # (n, T)
        fed = torch.cat([torch.tensor(prompt[-1:], dtype=torch.long).expand(n, 1), x[:, :-1]], dim=1)  # (n, T)
        per_seq = -(-(P + T) // block_size) + 1  # a forked partial prompt block is copied on write
        shared = -(-(P - 1) // block_size)
        cache = target.new_cache(num_blocks=shared + min(chunk, n) * per_seq, block_size=block_size)
        parent = cache.new_sequence()
        if P > 1:
            target.step(cache, [parent], [prompt[:-1]])
        for s in range(0, n, chunk):
            xs = x[s:s + chunk]  # (b, T)
            seqs = [cache.fork(parent) for _ in range(len(xs))]
            logits = target.step(cache, seqs, fed[s:s + chunk].tolist(), all_logits=True)  # (b, T, V)
            for q in seqs:
                cache.free(q)
            probs = logits_to_probs(logits, params).cpu()  # (b, T, V): p_1..p_T
            impossible += int((probs.gather(-1, xs.unsqueeze(-1)) == 0).sum())
            U = torch.from_numpy(rng.random(tuple(xs.shape)))  # (b, T)
            for o in orders:
                us[o].append(pit(probs, xs, U, o).numpy())
        cache.free(parent)
    return {o: np.concatenate(v, axis=0) for o, v in us.items()}, impossible


# ---------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------

@dataclass
class EquivalenceReport:
    settings: dict
    mode: str  # "pit" (temperature > 0) or "greedy" (token-for-token equality with target greedy)
    passed: bool  # the verdict on the speculative sampler
    speculative: RunStats | None = None
    reference: RunStats | None = None  # target-only calibration; None when skipped or greedy
    u: dict | None = None  # token order -> (n_total, T) speculative PIT values (for plots)
    u_reference: dict | None = None
    impossible: int = 0  # speculative tokens to which the target gives probability 0
    impossible_reference: int = 0
    speed: dict = field(default_factory=dict)
    speculation: dict = field(default_factory=dict)  # acceptance figures of the speculative run
    greedy_mismatches: list = field(default_factory=list)  # greedy mode: (prompt index, first differing position)
    notes: list[str] = field(default_factory=list)

    @property
    def calibrated(self) -> bool | None:
        """Did the target-only reference pass (None: not run)? A failing reference means the harness is off."""
        return None if self.reference is None else self.reference.passed

    def to_dict(self) -> dict:
        d = {"passed": self.passed, "mode": self.mode, "calibrated": self.calibrated, "settings": self.settings,
             "speed": self.speed, "speculation": self.speculation, "notes": self.notes}
        if self.mode == "pit":
            d["speculative"] = self.speculative.to_dict()
            d["reference"] = None if self.reference is None else self.reference.to_dict()
            d["impossible_tokens"] = {"speculative": self.impossible, "reference": self.impossible_reference}
        else:
            d["greedy_mismatches"] = [{"prompt": j, "position": i + 1} for j, i in self.greedy_mismatches]
        return d

    def format(self) -> str:
        """A readable report: settings, the per-position table (speculative beside target-only), verdict, speed."""
        s = self.settings
        lines = [f"equivalence: speculative (sampler={s['sampler']}, draft={s['draft']}, k={s['k']}) against "
                 f"target {s['target']}",
                 f"  {1 if self.mode == 'greedy' else s['samples']} sample(s) x {s['tokens']} tokens per prompt, "
                 f"{s['prompts']} prompt(s); temperature={s['temperature']}, top_k={s['top_k']}, top_p={s['top_p']}, "
                 f"seed={s['seed']}",
                 f"  stop tokens disabled during the test: every sample has exactly {s['tokens']} tokens"]
        if self.mode == "greedy":
            lines.append("  temperature 0: the PIT is degenerate (p is one-hot), so the check is token-for-token "
                         "equality with target greedy decoding, one sample per prompt")
            if self.passed:
                lines.append(f"verdict: PASSED: speculative greedy tokens equal target greedy tokens for all "
                             f"{s['prompts']} prompt(s)")
            else:
                where = ", ".join(f"prompt {j} from position {i + 1}" for j, i in self.greedy_mismatches)
                lines.append(f"verdict: FAILED: speculative greedy tokens differ from target greedy ({where})")
        else:
            orders = " and ".join({"id": "token-id order", "prob": "descending-probability order"}[o]
                                  for o in s["token_orders"])
            lines.append(f"  randomized PIT u = F(x-) + U p(x) in {orders}; per position and pooled ('all'): "
                         f"KS and chi-square ({self.speculative.tests[s['token_orders'][0]][-1].bins} bins); "
                         f"p_holm: Holm-adjusted over {self.speculative.n_tests} tests")
            lines += ["", self._table(), ""]
            lines.append(f"verdict: {'PASSED' if self.passed else 'FAILED'} at alpha={s['alpha']} "
                         f"(smallest Holm-adjusted p = {self.speculative.min_adjusted:.3g}, "
                         f"smallest raw p = {self.speculative.min_raw:.3g})")
            if self.impossible:
                lines.append(f"  {self.impossible} sampled tokens have target probability 0 (outside top-k/top-p): "
                             "impossible under target-only sampling, short of a rounding near-tie at the cut")
            if self.reference is not None:
                cal = "PASSED" if self.reference.passed else "FAILED: the harness itself is off; do not trust the verdict"
                lines.append(f"calibration (target-only samples, same settings and seeds): {cal} "
                             f"(smallest Holm-adjusted p = {self.reference.min_adjusted:.3g}, "
                             f"smallest raw p = {self.reference.min_raw:.3g})")
        sp = self.speculation
        if sp:
            lines.append(f"speculation: acceptance rate {sp['acceptance_rate']:.3f}, "
                         f"{sp['mean_accepted']:.2f} tokens per round per sequence")
        v = self.speed
        parts = [f"speculative {v['speculative_samples_per_s']:.1f} samples/s ({v['speculative_s']:.1f} s)"]
        if "reference_samples_per_s" in v:
            parts.append(f"target-only {v['reference_samples_per_s']:.1f} samples/s ({v['reference_s']:.1f} s)")
        if "pit_s" in v:
            parts.append(f"target PIT passes {v['pit_s']:.1f} s")
        lines.append("speed: " + "; ".join(parts) + f"; total {v['total_s']:.1f} s "
                     f"({s['torch_threads']} torch thread(s))")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _table(self) -> str:
        runs = [self.speculative] + ([self.reference] if self.reference is not None else [])
        orders = list(self.speculative.tests)
        sub = "/".join(orders)
        cell = f"{'KS p (' + sub + ')':<20}{'chi2 p (' + sub + ')':<20}{'p_holm':<10}"
        width = len(cell)
        out = [f"{'':<9}" + "".join(f"| {r.label:<{width}}" for r in runs),
               f"{'position':<9}" + f"| {cell}" * len(runs)]
        for i, where in enumerate(self.speculative.row_names):
            line = f"{where:<9}"
            for r in runs:
                ks = "/".join(f"{r.tests[o][i].ks_p:.2g}" for o in orders)
                chi = "/".join(f"{r.tests[o][i].chi2_p:.2g}" for o in orders)
                adj = r.row_min_adjusted(i)
                line += f"| {ks:<20}{chi:<20}{adj:<8.3g}{' *' if adj <= r.alpha else '  '}"
            out.append(line.rstrip())
        out.append("(* = rejected at alpha after Holm's correction)")
        return "\n".join(out)


class EquivalenceInputError(ValueError):
    """Bad input to the harness, found before any sampling (the command line exits with status 2 on it)."""


def _check_int(name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise EquivalenceInputError(f"{name} must be an integer >= {lo}, got {v!r}")


def _check_inputs(target, draft, prompts, samples, tokens, k, temperature, top_k, top_p, seed, sampler, alpha, bins,
                  orders, batch_size):
    """Validate everything before any sampling; returns (SamplingParams, prompt batch, orders)."""
    try:
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
        _check_int("samples", samples, MIN_SAMPLES)
        _check_int("tokens", tokens, 1)
        if k != "auto" and not isinstance(k, AdaptiveK):
            _check_int("k", k, 1)
        _check_int("seed", seed, 0)
        _check_int("bins", bins, 2)
        _check_int("batch_size", batch_size, 1)
        if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        orders = tuple(orders)
        if not orders or any(o not in ORDERS for o in orders) or len(set(orders)) != len(orders):
            raise ValueError(f"orders must be a non-empty selection of {', '.join(ORDERS)}; got {orders!r}")
        params = SamplingParams(temperature, top_k, top_p)
        if isinstance(draft, str):
            if draft != PROMPT_LOOKUP:
                raise ValueError(f"draft must be a Transformer or {PROMPT_LOOKUP!r}, got {draft!r}")
        else:
            if not (hasattr(draft, "step") and hasattr(draft, "config")):
                raise ValueError(f"draft must be a Transformer or {PROMPT_LOOKUP!r}, got {type(draft).__name__}")
            check_compatible(target, draft)  # vocab size and tokenizer fingerprint
        batch, _ = normalize_prompts(target, prompts)
        for j, p in enumerate(batch):
            if len(p) + tokens > target.config.max_seq_len:
                raise ValueError(f"prompt {j} ({len(p)} tokens) + {tokens} new tokens exceeds the target's "
                                 f"max_seq_len={target.config.max_seq_len}; use a shorter prompt or fewer tokens")
    except ValueError as e:  # SamplingParams, normalize_prompts, check_compatible: already say what to do
        raise EquivalenceInputError(str(e)) from None
    return params, batch, orders


def run_equivalence(target, draft, prompts, samples: int = DEFAULTS["samples"], tokens: int = DEFAULTS["tokens"],
                    k: "int | str | AdaptiveK" = DEFAULTS["k"], temperature: float = DEFAULTS["temperature"],
                    top_k: int | None = DEFAULTS["top_k"], top_p: float | None = DEFAULTS["top_p"], seed: int = 0,
                    sampler: str = "exact", alpha: float = DEFAULTS["alpha"], bins: int = DEFAULTS["bins"],
                    orders=ORDERS, reference: bool = True, batch_size: int = DEFAULTS["batch_size"],
                    progress: bool = False, names: dict | None = None) -> EquivalenceReport:
    """Test that target.speculate(draft, ...) samples from the target's distribution.

    target: a Transformer; draft: a Transformer sharing its tokenizer and vocabulary, or "prompt-lookup".
    prompts: token ids, one prompt (list[int]) or several (list[list[int]]); `samples` continuations
    of `tokens` tokens are drawn per prompt, sample g (prompt-major) with the generator seeded seed + g.
    temperature, top_k, top_p, k, sampler: passed to speculate (k an integer, "auto" or an AdaptiveK;
    sampler "exact" or a broken negative control).
    alpha: the significance level of the verdict (Holm-corrected); bins: chi-square histogram bins;
    orders: the token orders the PIT runs in ("id", "prob"; all their tests join one Holm family).
    reference: also test target-only samples (the calibration reference).
    batch_size: samples per speculate/generate call. names: labels for target/draft in the report.
    Temperature 0 checks token-for-token equality with target greedy decoding instead of the PIT.
    Raises EquivalenceInputError (a ValueError) on bad input, before any sampling.
    """
    params, batch, orders = _check_inputs(target, draft, prompts, samples, tokens, k, temperature, top_k, top_p,
                                          seed, sampler, alpha, bins, orders, batch_size)
    names = names or {}
    settings = {"target": names.get("target", "(model)"),
                "draft": names.get("draft", draft if isinstance(draft, str) else "(model)"),
                "prompts": len(batch), "prompt_lengths": [len(p) for p in batch], "samples": samples,
                "tokens": tokens, "k": k if isinstance(k, (int, str)) else f"AdaptiveK(k_max={k.k_max})",
                "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "sampler": sampler, "alpha": alpha, "bins": bins, "correction": "holm", "stop_tokens": "disabled",
                "token_orders": list(orders), "batch_size": batch_size, "torch_threads": torch.get_num_threads()}
    notes = ["timings are wall-clock and include whatever else the machine runs; on a shared, loaded machine "
             "they understate the speed"]
    if sampler == "unprocessed-q" and params.temperature == 1 and top_k is None and top_p is None:
        notes.append("unprocessed-q has no effect here: at temperature 1 without top-k/top-p the processed q "
                     "is the raw softmax")
    if sampler == "unprocessed-q" and isinstance(draft, str):
        notes.append("unprocessed-q has no effect with prompt-lookup: its q is one-hot whatever the settings")
    stops_by_confidence = isinstance(k, AdaptiveK) and k.confidence_stop and not isinstance(draft, str)
    if sampler == "sampled-confidence" and not stops_by_confidence:
        notes.append("sampled-confidence has no effect here: sampled drafts stop by confidence only with a model "
                     "draft and k=AdaptiveK(confidence_stop=True)")
    t_start = time.perf_counter()

    if params.greedy:
        return _greedy(target, draft, batch, tokens, k, sampler, settings, notes, t_start)

    n_total = samples * len(batch)
    spec = _sample(target, draft, batch, samples, tokens, params, k, sampler, seed, batch_size, "speculative", progress)
    t0 = time.perf_counter()
    # the PIT's own uniforms: a stream of their own, independent of every sampling generator
    u, impossible = target_pit(target, batch, spec.tokens, params, np.random.default_rng([seed, 1]), orders)
    pit_s = time.perf_counter() - t0
    report = EquivalenceReport(settings, "pit", False, analyse(u, alpha, bins, "speculative"), u=u,
                               impossible=impossible, notes=notes)
    report.speculation = {"acceptance_rate": spec.accepted / spec.drafted if spec.drafted else 0.0,
                          "mean_accepted": spec.committed / spec.sequence_rounds if spec.sequence_rounds else 0.0,
                          "drafted": spec.drafted, "accepted": spec.accepted}
    report.speed = {"speculative_s": spec.seconds, "speculative_samples_per_s": n_total / spec.seconds,
                    "speculative_tokens_per_s": n_total * tokens / spec.seconds}
    if spec.drafted == 0:
        notes.append("the drafter proposed no tokens, so no draft was ever verified: the test says nothing about "
                     "the acceptance rule (prompt lookup needs repeated n-grams in the context)")
    if reference:
        ref = _sample(target, None, batch, samples, tokens, params, k, sampler, seed, batch_size, "target-only",
                      progress)
        t0 = time.perf_counter()
        u_ref, imp_ref = target_pit(target, batch, ref.tokens, params, np.random.default_rng([seed, 2]), orders)
        pit_s += time.perf_counter() - t0
        report.reference = analyse(u_ref, alpha, bins, "target-only (calibration)")
        report.u_reference, report.impossible_reference = u_ref, imp_ref
        report.speed.update(reference_s=ref.seconds, reference_samples_per_s=n_total / ref.seconds)
    report.passed = report.speculative.passed
    report.speed.update(pit_s=pit_s, total_s=time.perf_counter() - t_start)
    return report


def _greedy(target, draft, batch, tokens, k, sampler, settings, notes, t_start) -> EquivalenceReport:
    """Temperature 0: speculative greedy must equal target greedy, token for token (one sample per prompt)."""
    kw = dict(max_new_tokens=tokens, temperature=0.0, stop_tokens=[])
    t0 = time.perf_counter()
    res = target.speculate(draft, batch, k=k, sampler=sampler, **kw)
    spec_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = target.generate(batch, **kw)
    ref_s = time.perf_counter() - t1
    mismatches = []
    for j, (a, b) in enumerate(zip(res.tokens, ref)):
        if a != b:
            mismatches.append((j, next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    notes.append("temperature 0: one sample per prompt (greedy decoding is deterministic); --samples is not used")
    s = res.stats
    report = EquivalenceReport(settings, "greedy", not mismatches, greedy_mismatches=mismatches, notes=notes)
    report.speculation = {"acceptance_rate": s.acceptance_rate, "mean_accepted": s.mean_accepted,
                          "drafted": s.drafted, "accepted": s.accepted}
    report.speed = {"speculative_s": spec_s, "speculative_samples_per_s": len(batch) / spec_s,
                    "reference_s": ref_s, "reference_samples_per_s": len(batch) / ref_s,
                    "total_s": time.perf_counter() - t_start}
    return report


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True)


def plot_report(report: EquivalenceReport, path) -> None:
    """PNG of the u histograms per position and pooled (one row of panels per token order), speculative
    against target-only, over the band a uniform histogram stays in with probability 1 - alpha per bin."""
    if report.mode != "pit":
        raise ValueError("plots need the PIT (temperature > 0); a greedy run has no u's to plot")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    from scipy import stats

    orders = list(report.u)
    T = report.u[orders[0]].shape[1]
    cols = min(T + 1, 6)  # T positions + pooled, wrapped into rows of at most 6 panels per order
    rows_per_order = math.ceil((T + 1) / cols)
    fig, axes = plt.subplots(rows_per_order * len(orders), cols, squeeze=False,
                             figsize=(2.6 * cols, 2.3 * rows_per_order * len(orders)))
    for ax in axes.flat:
        ax.axis("off")
    alpha, s = report.settings["alpha"], report.settings
    for j, order in enumerate(orders):
        u = report.u[order]
        ur = None if report.u_reference is None else report.u_reference[order]
        for i in range(T + 1):
            ax = axes[j * rows_per_order + i // cols, i % cols]
            ax.axis("on")
            us = u[:, i] if i < T else u.ravel()
            b = chi2_bins(us.size, s["bins"])
            edges = np.linspace(0, 1, b + 1)
            lo, hi = stats.binom.ppf([alpha / 2, 1 - alpha / 2], us.size, 1 / b)
            ax.axhspan(lo, hi, color="0.85", label=f"uniform, {1 - alpha:.0%} per bin")
            ax.axhline(us.size / b, color="0.4", lw=0.8)
            ax.hist(us, bins=edges, histtype="step", lw=1.5, color="C3", label="speculative")
            if ur is not None:
                ax.hist(ur[:, i] if i < T else ur.ravel(), bins=edges, histtype="step", lw=1.0, color="C0",
                        label="target-only")
            ax.set_title(f"{'position ' + str(i + 1) if i < T else 'all positions'} ({order} order)", fontsize=8)
            ax.set_xlim(0, 1)
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"PIT u histograms: sampler={s['sampler']}, temperature={s['temperature']}, top_k={s['top_k']}, "
                 f"top_p={s['top_p']}, {s['samples']} samples x {s['prompts']} prompt(s): "
                 f"{'PASSED' if report.passed else 'FAILED'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# command line: python -m minispec equivalence ...
# ---------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `equivalence` subcommand's arguments (value checks happen in run_cli: bad input exits with 2)."""
    p.add_argument("--target", required=True, metavar="DIR", help="the target checkpoint directory")
    p.add_argument("--draft", required=True, metavar="DIR|prompt-lookup",
                   help="the draft checkpoint directory, or prompt-lookup (n-gram drafts from the context)")
    p.add_argument("--prompt", metavar="TEXT", help="a prompt (text)")
    p.add_argument("--prompts", metavar="FILE", help="a file of prompts, one per line (with --prompt: both)")
    p.add_argument("--samples", type=int, metavar="N", default=DEFAULTS["samples"],
                   help=f"samples per prompt, >= {MIN_SAMPLES} (default {DEFAULTS['samples']})")
    p.add_argument("--tokens", type=int, metavar="T", default=DEFAULTS["tokens"],
                   help=f"new tokens per sample (default {DEFAULTS['tokens']})")
    p.add_argument("--temperature", type=float, metavar="X", default=DEFAULTS["temperature"],
                   help=f"default {DEFAULTS['temperature']}; 0 checks equality with target greedy instead")
    p.add_argument("--top-k", type=int, metavar="K", default=DEFAULTS["top_k"],
                   help=f"sample from the k most likely tokens; 0 = off (default {DEFAULTS['top_k']})")
    p.add_argument("--top-p", type=float, metavar="P", default=None, help="nucleus sampling mass")
    p.add_argument("--k", type=k_argument, metavar="K", default=DEFAULTS["k"],
                   help=f"draft tokens per round, or 'auto' (default {DEFAULTS['k']})")
    p.add_argument("--seed", type=int, metavar="S", default=0, help="sample g uses seed + g (default 0)")
    p.add_argument("--sampler", default="exact", metavar="NAME",
                   help=f"{' | '.join(SAMPLERS)}: the broken ones are negative controls the test must reject")
    p.add_argument("--alpha", type=float, metavar="A", default=DEFAULTS["alpha"],
                   help=f"significance level of the verdict (default {DEFAULTS['alpha']})")
    p.add_argument("--order", choices=("id", "prob", "both"), default="both",
                   help="token order of the PIT's CDF: token ids, descending probability, or both (default)")
    p.add_argument("--bins", type=int, metavar="B", default=DEFAULTS["bins"], help="chi-square histogram bins (default 20)")
    p.add_argument("--batch-size", type=int, metavar="B", default=DEFAULTS["batch_size"],
                   help=f"samples per batched speculate call (default {DEFAULTS['batch_size']})")
    p.add_argument("--no-reference", action="store_true", help="skip the target-only calibration run (halves the time)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="write the u histograms per position (needs matplotlib)")
    p.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda, ... (default: cuda when available)")


def _read_prompts(args) -> list[str]:
    texts = []
    if args.prompt is not None:
        texts.append(args.prompt)
    if args.prompts is not None:
        try:
            lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --prompts {args.prompts}: {e.strerror}") from None
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise ValueError(f"--prompts {args.prompts} holds no prompts (one per line)")
        texts += lines
    if not texts:
        raise ValueError("give a prompt: --prompt TEXT or --prompts FILE")
    return texts


def _checkpoint(path: str, what: str) -> str:
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--{what} {path} is not a minispec checkpoint directory (no config.json there); "
                         "make one with tools/convert_gguf.py or `make weights`")
    return path


def run_cli(args: argparse.Namespace) -> int:
    """Run the harness from parsed arguments. Exit status: 0 passed, 1 failed (or uncalibrated), 2 bad input.

    Errors while loading or running (a checkpoint that does not load, ...) propagate: the caller prints them.
    """
    from .model import Transformer

    try:
        # cheap checks first, so bad input fails before a checkpoint loads
        if args.sampler not in SAMPLERS:
            raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}; got {args.sampler!r}")
        _check_int("--samples", args.samples, MIN_SAMPLES)
        _check_int("--tokens", args.tokens, 1)
        top_k = None if args.top_k == 0 else args.top_k
        SamplingParams(args.temperature, top_k, args.top_p)
        texts = _read_prompts(args)
        _checkpoint(args.target, "target")
        if args.draft != PROMPT_LOOKUP:
            _checkpoint(args.draft, "draft")
        if args.plot is not None and args.temperature > 0:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("--plot needs matplotlib: pip install matplotlib (an optional extra)") from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = Transformer.from_pretrained(args.target, device=device)
    draft = args.draft if args.draft == PROMPT_LOOKUP else Transformer.from_pretrained(args.draft, device=device)
    try:
        tok = target.tokenizer
        if tok is None:
            raise EquivalenceInputError(f"{args.target} has no tokenizer (tokenizer.json or tokenizer.model); "
                                        "the prompts are text")
        prompts = []
        for i, text in enumerate(texts):
            ids = tok.encode(text)
            if not ids:
                raise EquivalenceInputError(f"prompt {i} ({text!r}) encodes to no tokens and this tokenizer adds "
                                            "no bos; give a non-empty prompt")
            prompts.append(ids)
        report = run_equivalence(target, draft, prompts, samples=args.samples, tokens=args.tokens, k=args.k,
                                 temperature=args.temperature, top_k=top_k, top_p=args.top_p, seed=args.seed,
                                 sampler=args.sampler, alpha=args.alpha, bins=args.bins,
                                 orders=ORDERS if args.order == "both" else (args.order,),
                                 reference=not args.no_reference, batch_size=args.batch_size, progress=True,
                                 names={"target": args.target, "draft": args.draft})
    except EquivalenceInputError as e:  # only input errors: a ValueError from inside sampling is a failure (1)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:
        if report.mode == "pit":
            plot_report(report, args.plot)
            report.notes.append(f"u histograms written to {args.plot}")
        else:
            report.notes.append("--plot ignored: a greedy run has no u's to plot")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
    return 0 if report.passed and report.calibrated is not False else 1


def main(argv: list[str] | None = None) -> int:
    """python -m minispec.equivalence ... (the same as python -m minispec equivalence ...)."""
    p = argparse.ArgumentParser(prog="python -m minispec equivalence",
                                description="distribution-equivalence test of speculative sampling against the target")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_cli(args)
    except (ValueError, OSError) as e:  # a checkpoint or tokenizer that does not load says what to do
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
