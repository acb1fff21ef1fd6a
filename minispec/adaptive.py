"""Adaptive draft length: k="auto" picks each round's k from what it has measured.

The cost model is in docs/design.md ("Choosing k"). `best_k` maximises tokens per unit of time,
`AdaptiveK` feeds it running estimates of acceptance and costs, and `auto_k` keeps one estimator
per (target, draft, sampling settings, batch size) so a stream of requests finds the right k once.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

from .errors import check_int
from .sampling import SamplingParams


def expected_tokens(a: float, k: int) -> float:
    """Tokens one round commits when each draft token is accepted independently with probability a:
    1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def round_cost(k: int, c: float, verify: float, c_first: float | None = None, all_accepted: float = 0.0) -> float:
    """One round's cost in plain decode steps: the target's verify pass over k drafts plus k draft steps of cost c.

    The round's first draft step feeds two new tokens (the last draft and the bonus token) after a round
    that accepted every draft: given `c_first`, that step's cost, it is counted at c_first in the share
    `all_accepted` of rounds and at c in the others. k = 0 is a plain decode step: `verify` alone.
    tools/bench.py's cost model (docs/benchmarks.md, "Cost model") and `best_k` both price a round here.
    """
    if c_first is None or k == 0:
        return verify + k * c
    return verify + (k - 1) * c + all_accepted * c_first + (1 - all_accepted) * c


def tree_round_cost(shape: tuple[int, ...], draft_pass: Callable[[int], float], verify: float,
                    width: int | None = None) -> float:
    """One tree round's cost in plain decode steps: the draft's d passes, pass i over the nodes of depth i - 1 (1,
    b_1, b_1 b_2, ... tokens, at most `width` with a DynamicTree's; draft_pass(w): the cost of a draft pass over w
    tokens), and the target's verify pass over the tree's nodes and its root (`verify`). The chain of k drafts is
    the tree (1, ..., 1): round_cost(k, c, verify) with c = draft_pass(1). tools/bench_tree.py prices trees and
    chains with these two."""
    return verify + sum(draft_pass(min(math.prod(shape[:i]), width or math.inf)) for i in range(len(shape)))


def best_k(a: float, c: float, k_max: int = 8, verify: list[float] | None = None) -> int:
    """The draft length with the most tokens per unit of time.

    a: per-token acceptance probability; c: one draft step's cost relative to one plain decode step;
    verify[k]: the cost of the target pass that checks k drafts, in the same unit (default 1; on a CPU it
    grows with k). A round of k drafts costs round_cost(k, c, verify[k]) = k*c + verify[k] and yields
    expected_tokens(a, k); k = 0 is plain decoding. Ties go to the smaller k.
    """
    v = [1.0] * (k_max + 1) if verify is None else verify
    return max(range(k_max + 1), key=lambda k: (expected_tokens(a, k) / round_cost(k, c, v[k]), -k))


class AdaptiveK:
    """k="auto": picks each round's k from running estimates of acceptance and of the step costs.

    Acceptance: decayed successes (accepted drafts) and failures (rejections); costs: decayed averages of
    the measured draft-step time and, per k, of the verify time (see verify_cost). While plain decoding
    is chosen, a probe round drafts a single token to keep the estimates fresh: after `probe_every` plain
    rounds, then after twice as many each time plain decoding is still chosen, up to `probe_max`: a probe
    costs a draft pass over the tokens since the last and a two-token verify pass, which is all k="auto"
    loses against plain decoding where speculation does not pay.

    The decay (0.97 a round) keeps about 30 rounds in view: at 0.9 the estimates followed each rejection
    and k="auto" ran behind the best fixed k, which it matched or beat at 0.97 (docs/benchmarks.md, "k=auto").

    Exactness does not depend on any of this: a round's k is fixed before its drafts are drawn. Measured
    times make the k's chosen depend on the machine and the moment, and with them which random numbers
    decide which token, so the same seed can give other tokens (from the same distribution) run to run.
    Pass `cost_ratio` (draft step / plain decode step, verify costs equal for every k) to make it
    deterministic: `speculate(..., k=AdaptiveK(cost_ratio=0.1))`, or k="auto-fixed" (fixed_cost_ratio).
    """

    def __init__(self, k_max: int = 8, decay: float = 0.97, probe_every: int = 8, k_start: int = 2,
                 cost_ratio: float | None = None, probe_max: int = 64):
        check_int("k_max", k_max, 1)
        check_int("probe_every", probe_every, 1)
        check_int("probe_max", probe_max, probe_every)
        if cost_ratio is not None and not cost_ratio >= 0:
            raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio!r}")
        self.k_max, self.decay, self.probe_every, self.cost_ratio = k_max, decay, probe_every, cost_ratio
        self.k_start = min(k_start, k_max)
        self.successes = self.failures = 0.0
        self.draft_step_s: float | None = None
        self.verify_s: dict[int, float] = {}  # k drafted in the round -> decayed mean verify seconds
        self.probe_max = probe_max
        self.plain_rounds = 0  # plain rounds since the last probe (or since speculation was last chosen)
        self.probe_gap = probe_every  # plain rounds before the next probe

    @property
    def acceptance(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total else 0.0

    def verify_cost(self, k: int) -> float:
        """Estimated seconds of a verify pass over k drafts (needs at least one measurement)."""
        if k in self.verify_s:
            return self.verify_s[k]
        lo = max((j for j in self.verify_s if j < k), default=None)
        hi = min((j for j in self.verify_s if j > k), default=None)
        if hi is None:  # beyond the largest measured k: continue the last measured slope, never downhill
            top = sorted(self.verify_s)[-2:]
            if len(top) < 2:  # one k measured: flat
                return self.verify_s[lo]
            j0, j1 = top
            slope = max(0.0, (self.verify_s[j1] - self.verify_s[j0]) / (j1 - j0))
            return self.verify_s[j1] + slope * (k - j1)
        if lo is None:  # below the smallest: its cost (a shorter pass costs no more)
            return self.verify_s[hi]
        w = (k - lo) / (hi - lo)  # between two measured k's: interpolated
        return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]

    def choose(self) -> int:
        """This round's k (0 = a plain decode step)."""
        if self.successes + self.failures == 0:
            return self.k_start
        if self.cost_ratio is not None:
            k = best_k(self.acceptance, self.cost_ratio, self.k_max)
        elif self.draft_step_s is None or not self.verify_s:
            return self.k_start  # nothing measured yet
        else:
            unit = max(self.verify_cost(0), 1e-12)  # a clock too coarse to see a step must not divide by 0
            k = best_k(self.acceptance, self.draft_step_s / unit, self.k_max,
                       [self.verify_cost(j) / unit for j in range(self.k_max + 1)])
        return self._gate(k)

    def _gate(self, k: int) -> int:
        """The k chosen, except that while plain decoding (k = 0) is chosen a one-draft probe comes on schedule."""
        if k == 0:
            self.plain_rounds += 1
            if self.plain_rounds < self.probe_gap:
                return 0
            self.plain_rounds, self.probe_gap = 0, min(self.probe_max, 2 * self.probe_gap)
            return 1  # a probe keeps the estimates fresh
        self.plain_rounds, self.probe_gap = 0, self.probe_every
        return k

    def update(self, drafted: list[int], accepted: list[int], draft_s: float, draft_steps: int,
               verify_s: float | None) -> None:
        """One round's outcome: per sequence drafts and acceptances; wall times of drafting (over draft_steps
        forward passes; 0: not timed) and of verifying (None: not timed)."""
        d = self.decay
        if any(drafted):  # a plain round says nothing of acceptance: it must not wear the estimate away
            self.successes = d * self.successes + sum(accepted)
            self.failures = d * self.failures + sum(n < k for n, k in zip(accepted, drafted))
        ema = lambda old, new: new if old is None else d * old + (1 - d) * new  # noqa: E731
        if draft_steps > 0:
            self.draft_step_s = ema(self.draft_step_s, draft_s / draft_steps)
        k = max(drafted, default=0)
        if verify_s is not None:
            self.verify_s[k] = ema(self.verify_s.get(k), verify_s)


AUTO_FIXED = "auto-fixed"  # k="auto-fixed": AdaptiveK with fixed_cost_ratio, a fresh one each call


def weights_per_token(cfg) -> int:
    """The weights one decode step of a model with this config multiplies a token by: its layers' projections
    and its head (the embedding is a lookup)."""
    attn = cfg.dim * cfg.head_dim * 2 * (cfg.n_heads + cfg.n_kv_heads)  # q, o and k, v
    return cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_dim) + cfg.dim * (cfg.head_vocab_size or cfg.vocab_size)


def fixed_cost_ratio(target, draft) -> float:
    """A draft step's cost relative to a plain decode step of the target, from the configs alone: the ratio of
    their weights_per_token (0 for a drafter without a model, such as prompt lookup). A decode step reads
    every weight once, so this ratio tracks the measured one on any machine without depending on timings;
    it ignores the dtypes and kernels that make the measured ratio differ from it."""
    model = getattr(draft, "model", draft)  # a ModelDrafter (or a Drafter holding a model), or the model itself
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "n_layers"):
        return 0.0
    return weights_per_token(cfg) / weights_per_token(target.config)


# k="auto" carries its estimator from call to call: target -> {(draft, sampling settings, batch size): (draft
# reference, AdaptiveK)}. Weak on both sides, so it never keeps a model alive.
_AUTO_K: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def auto_k(target, draft, params: SamplingParams, batch_size: int, sampler: str = "exact",
           make: Callable[[], AdaptiveK] = AdaptiveK) -> AdaptiveK:
    """The AdaptiveK that k="auto" uses for this target, draft, sampling settings and batch size.

    Acceptance depends on the pair and the sampling settings, the step costs on the pair, the batch size
    and the machine; none on the prompt or the seed. A negative control (`sampler`) keeps estimates of its
    own. Pass k=AdaptiveK() to speculate for an estimator of your own. `make`: the estimator's class
    (tree="auto" keeps a tree.AdaptiveTree apart from k="auto"'s).
    """
    if isinstance(draft, str):
        ref, draft_key = (lambda d=draft: d), draft
    else:
        ref, draft_key = weakref.ref(draft), id(draft)
    key = (draft_key, params.temperature, params.top_k, params.top_p, batch_size, sampler, make)
    table = _AUTO_K.setdefault(target, {})
    entry = table.get(key)
    if entry is None or entry[0]() is not draft:  # new, or an id reused by another object
        entry = table[key] = (ref, make())
    return entry[1]
