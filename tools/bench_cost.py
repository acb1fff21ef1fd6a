"""The spec benchmark's cost model: a speculative row's speed-up predicted from step costs measured alone.

The step costs come from `CostProbe`, in target decode steps; a round is priced by
minispec.adaptive.round_cost (the formula k="auto" uses too), its tokens come from the acceptance runs
of the contender's largest fixed k. `predicted_speedup` sets the prediction against target-only's
measured rate (docs/benchmarks.md, "Cost model").
"""

from __future__ import annotations

import statistics
import time

from minispec import speculative
from minispec.adaptive import round_cost


def step_time(model, prompt: list[int], n_tokens: int = 1, repeats: int = 30, hidden: bool = False) -> float:
    """Median seconds of one step over the last n_tokens of `prompt` (the rest in the cache, rolled back each time):
    a decode step (n_tokens 1) or the target's verify pass over n_tokens - 1 drafts."""
    cache = model.new_cache(num_blocks=64, block_size=16)
    s = cache.new_sequence()
    model.step(cache, [s], [prompt])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.step(cache, [s], [prompt[-n_tokens:]], all_logits=n_tokens > 1, hidden=hidden)
        times.append(time.perf_counter() - t)
        cache.truncate(s, len(prompt))
    return statistics.median(times)


class CostProbe:
    """The cost model's inputs, each measured alone, in target decode steps: the draft's step; the target's
    verify pass over k drafts (k + 1 tokens), which on a CPU costs more than one step and grows with k
    (sampled rounds score all k+1 positions at once; greedy rounds run the trunk over k+1 tokens and then
    the lm_head over GREEDY_HEAD_CHUNK positions at a time, as long as the drafts agree: greedy_verify); each
    call's prefill.

    Called after every prompt of the minispec phase, interleaved with its contenders: a decode step, which
    streams the weights, moves with the machine's load far more than the verify passes do, so costs timed
    apart from the rows they predict put the model off (docs/benchmarks.md, "Cost model"). Each cost is a
    probe's median of 3, divided by the same probe's step.
    """

    def __init__(self, target, draft, prompts: list[list[int]], k_max: int):
        self.target, self.draft, self.prompts, self.k_max = target, draft, prompts, k_max
        self.samples: list[dict] = []

    def __call__(self, u: int, repeats: int = 3) -> None:
        """One probe on the bench prompt after the u-th (cycling)."""
        target, draft, ids = self.target, self.draft, self.prompts[u % len(self.prompts)]
        ks = range(self.k_max + 1)
        c = {("verify", kk): step_time(target, ids, kk + 1, repeats) for kk in ks}
        c |= {("trunk", kk): step_time(target, ids, kk + 1, repeats, hidden=True) for kk in ks}
        c |= {"draft": step_time(draft, ids, 1, repeats),
              "draft2": step_time(draft, ids, 2, repeats),  # a round's first draft step after a full acceptance
              # each call prefills the prompt: the target's (target-only pays it too) and the draft's
              ("prefill", "target"): step_time(target, ids, len(ids), 1),
              ("prefill", "draft"): step_time(draft, ids, len(ids), 1)}
        self.samples.append(c)

    def cost(self, key) -> float:
        """The median over the probes of `key`'s seconds in target steps."""
        return statistics.median(c[key] / c["verify", 0] for c in self.samples)

    def summary(self) -> dict:
        """The spec benchmark's cost fields, in the order its JSON has them."""
        ks = range(self.k_max + 1)
        return {"target_step_ms": statistics.median(c["verify", 0] for c in self.samples) * 1e3,
                "draft_step_ms": statistics.median(c["draft"] for c in self.samples) * 1e3,
                "draft_cost_ratio": self.cost("draft"), "draft2_cost_ratio": self.cost("draft2"),
                "cost_samples": len(self.samples),
                "prefill_cost": {name: self.cost(("prefill", name)) for name in ("target", "draft")},  # target steps
                "verify_cost": {kk: self.cost(("verify", kk)) for kk in ks},  # k drafts -> x one target step
                "trunk_cost": {kk: self.cost(("trunk", kk)) for kk in ks}}  # the same without the lm_head


def longest_survival(res: dict, row: dict) -> list[float]:
    """The survival curve of the same contender's largest fixed k ([] if none)."""
    longest = max((r for r in res["rows"] if r["engine"] == row["engine"] and r["batch"] == row["batch"]
                   and r["temperature"] == row["temperature"] and isinstance(r["k"], int) and r.get("survival")),
                  key=lambda r: r["k"], default=None)
    return [] if longest is None else longest["survival"]


def run_tokens(res: dict, row: dict) -> tuple[float, float] | None:
    """(tokens per round, P(all k accepted)) at the row's k from the acceptance runs of the same contender's
    largest fixed k (its survival curve S_j = P(the first j drafts all accepted)): 1 + S_1 + ... + S_k. Acceptance
    comes in runs (code the draft knows, then a stretch it does not), which a single per-token rate misses."""
    k = row["k"]
    s = longest_survival(res, row)
    if not isinstance(k, int) or k > len(s):
        return None
    s = s[:k]
    return 1.0 + sum(s), s[-1]


def phase_baselines(res: dict) -> dict:
    """(phase, batch, temperature) -> minispec target-only's rate: each row is read against the target-only
    measured in its own phase (interleaved with it)."""
    return {(r.get("phase", 1), r["batch"], r["temperature"]): r["tok_s"] for r in res["rows"]
            if r["engine"] == "minispec target-only"}


def greedy_verify_cost(res: dict, row: dict, k: int) -> float:
    """A greedy round's verify pass over k drafts, in target steps: the trunk over k + 1 tokens, then the lm_head
    over each chunk of GREEDY_HEAD_CHUNK positions the round reaches (greedy_verify), weighted by how often the
    drafts before the chunk were all accepted."""
    chunk = speculative.GREEDY_HEAD_CHUNK
    surv = [1.0, *longest_survival(res, row)]  # surv[j]: P(the first j drafts all accepted)
    return res["trunk_cost"][k] + sum(surv[j0] * head_cost(res, min(chunk, k + 1 - j0))
                                      for j0 in range(0, k + 1, chunk))


def head_cost(res: dict, n: int) -> float:
    """The lm_head over n positions, in target steps: the verify pass over n - 1 drafts less its trunk."""
    return res["verify_cost"][n - 1] - res["trunk_cost"][n - 1]


def predicted_speedup(res: dict, row: dict, measured_tokens: bool = False) -> float | None:
    """The cost model's speedup over target-only for a batch-1 row with a fixed k: target-only's measured
    time per token in the row's phase over the model's time per token for the row, built from costs measured
    alone (the probes, in target steps of target_step_ms): a call of n new tokens costs both prefills and
    then n / (tokens per round) rounds, each priced by minispec.adaptive.round_cost: the verify pass over k
    drafts, k - 1 draft steps, and the first draft step, which feeds 2 new tokens after a round that accepted
    every draft (the last draft and the bonus token).
    The baseline is the row measured beside the others, not a probe: a decode step streams the weights and
    moves with the neighbours' memory traffic far more than the compute-bound verify passes do, so probes of
    the step between the prompts put the model under the rows' speed-ups (docs/benchmarks.md, "Cost model").
    Tokens per round from the acceptance runs of the contender's largest k (run_tokens); measured_tokens: the
    row's own measured tokens per round instead, so that only the cost side is modelled."""
    k, a = row.get("k"), row.get("acceptance")
    runs = run_tokens(res, row)
    if (row["batch"] != 1 or not isinstance(k, int) or a is None or k not in res["verify_cost"] or runs is None
            or "prompt-lookup" in row["engine"]):  # prompt lookup drafts fewer than k where its match is short
        return None
    tokens, all_accepted = (row["measured_per_round"], runs[1]) if measured_tokens else runs
    c, c2 = res["draft_cost_ratio"], res.get("draft2_cost_ratio", res["draft_cost_ratio"])
    verify = greedy_verify_cost(res, row, k) if row["temperature"] == 0 else res["verify_cost"][k]
    cost = round_cost(k, c, verify, c_first=c2, all_accepted=all_accepted)
    n, pre = res["new_tokens"], res.get("prefill_cost", {"target": 0.0, "draft": 0.0})  # a call: prefill, then rounds
    base = phase_baselines(res).get((row.get("phase", 1), row["batch"], row["temperature"]))
    if not base:
        return None
    seconds_per_token = (pre["target"] + pre["draft"] + n / tokens * cost) / n * res["target_step_ms"] / 1e3
    return 1.0 / base / seconds_per_token
