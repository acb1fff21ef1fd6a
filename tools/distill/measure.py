"""Stage 4, measure: how well a draft serves its target on held-out prompts (never generated from).

- replay: the draft's argmax at every position of the target's greedy text
  (teacher forcing); greedy speculation's rounds follow from it exactly
  (`simulate_greedy_rounds`), so acceptance and tokens per round at any k
  come from one forward pass;
- speculate: the library's `Transformer.speculate` on the same prompts, which
  must see the same rounds and produce the target's greedy text;
- the cost of one draft decode step relative to one target step (median of
  many, interleaved, same thread count), and the speed-up these predict.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from minispec import Transformer

from .common import log


def heldout_prompts(prompts: list[dict], n: int) -> list[dict]:
    """n held-out prompts: a fixed spread over the templated ones plus every hand-written one, up to n."""
    held = [p for p in prompts if p["split"] == "heldout"]
    free = [p for p in held if p["kind"] == "freeform"]
    templ = [p for p in held if p["kind"] != "freeform"]
    n_free = min(len(free), n // 4)
    step = max(1, len(templ) // max(1, n - n_free))
    return templ[::step][: n - n_free] + free[:n_free]


def simulate_greedy_rounds(agree: list[bool], k: int, budget: int | None = None) -> tuple[int, int, int]:
    """Greedy speculation replayed on a teacher-forced agreement sequence: (rounds, drafted, accepted).

    With greedy decoding the committed text is the target's greedy text, and
    the draft's proposal at each position is its argmax given that text; a
    proposal after a rejection is never made. So agree[j] (draft argmax ==
    target token at response position j) determines every round exactly: a
    round at j accepts the run of agreements (at most k), then the target adds
    one token (the correction or the bonus). As in `speculate`, a round never
    drafts past the token budget (`budget` = max_new_tokens, default len(agree)):
    with r tokens left it drafts min(k, r - 1), the target adding the last.
    """
    j = rounds = drafted = accepted = 0
    n = len(agree)
    budget = n if budget is None else budget
    while j < n:
        kk = max(0, min(k, budget - j - 1))
        m = 0
        while m < kk and j + m < n and agree[j + m]:
            m += 1
        rounds += 1
        drafted += kk
        accepted += m
        j += m + 1
    return rounds, drafted, accepted


@torch.inference_mode()
def step_cost(model: Transformer, context: int = 128, n: int = 40, warmup: int = 5) -> list[float]:
    """Seconds of one single-token decode step (batch 1) at `context` tokens, n repeats."""
    context = min(context, model.config.max_seq_len - 1)
    cache = model.new_cache(num_blocks=-(-(context + 2) // 16) + 1, block_size=16)
    seq = cache.new_sequence()
    model.step(cache, [seq], [[int(t) for t in torch.randint(3, min(1000, model.config.vocab_size), (context,))]])
    times = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        model.step(cache, [seq], [[3]])
        dt = time.perf_counter() - t0
        cache.truncate(seq, context)
        if i >= warmup:
            times.append(dt)
    return times


def replay(draft: Transformer, chosen: list[dict], ids: list[list[int]], greedy: list[list[int]], k: int,
           max_new_tokens: int) -> dict:
    """Teacher-forced replay: the draft's argmax at every response position of the target's greedy text."""
    rounds = drafted = accepted = agree_n = total = 0
    by_kind: dict[str, list[int]] = {}
    for p, prompt, resp in zip(chosen, ids, greedy):
        if not resp:
            continue
        pred = draft(torch.tensor([prompt + resp[:-1]]))[0, len(prompt) - 1:].argmax(-1).tolist()
        agree = [a == b for a, b in zip(pred, resp)]
        r, d, a = simulate_greedy_rounds(agree, k, max_new_tokens)
        rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
        agree_n, total = agree_n + sum(agree), total + len(agree)
        kb = by_kind.setdefault(p["kind"], [0, 0])
        kb[0] += sum(agree)
        kb[1] += len(agree)
    return {"top1_agreement": agree_n / max(total, 1), "acceptance_rate": accepted / max(drafted, 1),
            "tokens_per_round": total / max(rounds, 1), "tokens": total, "rounds": rounds,
            "drafted": drafted, "accepted": accepted,
            "agreement_by_kind": {kk: round(v[0] / max(v[1], 1), 4) for kk, v in by_kind.items()}}


def speculate_run(target: Transformer, draft: Transformer, ids: list[list[int]], greedy: list[list[int]], k: int,
                  max_new_tokens: int) -> dict:
    """The library's greedy speculation on the same prompts: its counts, and whether it gave the greedy text."""
    t0 = time.time()
    out = target.speculate(draft, ids, k=k, max_new_tokens=max_new_tokens, temperature=0.0)
    st = out.stats
    return {"acceptance_rate": st.acceptance_rate, "mean_accepted": st.mean_accepted,
            "sequence_rounds": st.sequence_rounds, "committed": st.committed,
            "drafted": st.drafted, "accepted": st.accepted,
            "position_acceptance": [round(a, 4) for a in st.position_acceptance],
            "matches_greedy": out.tokens == greedy, "seconds": round(time.time() - t0, 1)}


def step_costs(target: Transformer, draft: Transformer, draft_path: str, repeats: int) -> dict:
    """Median decode-step times of the target and the draft (float32 and as stored, bf16), interleaved so
    all three see the same machine load, and the draft/target ratios."""
    tt, td, td16 = [], [], []
    draft16 = Transformer.from_pretrained(draft_path)  # as stored (bf16)
    for _ in range(4):
        tt += step_cost(target, n=repeats // 4)
        td += step_cost(draft, n=repeats // 4)
        td16 += step_cost(draft16, n=repeats // 4)
    med = lambda v: float(np.median(v))  # noqa: E731
    return {"step_ms": {"target_fp32": round(1e3 * med(tt), 2), "draft_fp32": round(1e3 * med(td), 2),
                        "draft_bf16": round(1e3 * med(td16), 2)},
            "cost_ratio_fp32": round(med(td) / med(tt), 4), "cost_ratio_bf16": round(med(td16) / med(tt), 4)}


def measure_stage(target_path: str, draft_path: str, prompts: list[dict], n_prompts: int = 32, k: int = 4,
                  max_new_tokens: int = 128, use_speculate: bool = True, cost_repeats: int = 40) -> dict:
    """Greedy acceptance on held-out prompts and the draft/target decode-step cost ratio."""
    target = Transformer.from_pretrained(target_path)
    draft = Transformer.from_pretrained(draft_path, dtype=torch.float32)
    chosen = heldout_prompts(prompts, n_prompts)
    ids = [target.tokenizer.encode_chat(p["messages"]) for p in chosen]
    res: dict = {"prompts": len(ids), "k": k, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads()}
    t0 = time.time()
    greedy = target.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
    res["target_generate_s"] = round(time.time() - t0, 1)
    res["replay"] = replay(draft, chosen, ids, greedy, k, max_new_tokens)
    log(f"replay: {res['replay']}")
    if use_speculate:
        res["speculate"] = speculate_run(target, draft, ids, greedy, k, max_new_tokens)
        log(f"speculate: {res['speculate']}")
    res.update(step_costs(target, draft, draft_path, cost_repeats))
    # the cost model: (1 - a^(k+1)) / (1 - a) tokens per round (measured: the replay's) for k*c + 1 target steps
    res["modelled_speedup"] = round(res["replay"]["tokens_per_round"] / (k * res["cost_ratio_fp32"] + 1), 3)
    log(f"step cost: {res['step_ms']}, ratio fp32 {res['cost_ratio_fp32']}, bf16 {res['cost_ratio_bf16']}")
    return res
