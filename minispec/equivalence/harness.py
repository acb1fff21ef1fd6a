"""The harness: draw speculative and target-only samples, score them under the target, and report.

`run_equivalence` is the entry point (validated once, in `_check_inputs`); the
speculative samples and the target-only calibration run go through the same
`target_pit` pass and the same tests (minispec.equivalence.stats).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..adaptive import AdaptiveK
from ..drafters import PROMPT_LOOKUP
from ..errors import check_compatible, normalize_prompts
from ..sampling import SamplingParams, logits_to_probs
from ..speculative import get_sampler
from .stats import ORDERS, RunStats, analyse, pit

MIN_SAMPLES = 10
# The defaults (Hugging Face's top_k=50, a common temperature) give each deliberately broken
# sampler a real effect: temperature != 1 and top-k make the processed q differ from the raw
# softmax ("unprocessed-q"; top-k more than doubles its effect on SmolLM2), and any draft that is
# not the target is rejected often enough for "no-residual" and "always-accept" to show.
DEFAULTS = dict(samples=2000, tokens=8, k=4, temperature=0.7, top_k=50, top_p=None, seed=0, sampler="exact",
                alpha=0.01, bins=20, batch_size=256)
TESTS = ("ks", "chi2")  # per position and pooled; Holm corrects over all of them


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
        get_sampler(sampler)
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
