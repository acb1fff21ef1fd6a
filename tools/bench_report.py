"""The benchmark's reports: the spec benchmark's markdown table and plot, the core and drafts tables."""

from __future__ import annotations

import json
import sys

from bench_cost import phase_baselines, predicted_speedup, run_tokens

from minispec import speculative

SPEC_HEADER = ["| engine | batch | k | T | tokens/s | vs minispec target-only | cost model | cost model, measured "
               "tokens/round | acceptance | tokens/round measured | predicted (runs) | draft + verify per round, "
               "target steps |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def fmt(v, f: str) -> str:
    """`v` formatted with `f`, or "" for None."""
    return "" if v is None else format(v, f)


def spec_row(res: dict, base: dict, r: dict) -> str:
    """One row of the spec table: its rate, its speed-up, the cost model's, acceptance and the round's time."""
    ref = base.get((r.get("phase", 1), r["batch"], r["temperature"]))
    k = r["k"] if not str(r["k"]).startswith("auto") or r.get("mean_k") is None else f"{r['k']} ({r['mean_k']:.1f})"
    model, model_m = predicted_speedup(res, r), predicted_speedup(res, r, measured_tokens=True)
    return (f"| {r['engine']} | {r['batch']} | {'' if k is None else k} | {r['temperature']} | {r['tok_s']:.1f} | "
            f"{fmt(r['tok_s'] / ref if ref else None, '.2f')}x | {fmt(model, '.2f')}{'x' if model else ''} | "
            f"{fmt(model_m, '.2f')}{'x' if model_m else ''} | "
            f"{fmt(r.get('acceptance'), '.2f')} | "
            f"{fmt(r.get('measured_per_round'), '.2f')} | {fmt((run_tokens(res, r) or (None,))[0], '.2f')} | "
            + (f"{r['draft_s_round'] * 1e3 / res['target_step_ms']:.2f} + "
               f"{r['verify_s_round'] * 1e3 / res['target_step_ms']:.2f} |" if "draft_s_round" in r else " |"))


def spec_footer(res: dict) -> str:
    """The paragraph under the spec table: the step costs, how the cost model reads them, memory, the settings."""
    vc = ", ".join(f"{k}: {v:.2f} ({res['trunk_cost'][k]:.2f})" for k, v in sorted(res["verify_cost"].items()))
    prefill = res.get("prefill_cost", {})
    target_mb, both_mb = res["rss_mb_target"], res["rss_mb_target_and_draft"]
    return (f"Draft step {res['draft_step_ms']:.1f} ms vs target step {res['target_step_ms']:.1f} ms "
            f"(ratio {res['draft_cost_ratio']:.3f}; over 2 new tokens {res.get('draft2_cost_ratio', 0):.3f}). The "
            f"target's verify pass over k drafts, in target steps (in brackets: without the lm_head): {vc}. Cost "
            f"model: the speculative row's time per token against target-only's measured beside it; tokens per "
            f"round from the acceptance runs of the largest k (1 + S_1 + ... + S_k, S_j the share "
            f"of rounds accepting their first j drafts), over that verify pass (greedy: the trunk, then the lm_head "
            f"over each chunk of {speculative.GREEDY_HEAD_CHUNK} positions the round reaches) plus k draft steps, "
            f"the first over 2 new tokens after "
            f"a round that accepted all, and each call's prefill (target {prefill.get('target', 0):.1f}, "
            f"draft {prefill.get('draft', 0):.1f} target steps). Resident memory (peak / after the run): target "
            f"alone {target_mb['peak']:.0f} / {target_mb['after_run']:.0f} MB, target + draft "
            f"{both_mb['peak']:.0f} / {both_mb['after_run']:.0f} MB. "
            f"{res['new_tokens']} new tokens x "
            f"{res['prompts']} prompts, medians of {res['repeats']}, {res['threads']} threads, "
            f"{res.get('target_dtype', 'float32')} target, "
            f"{res.get('draft_dtype', 'float32')} draft; the step costs are medians of {res.get('cost_samples', 1)} "
            f"probes taken between the prompts, interleaved with the rows.")


def spec_table(res: dict) -> str:
    """The spec benchmark as a markdown table, each row against target-only in its own phase, and its footer."""
    res = {**res, **{key: {int(k): v for k, v in res[key].items()} for key in ("verify_cost", "trunk_cost")}}  # JSON
    base = phase_baselines(res)
    return "\n".join([*SPEC_HEADER, *(spec_row(res, base, r) for r in res["rows"]), "", spec_footer(res)])


def ratio(base: dict, r: dict) -> float:
    """A row's rate over target-only's in its phase."""
    return r["tok_s"] / base[r.get("phase", 1), r["batch"], r["temperature"]]


def plot_spec(res: dict, path: str) -> None:
    """The batch-1 speed-ups of the first phase against k, with the other engines as lines, to a PNG."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend to set
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to get the plot", file=sys.stderr)
        return
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    base = phase_baselines(res)
    first = [r for r in res["rows"] if r["batch"] == 1 and r.get("phase", 1) == 1]
    for temp, style in ((0.0, "o-"), (0.7, "s--")):
        spec = [r for r in first if r["engine"] == "minispec speculate" and r["temperature"] == temp]
        pts = [(r["k"], ratio(base, r)) for r in spec if isinstance(r["k"], int)]
        if pts:
            ax.plot(*zip(*pts), style, label=f"minispec speculate, T={temp}")
        for r in (r for r in spec if r["k"] == "auto"):
            ax.axhline(ratio(base, r), color="C2" if temp == 0 else "C3", lw=0.8, ls=":",
                       label=f"speculate k=auto, T={temp}")
    ax.axhline(1.0, color="k", lw=1, label="minispec target-only")
    colors = iter(["tab:gray", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold"])
    for r in res["rows"]:
        if r["batch"] == 1 and not r["engine"].startswith("minispec"):
            ax.axhline(ratio(base, r), color=next(colors), lw=1, ls="-" if r["temperature"] == 0 else "--",
                       label=f"{r['engine']}, T={r['temperature']}")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("tokens/s over minispec target-only (same phase)")
    ax.set_title(f"{res.get('target', 'target')} drafted by {res.get('draft', 'draft')}, 2 CPU threads, batch 1",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_core(res: dict, as_json: bool) -> None:
    """The core benchmark: minispec and transformers generate, and the memory-bandwidth floor."""
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        print(f"| engine | tokens/s (median of {res['repeats']}) |\n|---|---|")
        print(f"| minispec generate | {res['minispec_tok_s']:.1f} |")
        print(f"| transformers generate | {res['transformers_tok_s']:.1f} |")
        print(f"\nminispec / transformers: {res['ratio_vs_transformers']:.2f}x; "
              f"bandwidth floor {res['floor_tok_s']:.1f} tok/s ({res['weight_bytes'] / 1e6:.0f} MB at "
              f"{res['read_bandwidth_GB_s']:.1f} GB/s), minispec at {res['fraction_of_floor']:.2f} of it; "
              f"same greedy tokens: {res['same_tokens']}")


def drafts_table(res: dict) -> str:
    """The drafts benchmark's rows: draft, dtype, tokens/s, speed-up, acceptance, tokens per round, step ratio."""
    return "\n".join(f"| {r['draft']} | {r.get('dtype', 'fp32')} | {r['tok_s']:.2f} | " + (
        f"{r['speedup']:.2f}x | {r['acceptance']:.3f} | {r['per_round']:.2f} | {r['draft_step_ratio']:.3f} |"
        if "speedup" in r else "1.00x | | | |") for r in res["rows"])
