"""Checks on the bench pairs that are not speed: `tools/bench.py greedy` and `tools/bench.py distance`.

- greedy_check: greedy speculate equals greedy generate, token for token, on every bench prompt
  (exactness, with the target in the dtype asked for);
- dtype_distance: how far a low-precision target's next-token distributions and greedy tokens move
  from the fp32 target's (docs/benchmarks.md, "bf16 target").
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from bench_plan import draft_form

from minispec import Transformer
from minispec.cli import load_draft
from minispec.errors import InputError, unsampleable


def greedy_check(target_dir: str, draft_dir: str, texts, new_tokens: int = 128, threads: int = 2,
                 target_dtype: str = "float32") -> dict:
    """Greedy speculate (k="auto", the draft as loaded by default) against greedy generate on every bench
    prompt, the target in `target_dtype`: exactness says the tokens are the same, token for token."""
    torch.set_num_threads(threads)
    target = Transformer.from_pretrained(target_dir, dtype=getattr(torch, target_dtype))
    draft = load_draft(draft_dir, None, target)
    rows = []
    for i, text in enumerate(texts):
        ids = target.tokenizer.encode_chat([{"role": "user", "content": text}])
        ref = target.generate(ids, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
        res = target.speculate(draft, ids, k="auto", max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
        first = next((j for j, (a, b) in enumerate(zip(ref, res.tokens)) if a != b), None)
        rows.append({"prompt": i, "equal": res.tokens == ref, "first_difference": first,
                     "acceptance": res.stats.acceptance_rate})
        print(f"prompt {i + 1}/{len(texts)}: {'equal' if rows[-1]['equal'] else f'differs at {first}'}",
              file=sys.stderr, flush=True)
    return {"rows": rows, "equal": all(r["equal"] for r in rows), "new_tokens": new_tokens,
            "draft_form": draft_form(draft), "target_dtype": target_dtype}


def greedy_line(res: dict) -> str:
    """greedy_check's verdict in one line."""
    return (f"greedy speculate == generate on {sum(r['equal'] for r in res['rows'])} of {len(res['rows'])} prompts "
            f"({res['new_tokens']} new tokens, a {res['target_dtype']} target, the {res['draft_form']} draft)")


def all_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """fp32 logits predicting ids[start:], from one pass over `ids` in a fresh cache."""
    cache = model.new_cache(num_blocks=(len(ids) + 15) // 16 + 1, block_size=16)
    s = cache.new_sequence()
    return model.step(cache, [s], [ids], all_logits=True)[0, start - 1:-1].float()


def finite_logits(model, ids: list[int], start: int, name: str) -> torch.Tensor:
    """all_logits, refused with an InputError naming `name` when some row is NaN or +inf (or all -inf): a KL
    over such a row would read as 0 (a NaN p is not > 0) or as nothing at all, not as the broken model it is."""
    logits = all_logits(model, ids, start)
    what = unsampleable(logits)
    if what is not None:
        raise InputError(f"{name}: its logits are {what} at some position of the fp32 model's continuation; no "
                         "distance can be measured: the checkpoint's weights or config are likely corrupt")
    return logits


def prompt_distance(ref, low, ids: list[int], new_tokens: int, names: tuple[str, str] = ("the reference", "the other")
                    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Over ref's greedy continuation of `ids`: per position KL(p_ref || p_low) and whether the argmaxes agree;
    how many greedy tokens `low` generates before it first leaves ref's; the continuation's length. `names`:
    ref's and low's, for the error that refuses non-finite logits."""
    cont = ref.generate(ids, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
    mine = low.generate(ids, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
    with torch.inference_mode():
        lp, lq = (torch.log_softmax(finite_logits(m, ids + cont, len(ids), name), -1)
                  for m, name in zip((ref, low), names))
    p = lp.exp()
    kl = torch.where(p > 0, p * (lp - lq), torch.zeros(())).sum(-1)
    same = next((j for j, (a, b) in enumerate(zip(cont, mine)) if a != b), len(cont))
    return kl, lp.argmax(-1) == lq.argmax(-1), same, len(cont)


def dtype_distance(target_dir: str, texts, dtype: str = "bfloat16", new_tokens: int = 128, threads: int = 2,
                   other: str | None = None) -> dict:
    """How far the target in `dtype` (or the checkpoint `other` as it loads, e.g. a kept quantization) moves
    from the fp32 target: over the fp32 model's own greedy continuation of each prompt, per position
    KL(p_fp32 || p_other) and whether the two argmaxes agree; and how many greedy tokens the other model
    generates before it first leaves the fp32 model's."""
    torch.set_num_threads(threads)
    ref = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    low = Transformer.from_pretrained(other) if other else Transformer.from_pretrained(target_dir,
                                                                                       dtype=getattr(torch, dtype))
    names = (f"{target_dir} in float32", other or f"{target_dir} in {dtype}")
    dtype = Path(other).name if other else dtype
    kls, agree, rows = [], [], []
    for i, text in enumerate(texts):
        ids = ref.tokenizer.encode_chat([{"role": "user", "content": text}])
        kl, match, same, n = prompt_distance(ref, low, ids, new_tokens, names)
        kls += kl.tolist()
        agree += match.tolist()
        rows.append({"prompt": i, "kl_mean": kl.mean().item(), "argmax_agreement": match.float().mean().item(),
                     "greedy_same_prefix": same})
        print(f"prompt {i + 1}/{len(texts)}: KL {rows[-1]['kl_mean']:.2e}, argmax agreement "
              f"{rows[-1]['argmax_agreement']:.3f}, same greedy tokens {same}/{n}", file=sys.stderr, flush=True)
    return {"dtype": dtype, "rows": rows, "new_tokens": new_tokens, "kl_mean": statistics.fmean(kls),
            "kl_median": statistics.median(kls), "kl_max": max(kls), "argmax_agreement": statistics.fmean(agree)}


def distance_line(res: dict) -> str:
    """dtype_distance's summary in one line."""
    return (f"{res['dtype']} against float32 over {len(res['rows'])} prompts x {res['new_tokens']} tokens: KL mean "
            f"{res['kl_mean']:.2e}, median {res['kl_median']:.2e}, max {res['kl_max']:.2e}; argmax agreement "
            f"{res['argmax_agreement']:.4f}")
