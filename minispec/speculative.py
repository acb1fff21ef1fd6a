"""Exact speculative decoding over the paged KV cache.

One round, per sequence (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling"):

1. the drafter proposes d_1..d_k, each drawn from q_i, the exact distribution
   it sampled from (the draft's logits through the same `logits_to_probs`);
2. the target runs once over [last committed token, d_1..d_k] -> p_1..p_{k+1};
3. left to right, d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
4. at the first rejection the next token comes from norm(max(0, p_i - q_i));
5. if all k are accepted, a bonus token comes from p_{k+1};
6. both caches are truncated back to the committed tokens.

Every emitted token is then distributed exactly as under target-only sampling:
min(p, q) arrives by acceptance, max(0, p - q) by the residual, and they sum
to p (`acceptance` computes both halves so the tests can check the sum).
Greedy decoding is the same rule: `logits_to_probs` makes p and q one-hot, so
d_i is accepted iff it is the target's argmax and the residual is that argmax.

The maths lives in pure functions (`acceptance`, `residual`, `verify`, and
`sampling.sample_rows`); `speculate` is the batched loop around them. Drafters share one
small interface (`Drafter`): a smaller Transformer (`ModelDrafter`) or n-gram
lookup in the sequence's own context (`PromptLookupDrafter`; Saxena 2023).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from .generate import OnTokens, check_max_new_tokens, normalize_prompts, resolve_stop_tokens
from .sampling import SamplingParams, logits_to_probs, make_generators, sample_rows

# "exact" is the algorithm; the others are deliberately wrong, kept as negative
# controls that the statistical tests and the equivalence harness must reject.
SAMPLERS = ("exact", "no-residual", "always-accept", "unprocessed-q", "sampled-confidence")


# ---------------------------------------------------------------------------
# the maths: pure functions of probability vectors and uniforms
# ---------------------------------------------------------------------------

def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: where the next token comes from after a rejection.

    When p == q the residual has no mass, but then no draft token can be
    rejected; p is returned so the result is always a distribution.
    """
    r = (p.double() - q.double()).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(torch.float64).tiny), p.double())


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one position: accept probability per drafted token, rejection probability, residual.

    p, q: (..., V) target and draft distributions. Returns
    accept (..., V) = min(1, p/q) (1 where q = 0: such a token is never drafted),
    reject (...,) = sum max(0, p - q) = P(the draft token is rejected),
    residual (..., V). The emitted token's distribution is
    q * accept + reject * residual, which equals p.
    """
    p, q = p.double(), q.double()
    accept = torch.where(q > 0, (p / q.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0), torch.ones_like(p))
    reject = (p - q).clamp_min(0.0).sum(-1)
    return accept, reject, residual(p, q)


def verify(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor,
           sampler: str = "exact") -> tuple[int, int]:
    """The acceptance step of one round for one sequence. Pure: no state, no RNG.

    draft_tokens: d_1..d_k (k >= 0); q: (k, V) the distributions they were drawn
    from; p: (k+1, V) the target's distributions at the same positions plus the
    bonus position; uniforms: (k+1,) in [0, 1): uniforms[i] decides d_{i+1},
    uniforms[k] draws the next token.
    Returns (n_accepted, next_token): the round commits d_1..d_n then next_token.
    """
    k = len(draft_tokens)
    if q.shape[0] != k or p.shape[0] != k + 1 or uniforms.shape[0] != k + 1:
        raise ValueError(f"verify needs q ({k}, V), p ({k + 1}, V), uniforms ({k + 1},) for {k} draft tokens; "
                         f"got q {tuple(q.shape)}, p {tuple(p.shape)}, uniforms {tuple(uniforms.shape)}")
    u_next = uniforms[k:k + 1]
    for i, d in enumerate(draft_tokens):
        if sampler == "always-accept":
            continue
        qd, pd = float(q[i, d]), float(p[i, d])
        if qd <= 0.0:
            raise ValueError(f"draft token {d} at position {i + 1} has q = 0: it cannot have been sampled "
                             "from q; the drafter must return the distribution it drew from")
        if float(uniforms[i]) < pd / qd:  # P(u < r) = min(1, r)
            continue
        resample_from = p[i] if sampler == "no-residual" else residual(p[i], q[i])
        return i, sample_rows(resample_from.unsqueeze(0), u_next)[0]
    return k, sample_rows(p[k].unsqueeze(0), u_next)[0]


def expected_tokens(a: float, k: int) -> float:
    """Tokens one round commits when each draft token is accepted independently with probability a:
    1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, c: float, k_max: int = 8, verify: "list[float] | None" = None) -> int:
    """The draft length with the most tokens per unit of time.

    a: per-token acceptance probability; c: one draft step's cost relative to
    one plain decode step (a target pass over one token). verify[k]: the cost of
    the target pass that checks k drafts (k + 1 tokens), in the same unit;
    default 1 for every k. On a GPU that pass costs about one step whatever k;
    on a CPU it grows with k (a small matrix-matrix product is slower than a
    matrix-vector one), which favours shorter drafts. A round of k drafts costs
    k*c + verify[k] and yields expected_tokens(a, k); k = 0 is plain decoding,
    chosen when speculation would not pay. Ties go to the smaller k.
    """
    v = [1.0] * (k_max + 1) if verify is None else verify
    return max(range(k_max + 1), key=lambda k: (expected_tokens(a, k) / (v[k] + k * c), -k))


class AdaptiveK:
    """k="auto": picks each round's k from running estimates of acceptance and of the step costs.

    Acceptance is the maximum-likelihood estimate under the model above: each
    accepted draft is a success, each rejection a failure (a round that accepts
    all k has no failure), with older rounds decayed so the estimate follows the
    text. Costs are decayed averages of the measured draft-step time and of the
    verify time of rounds that drafted k tokens, kept per k (the verify pass
    costs more for larger k on a CPU); a k not yet measured is taken to cost
    what its measured neighbours do (interpolated; below them, the smallest's
    cost; above them, the slope of the two largest continued, never downhill,
    or flat while only one k is measured), so it gets tried and measured.
    While plain decoding is chosen, one round in `probe_every` drafts a single
    token so the estimates stay fresh.
    Measured times make the choice of k depend on the machine, so a seeded run
    is reproducible only up to the k's chosen (the distribution is exact
    either way: each round's k depends only on earlier rounds). Pass
    `cost_ratio` (draft step / plain decode step, with verify costs taken as
    equal for every k) to fix the costs and make it deterministic:
    `speculate(..., k=AdaptiveK(cost_ratio=0.1))`.

    Token by token (confidence_stop=True, for a model draft; off by default): the k above
    only decides whether to speculate at all, and a speculating round may draft
    up to k_max tokens, stopping at the first that does not pay. Before proposing
    its j-th token the draft has its distribution there; its confidence (the
    largest probability, known before the token is drawn) maps to an acceptance
    probability through a running calibration (accepted / proposed per confidence
    bin, starting from the confidence itself). The chance that drafts 1..j are
    all accepted is the product of those, and it is the j-th draft's expected
    gain in tokens; its cost is one more draft step plus what the verify pass
    gains from j-1 to j drafts. It is proposed if its tokens per second are at
    least the rate measured so far. This is the trade-off of the formula above
    (with the same a at every position the gains sum to it), made per token: a
    confident draft runs on, an unsure one stops before the verify pass pays for
    a likely rejection. It stays exact because the decision uses only the draft's
    distribution, never the token drawn from it: a proposed token is still a
    draw from q. (Stopping on the drawn token's own probability would not be:
    it changes the law of the tokens proposed; the "sampled-confidence" sampler
    does that, as a negative control.)
    Why it is off by default: with SmolLM2-135M and its distilled draft on a 2-core
    CPU it does not pay. Paired with one k per round, prompt by prompt, greedy runs at
    0.97x (median of 24 pairs; a fixed price of 0.2 instead of the measured one: 0.96x),
    and T=0.7 at 0.87-0.90x, where the draft's largest probability says little about
    whether its sampled token is accepted (the calibration is nearly flat from 0.4 to
    0.9). On this CPU a verify pass over 1-3 tokens costs about the same, so proposing
    fewer tokens for as many committed saves little, and a draft that stops has still
    paid for the step that told it to (the README's benchmark section has the figures).
    """

    CONF_BINS = 10  # calibration bins over the draft's confidence [0, 1]
    CONF_DECAY = 0.98  # per observation in a bin: each bin follows its last ~50 drafts
    RATE_DECAY = 0.99  # per round, for the rate: about the last 100 rounds

    def __init__(self, k_max: int = 8, decay: float = 0.9, probe_every: int = 8, k_start: int = 2,
                 cost_ratio: float | None = None, confidence_stop: bool = False):
        if not (isinstance(k_max, int) and k_max >= 1):
            raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
        if cost_ratio is not None and not cost_ratio >= 0:
            raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio!r}")
        self.k_max, self.decay, self.probe_every, self.cost_ratio = k_max, decay, probe_every, cost_ratio
        self.k_start = min(k_start, k_max)
        self.confidence_stop = confidence_stop
        self.successes = self.failures = 0.0
        self.draft_step_s: float | None = None
        self.verify_s: dict[int, float] = {}  # k drafted in the round -> decayed mean verify seconds
        self._tokens: float | None = None  # decayed sums over all rounds of committed tokens ...
        self._seconds: float | None = None  # ... and of their seconds: see rate
        self.plain_rounds = 0
        # per confidence bin: decayed accepted / proposed drafts; the prior, two drafts at the bin's centre,
        # takes the draft's confidence at its word until its own record says otherwise
        self.bin_hits = [2.0 * (b + 0.5) / self.CONF_BINS for b in range(self.CONF_BINS)]
        self.bin_tries = [2.0] * self.CONF_BINS
        self._probing = False
        self._chance: dict[int, float] = {}  # row -> P(this round's drafts so far are all accepted)
        self._confs: dict[int, list[float]] = {}  # row -> the confidence of each draft proposed this round

    @property
    def rate(self) -> float | None:
        """Committed tokens per second over about the last 100 rounds (None before any)."""
        return self._tokens / self._seconds if self._seconds else None

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
            if len(top) < 2:
                return self.verify_s[lo]
            j0, j1 = top
            slope = max(0.0, (self.verify_s[j1] - self.verify_s[j0]) / (j1 - j0))
            return self.verify_s[j1] + slope * (k - j1)
        if lo is None:  # below the smallest: its cost (a shorter pass costs no more)
            return self.verify_s[hi]
        w = (k - lo) / (hi - lo)
        return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]

    def choose(self, token_by_token: bool = False) -> int:
        """This round's k; for a round drafted token by token (the drafter stops each draft by keep_going),
        k_max whenever speculating pays, for keep_going to cut short."""
        self._probing = False  # (the round's per-row chances and confidences were cleared by update)
        if self.successes + self.failures == 0:
            return self.k_start
        if self.cost_ratio is not None:
            k = best_k(self.acceptance, self.cost_ratio, self.k_max)
        elif self.draft_step_s is None or not self.verify_s:
            return self.k_start  # nothing measured yet
        else:
            unit = self.verify_cost(0)
            k = best_k(self.acceptance, self.draft_step_s / unit, self.k_max,
                       [self.verify_cost(j) / unit for j in range(self.k_max + 1)])
        if k == 0:
            self.plain_rounds += 1
            if self.plain_rounds % self.probe_every == 0:
                self._probing = True  # a probe drafts its one token whatever the confidence: it measures
                return 1
            return 0
        return self.k_max if token_by_token else k

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.CONF_BINS), 0), self.CONF_BINS - 1)

    def calibrated(self, confidence: float) -> float:
        """The acceptance probability of a draft proposed at this confidence, from the running calibration."""
        b = self._bin(confidence)
        return self.bin_hits[b] / self.bin_tries[b]

    def price(self, j: int) -> float | None:
        """The least chance of acceptance that pays for a (j+1)-th draft this round, or None while unmeasured:
        the rate so far times the draft's extra cost (a draft step, and the verify pass's growth from j to j+1)."""
        if self.cost_ratio is not None:  # fixed costs, in plain decode steps; the rate from the formula's best k
            a, c = self.acceptance, self.cost_ratio
            k = best_k(a, c, self.k_max)
            return expected_tokens(a, k) / (1 + k * c) * c
        if self.rate is None or self.draft_step_s is None or not self.verify_s:
            return None
        return self.rate * (self.draft_step_s + max(0.0, self.verify_cost(j + 1) - self.verify_cost(j)))

    def keep_going(self, row: int, j: int, confidence: float | None = None) -> bool:
        """Whether `row`'s draft proposes its (j+1)-th token this round (j = drafts already proposed),
        given its confidence there: the largest probability of the distribution it would draw from.
        With confidence None, asked before the draft step that would give it: whether even the most
        trusted confidence bin could make that token pay (if not, the step is not worth running)."""
        price = None if self._probing else self.price(j)
        chance = self._chance.get(row, 1.0)
        if confidence is None:
            return price is None or chance * max(h / t for h, t in zip(self.bin_hits, self.bin_tries)) >= price
        chance *= self.calibrated(confidence)
        if price is not None and chance < price:
            return False
        self._chance[row] = chance
        self._confs.setdefault(row, []).append(confidence)
        return True

    def update(self, drafted: list[int], accepted: list[int], draft_s: float, draft_steps: int, verify_s: float,
               rows: list[int] | None = None, committed: int | None = None) -> None:
        """One round's outcome: per sequence drafts and acceptances; wall times of drafting and verifying;
        rows: the sequences, in the same order (to calibrate the confidences keep_going saw); committed:
        the tokens the round committed (for the rate)."""
        d = self.decay
        self.successes = d * self.successes + sum(accepted)
        self.failures = d * self.failures + sum(n < k for n, k in zip(accepted, drafted))
        ema = lambda old, new: new if old is None else d * old + (1 - d) * new  # noqa: E731
        if draft_steps > 0:
            self.draft_step_s = ema(self.draft_step_s, draft_s / draft_steps)
        k = max(drafted, default=0)
        self.verify_s[k] = ema(self.verify_s.get(k), verify_s)
        if committed is not None:
            # the long-run rate (a marginal draft pays if it beats that, not the last few rounds' luck), as the
            # ratio of decayed sums: a decayed mean of per-round ratios runs high
            slow = lambda old, new: new if old is None else self.RATE_DECAY * old + new  # noqa: E731
            self._tokens = slow(self._tokens, float(committed))
            self._seconds = slow(self._seconds, draft_s + verify_s)
        # each draft up to the first rejection is an outcome at its confidence (later ones were never judged)
        for r, n, kk in zip(rows or [], accepted, drafted):
            for j, conf in enumerate(self._confs.get(r, [])[:min(n + 1, kk)]):
                b = self._bin(conf)
                self.bin_hits[b] = self.CONF_DECAY * self.bin_hits[b] + (j < n)
                self.bin_tries[b] = self.CONF_DECAY * self.bin_tries[b] + 1.0
        self._chance.clear()
        self._confs.clear()


# k="auto" carries its estimator from call to call: target -> {(draft, sampling settings, batch size): (draft
# reference, AdaptiveK)}. Weak on both sides, so it never keeps a model alive.
_AUTO_K: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def auto_k(target, draft, params: SamplingParams, batch_size: int) -> AdaptiveK:
    """The AdaptiveK that k="auto" uses for this target, draft, sampling settings and batch size.

    Acceptance depends on the pair and the sampling settings, the step costs on the
    pair, the batch size and the machine; none of them on the prompt. So one
    estimator serves every call with the same four, and a stream of requests pays
    for finding the right k once instead of at the start of every call. (The seed
    is not part of the key: it does not change the estimates.) Pass k=AdaptiveK()
    to speculate for an estimator of your own, e.g. a fresh one.
    """
    if isinstance(draft, str):
        ref, draft_key = (lambda d=draft: d), draft
    else:
        ref, draft_key = weakref.ref(draft), id(draft)
    key = (draft_key, params.temperature, params.top_k, params.top_p, batch_size)
    table = _AUTO_K.setdefault(target, {})
    entry = table.get(key)
    if entry is None or entry[0]() is not draft:  # new, or an id reused by another object
        entry = table[key] = (ref, AdaptiveK())
    return entry[1]


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------

@dataclass
class SpeculativeStats:
    rounds: int = 0  # batched verify passes (one target forward each)
    sequence_rounds: int = 0  # rounds summed over sequences (equals `rounds` for one prompt)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    committed: int = 0  # new tokens emitted (accepted + one per round, less any cut at a stop token)
    position_drafted: list[int] = field(default_factory=list)  # [j]: drafts proposed at draft position j+1
    position_accepted: list[int] = field(default_factory=list)  # [j]: of those, accepted
    draft_time_s: float = 0.0  # wall time spent drafting
    verify_time_s: float = 0.0  # wall time in the target's forward and the acceptance step
    k_chosen: list[int] = field(default_factory=list)  # each round's k (k="auto": chosen; token by token: drafted)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens that were accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per round, per sequence (the speedup's numerator)."""
        return self.committed / self.sequence_rounds if self.sequence_rounds else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position j+1: accepted / proposed (decays with j: a rejection ends the round)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @classmethod
    def combined(cls, stats: "list[SpeculativeStats]") -> "SpeculativeStats":
        """The stats of several runs as one: counts and times summed, per-position counts added, k's joined."""
        out = cls()
        for st in stats:
            for name in ("rounds", "sequence_rounds", "drafted", "accepted", "committed", "draft_time_s",
                         "verify_time_s"):
                setattr(out, name, getattr(out, name) + getattr(st, name))
            for mine, theirs in ((out.position_drafted, st.position_drafted),
                                 (out.position_accepted, st.position_accepted)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for j, v in enumerate(theirs):
                    mine[j] += v
            out.k_chosen += st.k_chosen
        return out

    def _count(self, n_drafted: int, n_accepted: int) -> None:
        while len(self.position_drafted) < n_drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for j in range(n_drafted):
            self.position_drafted[j] += 1
            self.position_accepted[j] += j < n_accepted
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.sequence_rounds += 1


@dataclass
class SpeculativeResult:
    tokens: list  # list[int] for one prompt, list[list[int]] for a batch: the new tokens only
    stats: SpeculativeStats
    # with keep_caches=True: the target's and the model drafter's CachedRows (cache, seq and pending per row)
    caches: tuple["CachedRows", "CachedRows | None"] | None = None


# ---------------------------------------------------------------------------
# one model's paged cache, one sequence per batch row
# ---------------------------------------------------------------------------

class CachedRows:
    """A model, its paged cache, and one cache sequence per batch row.

    Between rounds a row's cache holds its committed tokens except `pending`
    ones; at least the last committed token stays pending, because feeding it
    is what yields the next position's logits. Rows that share a prompt share
    its prefill: it runs once and the blocks are forked (copy-on-write).
    """

    def __init__(self, model, prompts: dict[int, list[int]], budgets: dict[int, int], block_size: int):
        self.model = model
        bs = block_size
        unique: dict[tuple, list[int]] = {}
        for row, p in prompts.items():
            unique.setdefault(tuple(p), []).append(row)
        # worst case: each row grows to prompt + budget tokens; shared full prompt blocks are counted once
        blocks = sum(-(-(len(p) - 1) // bs) for p in unique)
        blocks += sum(-(-(len(p) + budgets[r]) // bs) - (len(p) - 1) // bs for r, p in prompts.items())
        self.cache = model.new_cache(num_blocks=max(blocks, 1), block_size=bs)
        self.seq: dict[int, int] = {}
        self.pending: dict[int, list[int]] = {r: [p[-1]] for r, p in prompts.items()}
        self.fed: dict[int, list[int]] = {}  # row -> tokens fed after its pending ones this round
        parents = {p: self.cache.new_sequence() for p in unique if len(p) > 1}
        if parents:  # one prefill of prompt[:-1] per distinct prompt
            model.step(self.cache, list(parents.values()), [list(p[:-1]) for p in parents])
        for p, rows in unique.items():
            for r in rows:
                self.seq[r] = self.cache.fork(parents[p]) if p in parents else self.cache.new_sequence()
        for s in parents.values():
            self.cache.free(s)

    def feed(self, rows: list[int], tokens: list[list[int]], all_logits: bool = False,
             hidden: bool = False) -> torch.Tensor:
        """Append each row's pending tokens (first feed of a round only) and then tokens[j]; return the logits
        (or the hidden states: see Transformer.step)."""
        lists = []
        for r, t in zip(rows, tokens):
            lists.append(self.pending[r] + t)
            self.pending[r] = []
            self.fed.setdefault(r, []).extend(t)
        return self.model.step(self.cache, [self.seq[r] for r in rows], lists, all_logits=all_logits, hidden=hidden)

    def commit(self, row: int, new_tokens: list[int]) -> None:
        """The round committed new_tokens: keep the fed tokens that agree with them, roll back the rest."""
        fed = self.fed.pop(row, None)
        if fed is None:  # not fed this round: everything committed is still to be fed
            self.pending[row] += new_tokens
            return
        keep = 0
        while keep < min(len(fed), len(new_tokens) - 1) and fed[keep] == new_tokens[keep]:
            keep += 1
        s = self.seq[row]
        self.cache.truncate(s, self.cache.length(s) - len(fed) + keep)
        self.pending[row] = new_tokens[keep:]

    def free(self, row: int) -> None:
        self.cache.free(self.seq[row])


# ---------------------------------------------------------------------------
# drafters
# ---------------------------------------------------------------------------

def one_hot(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """(len(tokens), V) float64 rows, each 1 at its token: the q of a deterministic proposal."""
    q = torch.zeros(len(tokens), vocab_size, dtype=torch.float64)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


class Drafter:
    """What `speculate` asks of a drafter. Rows are indices into the prompt batch.

    start(prompts, budgets, params, block_size, vocab_size): a new run; prompts and budgets are dicts by row.
    propose(rows, ks, contexts, gens) -> (tokens, q): for each rows[j], up to ks[j] tokens and the
        (n_j, V) float64 distributions they were drawn from; contexts[row] is prompt + committed tokens;
        gens[row] is the row's generator (a drafter that samples must draw only from it).
    commit(row, tokens): the round committed these tokens to the row.
    finish(row, keep): the row is done; release it unless keep.
    A drafter with stops_early = True takes propose(..., keep_going=f) too: before its j-th token of a
    row (j = 0, 1, ...) it calls f(row, j, confidence) with the largest probability of the distribution
    it is about to draw from, and stops that row's draft when f says no (AdaptiveK(confidence_stop=True)
    uses this); before the step that computes that distribution it may ask f(row, j) whether the step
    is worth running.
    """

    stops_early = False

    def start(self, prompts, budgets, params, block_size, vocab_size) -> None:
        raise NotImplementedError

    def propose(self, rows, ks, contexts, gens):
        raise NotImplementedError

    def commit(self, row: int, tokens: list[int]) -> None:
        pass

    def finish(self, row: int, keep: bool = False) -> None:
        pass


class ModelDrafter(Drafter):
    """A smaller Transformer samples d_1..d_k autoregressively over its own paged cache.

    unprocessed_q=True is the "unprocessed-q" negative control: tokens are still
    sampled from the processed distribution, but the q reported to the
    acceptance step is the raw softmax (temperature 1, no top-k / top-p).
    sampled_confidence=True is the "sampled-confidence" one: keep_going is asked
    after the token is drawn, with that token's own probability, so which
    tokens get proposed depends on the draw (their law is no longer q).
    """

    stops_early = True

    def __init__(self, model, unprocessed_q: bool = False, sampled_confidence: bool = False):
        self.model = model
        self.unprocessed_q = unprocessed_q
        self.sampled_confidence = sampled_confidence
        self.rows: CachedRows | None = None
        self.steps = 0  # draft forward passes in the last propose()

    def start(self, prompts, budgets, params, block_size, vocab_size) -> None:
        self.params = params
        self.max_len = self.model.config.max_seq_len
        # a prompt longer than the draft's window never gets drafts: those rounds are plain target steps
        fits = {r: p for r, p in prompts.items() if len(p) <= self.max_len}
        self.rows = CachedRows(self.model, fits, budgets, block_size)

    def propose(self, rows, ks, contexts, gens, keep_going=None):
        tokens = {r: [] for r in rows}
        qs = {r: [] for r in rows}
        # the draft cache holds committed + k - 1 tokens once d_1..d_{k-1} are fed
        ks = {r: min(kk, self.max_len - len(contexts[r]) + 1) if r in self.rows.seq else 0 for r, kk in zip(rows, ks)}
        one_hot_q = self.params.greedy and not self.unprocessed_q  # q is one-hot on the argmax: not built per step
        self.steps = 0  # a row stopped by keep_going may have cost a step more than it drafted
        for j in range(max(ks.values(), default=0)):
            if keep_going is not None and j > 0:  # is the next draft step worth running at all?
                for r in rows:
                    if ks[r] > j and not keep_going(r, j):
                        ks[r] = j
            live = [r for r in rows if ks[r] > j]
            if not live:
                break
            self.steps += 1
            logits = self.rows.feed(live, [tokens[r][-1:] for r in live])  # j = 0 feeds only the pending tokens
            probs = None if one_hot_q else logits_to_probs(logits, self.params).double().cpu()  # (B, V)
            if keep_going is not None and not self.sampled_confidence:
                # the confidence comes from the distribution, before anything is drawn from it (greedy: the
                # draft's own softmax, since its processed q is one-hot)
                conf = (logits.float().softmax(-1) if one_hot_q else probs).max(-1).values.tolist()
                for r, c in zip(live, conf):
                    if not keep_going(r, j, c):
                        ks[r] = j  # this row's draft ends here: its j tokens so far are the proposal
                keep = [b for b, r in enumerate(live) if ks[r] > j]
                live = [live[b] for b in keep]
                logits = logits[keep]
                probs = None if probs is None else probs[keep]
            if one_hot_q:
                for r, d in zip(live, logits.argmax(-1).tolist()):
                    tokens[r].append(d)
                continue
            u = torch.stack([torch.rand((), generator=gens[r], dtype=torch.float64) for r in live]) if live else None
            reported = logits.float().softmax(-1).double().cpu() if self.unprocessed_q else probs
            for b, (r, d) in enumerate(zip(live, sample_rows(probs, u) if live else [])):
                if keep_going is not None and self.sampled_confidence and not keep_going(r, j, float(probs[b, d])):
                    ks[r] = j  # the negative control: the drawn token decided whether it is proposed
                    continue
                tokens[r].append(d)
                qs[r].append(reported[b])
        V = self.model.config.vocab_size
        if one_hot_q:
            return [tokens[r] for r in rows], [one_hot(tokens[r], V) for r in rows]
        return ([tokens[r] for r in rows],
                [torch.stack(qs[r]) if qs[r] else torch.zeros(0, V, dtype=torch.float64) for r in rows])

    def commit(self, row, tokens):
        if row in self.rows.seq:
            self.rows.commit(row, tokens)

    def finish(self, row, keep=False):
        if row in self.rows.seq and not keep:
            self.rows.free(row)


class PromptLookupDrafter(Drafter):
    """Model-free drafting: find the sequence's last n tokens earlier in its own context, propose what followed.

    Tries n = ngram down to min_ngram, most recent match first. The proposal is
    a deterministic function of the context, so q is one-hot on it and the
    exact rule still applies at any temperature (accept d with probability
    p(d); on rejection sample p with d removed). No match: no draft, and the
    round is a plain target step.
    """

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= ngram):
            raise ValueError(f"PromptLookupDrafter needs integers 1 <= min_ngram <= ngram, got ngram={ngram!r}, "
                             f"min_ngram={min_ngram!r}")
        self.ngram, self.min_ngram = ngram, min_ngram

    def start(self, prompts, budgets, params, block_size, vocab_size) -> None:
        self.vocab_size = vocab_size

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the context's tail."""
        L = len(context)
        for n in range(min(self.ngram, L - 1), self.min_ngram - 1, -1):
            tail = context[L - n:]
            for s in range(L - n - 1, -1, -1):  # starts before the tail itself, so a continuation exists
                if context[s:s + n] == tail:
                    return context[s + n:s + n + k]
        return []

    def propose(self, rows, ks, contexts, gens):
        tokens = [self.lookup(contexts[r], kk) if kk > 0 else [] for r, kk in zip(rows, ks)]
        return tokens, [one_hot(t, self.vocab_size) for t in tokens]


def check_compatible(target, draft) -> None:
    """Draft and target must share the vocabulary and the tokenizer: the rule compares token ids."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft vocab_size={dv} differs from target vocab_size={tv}: speculative decoding compares "
                         "token ids, so draft and target must share one tokenizer and vocabulary")
    tt, dt = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if (tt is None) != (dt is None):
        which = "target" if dt is None else "draft"
        raise ValueError(f"only the {which} has a tokenizer, so they cannot be checked to match; load both from "
                         "checkpoints with the same tokenizer (or attach the same tokenizer to both)")
    if tt is not None and tt is not dt:
        ft, fd = getattr(tt, "fingerprint", None), getattr(dt, "fingerprint", None)
        if ft != fd:
            raise ValueError(f"draft and target tokenizers differ (fingerprints {fd!r} vs {ft!r}); "
                             "speculative decoding needs one shared tokenizer")


def make_drafter(target, draft, sampler: str) -> Drafter:
    """A Transformer, "prompt-lookup", or a Drafter -> a Drafter."""
    if isinstance(draft, str):
        if draft != "prompt-lookup":
            raise ValueError(f"unknown drafter {draft!r}; pass a Transformer, 'prompt-lookup' or a Drafter")
        return PromptLookupDrafter()
    if isinstance(draft, ModelDrafter):
        draft = draft.model
    elif isinstance(draft, Drafter):
        return draft
    if not (hasattr(draft, "step") and hasattr(draft, "config")):
        raise ValueError(f"draft must be a Transformer, 'prompt-lookup' or a Drafter, got {type(draft).__name__}")
    check_compatible(target, draft)
    return ModelDrafter(draft, unprocessed_q=sampler == "unprocessed-q", sampled_confidence=sampler == "sampled-confidence")


# ---------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------

# Positions of one row that greedy_verify scores in one lm_head product. On a CPU (fp32, MKL),
# F.linear over 1-3 rows costs about one matrix-vector product and from 4 rows about twice that
# (SmolLM2-135M's 49152 x 576 head, measured: 4.2 / 4.4 / 4.9 / 8.9 ms for 1 / 2 / 3 / 4 rows).
GREEDY_HEAD_CHUNK = 3


@torch.inference_mode()
def greedy_verify(target, h: torch.Tensor, n_pending: list[int], drafts: list[list[int]],
                  chunk: int = GREEDY_HEAD_CHUNK) -> tuple[list[int], list[int]]:
    """Greedy acceptance for a batch from the target's hidden states h (B, T, dim): per row, the
    number of drafts equal to the target's argmax before the first that is not, and the token
    that follows (the correction, or the bonus after a full acceptance).

    Position j's logits matter only if drafts 1..j were all accepted, so the lm_head (the largest
    matrix) runs over `chunk` positions at a time, for the rows still in play, and stops early."""
    n_acc, nxt = [0] * len(drafts), [None] * len(drafts)
    for j0 in range(0, max(map(len, drafts)) + 1, chunk):
        rows = [b for b, d in enumerate(drafts) if nxt[b] is None and j0 <= len(d)]
        if not rows:
            break
        where = [(b, j) for b in rows for j in range(j0, min(j0 + chunk, len(drafts[b]) + 1))]
        picks = target.logits(h[[b for b, _ in where], [n_pending[b] - 1 + j for b, j in where]]).argmax(-1).tolist()
        for (b, j), t in zip(where, picks):
            if nxt[b] is not None:  # an earlier position of this row already decided it
                continue
            if j < len(drafts[b]) and drafts[b][j] == t:
                n_acc[b] += 1
            else:
                nxt[b] = t
    return n_acc, nxt


@torch.inference_mode()
def speculate(target, draft, prompts, k: "int | str | AdaptiveK" = 4, max_new_tokens: int = 64, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None, seed: int | None = None, stop_tokens=None,
              on_tokens: OnTokens | None = None, block_size: int = 16, sampler: str = "exact",
              keep_caches: bool = False) -> SpeculativeResult:
    """Generate with `target`, `draft` proposing up to k tokens per round; exact in distribution.

    draft: a Transformer sharing the target's tokenizer, "prompt-lookup", or a Drafter.
    k: draft tokens per round; "auto" picks k each round from the running acceptance
      estimate and the measured step costs (AdaptiveK; 0 = plain decoding when
      speculation would not pay), carried over from earlier calls with the same
      draft, sampling settings and batch size (see auto_k); or an AdaptiveK of your own.
    prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
    on_tokens, block_size: as in minispec.generate.generate (sequence i of a
    batch samples from the generator seeded seed + i; temperature 0 gives
    generate's greedy tokens).
    sampler: "exact", or a deliberately broken variant for negative controls:
      "no-residual" (resample from p after a rejection), "always-accept",
      "unprocessed-q" (acceptance uses a model draft's raw softmax, not the q it sampled from).
    keep_caches: keep every sequence in both caches and return them in result.caches (for tests).
    """
    params = SamplingParams(temperature, top_k, top_p, seed)
    check_max_new_tokens(max_new_tokens)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    if k != "auto" and not isinstance(k, AdaptiveK) and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"k (draft tokens per round) must be an integer >= 1 or 'auto', got {k!r}")
    stats = SpeculativeStats()
    drafter = make_drafter(target, draft, sampler)
    batch, single = normalize_prompts(target, prompts)
    if k == "auto":
        adaptive = auto_k(target, draft, params, len(batch)) if sampler == "exact" else AdaptiveK()
    else:
        adaptive = k if isinstance(k, AdaptiveK) else None
    stops = resolve_stop_tokens(target, stop_tokens)
    out: list[list[int]] = [[] for _ in batch]
    max_len = target.config.max_seq_len
    budgets = {i: min(max_new_tokens, max_len - len(p)) for i, p in enumerate(batch)}  # prompt + output <= max_seq_len
    active = [i for i in range(len(batch)) if budgets[i] > 0]
    if not active:
        return SpeculativeResult(out[0] if single else out, stats)
    live_prompts = {i: batch[i] for i in active}
    live_budgets = {i: budgets[i] for i in active}
    tgt = CachedRows(target, live_prompts, live_budgets, block_size)
    drafter.start(live_prompts, live_budgets, params, block_size, target.config.vocab_size)
    gens = make_generators(seed, len(batch))
    contexts = {i: list(batch[i]) for i in active}  # prompt + committed tokens (what prompt lookup searches)
    per_token = adaptive is not None and adaptive.confidence_stop and drafter.stops_early
    while active:
        kr = adaptive.choose(token_by_token=per_token) if adaptive else k
        # a round commits at most k + 1 tokens: never draft past a row's remaining budget
        ks = [min(kr, budgets[i] - len(out[i]) - 1) for i in active]
        t0 = time.perf_counter()
        if per_token:
            drafts, qs = drafter.propose(active, ks, contexts, gens, keep_going=adaptive.keep_going)
        else:
            drafts, qs = drafter.propose(active, ks, contexts, gens)
        t1 = time.perf_counter()
        for b, i in enumerate(active):
            if len(drafts[b]) > max(ks[b], 0):
                raise RuntimeError(f"{type(drafter).__name__} proposed {len(drafts[b])} tokens for sequence {i}, "
                                   f"more than the {ks[b]} asked for")
        n_pending = [len(tgt.pending[i]) for i in active]
        # ONE target pass verifies the whole batch: hidden states (B, T, dim); p_1..p_{k+1} of row b come
        # from those at its last pending token and at each of its drafts
        h = tgt.feed(active, drafts, hidden=True)
        # greedy: p is one-hot on the target's argmax, and the exact rule reduces to "accept the drafts while
        # they equal it, then emit it" (verify() gives the same); greedy_verify skips the lm_head at
        # positions after the first rejection.
        greedy = params.greedy and sampler == "exact"
        if greedy:
            greedy_n, greedy_next = greedy_verify(target, h, n_pending, drafts)
        else:
            b_idx = [b for b, d in enumerate(drafts) for _ in range(len(d) + 1)]
            t_idx = [n_pending[b] - 1 + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
            probs = logits_to_probs(target.logits(h[b_idx, t_idx]).float(), params).double().cpu()  # (sum k_b + 1, V)
        still, start, n_accepted, round_committed = [], 0, [], 0
        for b, i in enumerate(active):
            kb = len(drafts[b])
            if greedy:
                n, nxt = greedy_n[b], greedy_next[b]
            else:
                p, start = probs[start:start + kb + 1], start + kb + 1
                uniforms = torch.rand(kb + 1, generator=gens[i], dtype=torch.float64)
                n, nxt = verify(drafts[b], qs[b], p, uniforms, sampler)
            stats._count(kb, n)
            n_accepted.append(n)
            new = drafts[b][:n] + [nxt]
            for j, t in enumerate(new):  # a stop token inside the accepted run ends the sequence there
                if t in stops:
                    new = new[:j + 1]
                    break
            out[i] += new
            contexts[i] += new
            stats.committed += len(new)
            round_committed += len(new)
            if on_tokens is not None:
                on_tokens(i, new)
            tgt.commit(i, new)
            drafter.commit(i, new)
            if new[-1] in stops or len(out[i]) >= budgets[i]:
                if not keep_caches:
                    tgt.free(i)
                drafter.finish(i, keep=keep_caches)
            else:
                still.append(i)
        t2 = time.perf_counter()
        longest = max(map(len, drafts))
        if adaptive is not None:
            adaptive.update([len(d) for d in drafts], n_accepted, t1 - t0, drafter.steps if per_token else longest,
                            t2 - t1, rows=active, committed=round_committed)
        active = still
        stats.rounds += 1
        stats.k_chosen.append(longest if per_token else kr)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
    caches = (tgt, getattr(drafter, "rows", None)) if keep_caches else None
    return SpeculativeResult(out[0] if single else out, stats, caches)
