"""Benchmarks, measured side by side in one run (the machines are shared and noisy: compare ratios, quote medians).

    python tools/bench.py core     # minispec greedy generate vs transformers' LlamaForCausalLM.generate,
                                   # random weights of SmolLM2-135M's shape, fp32, 2 threads
    python tools/bench.py spec     # SmolLM2-135M-Instruct and its draft: minispec target-only, speculate
                                   # (greedy and T=0.7, k = 1..8 and auto, prompt lookup), transformers generate
                                   # and assisted generation with the same draft, batch sizes 1/4/16;
                                   # a markdown table, a PNG plot, predicted vs measured tokens per round,
                                   # peak memory of target + draft beside target alone
    python tools/bench.py greedy --pair coder   # not speed: greedy speculate equals generate on every bench prompt
    python tools/bench.py drafts --pair coder --ks 4 [--draft SUBSET_DIR]   # the pair's small model in fp32
                                   # fp16 and int4 (and another draft, e.g. with a subset head): acceptance, draft
                                   # step cost, speed-up at a fixed k

The memory-bandwidth floor is the fp32 weight bytes read per decode step over the
measured read bandwidth of this machine (a reduction over a 512 MiB tensor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minispec import ModelConfig, Transformer
from minispec.cli import load_draft
from minispec.checkpoint import minispec_to_hf_name

WARM_TOKENS = 8  # new tokens of each contender's warm-up run
SMOLLM2_SHAPE = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                     max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True, bos_id=1, eos_id=2)


def hf_twin(model: Transformer):
    """transformers' LlamaForCausalLM with exactly `model`'s weights (the reference implementation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = model.config
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_seq_len,
        tie_word_embeddings=c.tie_embeddings, attention_bias=c.qkv_bias, bos_token_id=c.bos_id, eos_token_id=c.eos_id,
        pad_token_id=c.eos_id))
    hf.load_state_dict({minispec_to_hf_name(k): v for k, v in model.state_dict().items()}, strict=False)
    if c.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second read by a reduction over a large tensor (a decode step only reads its weights)."""
    src = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def timed(*fns, repeats: int) -> list[tuple[float, object]]:
    """Median seconds and last result of each fn, the runs interleaved (a, b, a, b, ...) so that
    a change in the machine's load during the run hits every contender alike."""
    times, outs = [[] for _ in fns], [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t)
    return [(statistics.median(ts), out) for ts, out in zip(times, outs)]


def bench_core(new_tokens: int = 128, repeats: int = 3, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SMOLLM2_SHAPE))
    hf = hf_twin(model)
    prompt = torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (16,), generator=torch.Generator().manual_seed(1)).tolist()

    def run_minispec():
        return model.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()

    run_minispec(), run_hf()  # warm up both
    (t_ms, out_ms), (t_hf, out_hf) = timed(run_minispec, run_hf, repeats=repeats)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = read_bandwidth()
    floor = bw / weight_bytes
    res = {
        "new_tokens": new_tokens, "threads": threads, "repeats": repeats,
        "minispec_tok_s": new_tokens / t_ms, "transformers_tok_s": new_tokens / t_hf,
        "ratio_vs_transformers": t_hf / t_ms, "weight_bytes": weight_bytes, "read_bandwidth_GB_s": bw / 1e9,
        "floor_tok_s": floor, "fraction_of_floor": new_tokens / t_ms / floor,
        "same_tokens": out_ms == out_hf,
    }
    return res


# ---------------------------------------------------------------------------
# speculative decoding on the real checkpoint
# ---------------------------------------------------------------------------

BENCH_PROMPTS = [  # chat prompts never used to train the draft (tools/distill_prompts.py makes those)
    "Explain in a few sentences why the sky looks blue during the day.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three practical tips for learning a new programming language?",
    "Describe how a bicycle gear system works to a ten-year-old.",
]


# coding and chat prompts for the Qwen2.5-Coder pair; no test uses them
CODER_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search over a sorted list in Python and explain its time complexity.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Explain the difference between a process and a thread, with a short example in C.",
    "Write a JavaScript function that debounces another function.",
    "Refactor this loop into a list comprehension: result = []\nfor x in data:\n    if x % 2 == 0:\n        result.append(x * x)",
    "What is a Python decorator? Show one that times a function call.",
    "Write a bash script that counts the lines of every .py file in a directory tree and prints the total.",
]

# name -> (target dir, draft dir, prompts, the GGUF files both were converted from, or None)
DRAFT_SOURCES = {"smollm2": "weights/smollm2-135m-draft", "coder": "weights/qwen2.5-coder-0.5b-instruct"}
PAIRS = {
    "smollm2": ("weights/smollm2-135m-instruct", "weights/smollm2-135m-draft", BENCH_PROMPTS, None),
    "coder": ("weights/qwen2.5-coder-1.5b-instruct", "weights/qwen2.5-coder-0.5b-instruct-draft", CODER_PROMPTS,
              ("weights/gguf/qwen2.5-coder-1.5b-instruct.gguf", "weights/gguf/qwen2.5-coder-0.5b-instruct.gguf")),
}


def merge_stats(stats: list):
    """One SpeculativeStats for several runs (SpeculativeStats.combined), or None when none of them speculated."""
    from minispec.speculative import SpeculativeStats
    stats = [st for st in stats if st is not None]
    return SpeculativeStats.combined(stats) if stats else None


def process_memory_mb(code: str) -> tuple[float, float]:
    """(peak, final) resident memory in MB of a fresh Python process running `code` (Linux /proc)."""
    import subprocess
    script = code + ("\nst = dict(l.split(':', 1) for l in open('/proc/self/status'))"
                     "\nprint(int(st['VmHWM'].split()[0]), int(st['VmRSS'].split()[0]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    peak, final = out.stdout.strip().splitlines()[-1].split()
    return int(peak) / 1024, int(final) / 1024


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


def bench_spec(target_dir: str, draft_dir: str, new_tokens: int = 128, repeats: int = 3, threads: int = 2,
               ks=(1, 2, 3, 4, 5, 6, 7, 8), batch_sizes=(1, 4, 16), plot: str | None = None,
               quick: bool = False, texts=BENCH_PROMPTS, ggufs: tuple[str, str] | None = None,
               phases=("minispec", "llama.cpp", "transformers"), target_dtype: str = "float32") -> dict:
    """The spec benchmark in up to three phases, each re-measuring minispec target-only: minispec's own
    contenders (target-only, speculate over ks and auto, prompt lookup, batches), llama.cpp (coder pair),
    transformers (generate and assisted generation); `phases` names the ones to run. `target_dtype` is
    minispec's target (the speed-ups are against minispec target-only in it); the engines stay fp32."""
    from minispec.speculative import expected_tokens
    torch.set_num_threads(threads)
    target = Transformer.from_pretrained(target_dir, dtype=getattr(torch, target_dtype))
    draft = load_draft(draft_dir, None, target)  # as stored (the coder draft is fp16), a bf16 one in fp32
    messages = [[{"role": "user", "content": p}] for p in texts]
    prompts = [target.tokenizer.encode_chat(m) for m in messages]
    rows = []

    plan = []  # (row, parts): every contender is registered first, then all run interleaved
    phase = [1]  # contenders that cannot share the memory run in a later phase, beside target-only again

    def measure(name: str, parts, batch: int = 1, k=None, temperature: float = 0.0):
        """Register a contender as parts (one per bench prompt, or one for a batch), each part() -> (new token
        count, stats or None); run_plan() times them with the others'."""
        row = {"engine": name, "batch": batch, "k": k, "temperature": temperature}
        plan.append((row, parts))
        return row

    def run_plan(probe=None):
        """Warm every contender up (its first part), then time `repeats` rounds. In a round every prompt runs
        every contender back to back, in alternating order (a b c, then c b a, ...), so that a change in the
        machine's load hits every contender alike; a contender's rate in a round is its tokens over its time
        summed over the prompts. (Per-prompt pairs vary far less than whole passes over the prompts, which on
        this shared machine ranged up to 30% apart within one run.) probe(u): called after every prompt's
        contenders, to measure something in the same hour as them (the cost model's step costs)."""
        if not plan:  # a phase not asked for (--phases): its number stays taken
            phase[0] += 1
            return
        for _, parts in plan:  # first touch of the weights, the thread tuner: a few tokens each
            parts[0](WARM_TOKENS)
        rates: list[list[float]] = [[] for _ in plan]
        stats: list = [None] * len(plan)
        for r in range(repeats):
            print(f"round {r + 1}/{repeats}", file=sys.stderr, flush=True)
            tokens, secs, st = [0] * len(plan), [0.0] * len(plan), [[] for _ in plan]
            for u in range(max(len(parts) for _, parts in plan)):
                order = range(len(plan)) if (r + u) % 2 == 0 else range(len(plan) - 1, -1, -1)
                for i in order:
                    parts = plan[i][1]
                    if u < len(parts):
                        t = time.perf_counter()
                        n, s_, *own = parts[u]()  # an outside engine reports its own seconds (no process start-up)
                        secs[i] += own[0] if own else time.perf_counter() - t
                        tokens[i] += n
                        st[i].append(s_)
                if probe is not None:
                    probe(u)
            for i in range(len(plan)):
                rates[i].append(tokens[i] / secs[i])
                stats[i] = merge_stats(st[i])
        for (row, _), rs, st in zip(plan, rates, stats):
            row.update(tok_s=statistics.median(rs), runs=rs, phase=phase[0])
            if st is not None:
                a = st.acceptance_rate
                k = row["k"]
                row.update(acceptance=a, measured_per_round=st.mean_accepted,
                           predicted_per_round=(expected_tokens(a, k) if isinstance(k, int) else None),
                           mean_k=(statistics.mean(st.k_chosen) if st.k_chosen else None),
                           survival=st.position_acceptance,  # [j]: P(the first j + 1 drafts all accepted)
                           draft_s_round=st.draft_time_s / st.rounds, verify_s_round=st.verify_time_s / st.rounds)
            rows.append(row)
            print(f"  {row['engine']:<34} batch {row['batch']:>2}  k={str(row['k']):<5} T={row['temperature']:<4} "
                  f"{row['tok_s']:7.1f} tok/s" + (f"  acc {row['acceptance']:.2f}  {row['measured_per_round']:.2f}/round"
                                                  if st is not None else ""), file=sys.stderr, flush=True)
        plan.clear()
        phase[0] += 1

    def over_prompts(run_one):
        """One part per bench prompt."""
        return [lambda n=new_tokens, ids=ids, i=i: run_one(ids, i, n) for i, ids in enumerate(prompts)]

    def gen(temperature, model=target):
        return over_prompts(lambda ids, i, n: (len(model.generate(ids, max_new_tokens=n, temperature=temperature,
                                                                   seed=i, stop_tokens=[])), None))

    def spec(drafter, k, temperature, model=target):
        def one(ids, i, n):
            res = model.speculate(drafter, ids, k=k, max_new_tokens=n, temperature=temperature, seed=i,
                                  stop_tokens=[])
            return len(res.tokens), res.stats
        return over_prompts(one)

    base, base_t = {"tok_s": None}, {"tok_s": None}
    if "minispec" in phases:
        base = measure("minispec target-only", gen(0.0))
        base_t = measure("minispec target-only", gen(0.7), temperature=0.7)
        for k in (*ks, "auto"):
            measure("minispec speculate", spec(draft, k, 0.0), k=k)
        for k in ((2, 4, "auto") if quick else (*ks, "auto")):
            measure("minispec speculate", spec(draft, k, 0.7), k=k, temperature=0.7)
        for k in (4, "auto"):
            measure("minispec speculate prompt-lookup", spec("prompt-lookup", k, 0.0), k=k)
        if target_dtype != "float32":  # the fp32 target beside it, interleaved: the dtype's own ratio
            ref32 = Transformer.from_pretrained(target_dir, dtype=torch.float32)
            measure("minispec target-only (float32 target)", gen(0.0, ref32))
            measure("minispec speculate (float32 target)", spec(draft, "auto", 0.0, ref32), k="auto")

    # The cost model's inputs, each measured alone, in target decode steps: the draft's step; the target's
    # verify pass over k drafts (k + 1 tokens), which on a CPU costs more than one step and grows with k
    # (sampled rounds score all k+1 positions at once; greedy rounds run the trunk over k+1 tokens and then
    # the lm_head over GREEDY_HEAD_CHUNK positions at a time, as long as the drafts agree: greedy_verify); each
    # call's prefill. Sampled after every prompt of the minispec phase, interleaved with its contenders: on
    # this shared machine a decode step, which streams the weights, ran anywhere from 240 to 420 ms within
    # an hour while the verify passes moved less (2026-12-02), so costs timed apart from the rows they
    # predict put the model 15-20% off. Each is a probe's median of 3, divided by the same probe's step.
    cost_samples: list[dict] = []

    def cost_probe(u: int, repeats: int = 3) -> None:
        ids = prompts[u % len(prompts)]
        c = {("verify", kk): step_time(target, ids, kk + 1, repeats) for kk in range(max(ks) + 1)}
        c |= {("trunk", kk): step_time(target, ids, kk + 1, repeats, hidden=True) for kk in range(max(ks) + 1)}
        c |= {"draft": step_time(draft, ids, 1, repeats),
              "draft2": step_time(draft, ids, 2, repeats),  # a round's first draft step after a full acceptance
              # each call prefills the prompt: the target's (target-only pays it too) and the draft's
              ("prefill", "target"): step_time(target, ids, len(ids), 1),
              ("prefill", "draft"): step_time(draft, ids, len(ids), 1)}
        cost_samples.append(c)

    for bsz in batch_sizes if "minispec" in phases else ():
        if bsz == 1:
            continue
        batch = [prompts[i % len(prompts)] for i in range(bsz)]

        def gen_b(n=new_tokens, batch=batch):
            out = target.generate(batch, max_new_tokens=n, temperature=0.0, stop_tokens=[])
            return sum(map(len, out)), None

        def spec_b(n=new_tokens, batch=batch):
            res = target.speculate(draft, batch, k="auto", max_new_tokens=n, temperature=0.0, stop_tokens=[])
            return sum(map(len, res.tokens)), res.stats
        measure("minispec target-only", [gen_b], batch=bsz)
        measure("minispec speculate", [spec_b], batch=bsz, k="auto")

    run_plan(cost_probe)
    if not cost_samples:  # no minispec phase: the costs measured once, here
        cost_probe(0, 15)
    t_target = statistics.median(c["verify", 0] for c in cost_samples)
    cost = lambda key: statistics.median(c[key] / c["verify", 0] for c in cost_samples)  # noqa: E731

    if "llama.cpp" in phases and ggufs is not None:  # its own phase: its copies of the weights fill the page cache too
        bin_dir = llama_cpp_bin()
        if bin_dir is None:
            print("llama.cpp is not built (python tools/llama_cpp.py): its rows are skipped", file=sys.stderr)
        else:
            chat = [target.tokenizer.apply_chat_template(m) for m in messages]
            measure("minispec target-only", gen(0.0))
            measure("minispec speculate", spec(draft, "auto", 0.0), k="auto")
            for label, (tg, dg) in (("F32", tuple(f32_gguf(bin_dir, g) for g in ggufs)), ("shipped", ggufs)):
                for temperature in (0.0,):  # the llama.cpp goal is greedy (T=0.7 rows: add 0.7 here)
                    measure(f"llama.cpp completion ({label})",
                            llama_parts(bin_dir, chat, new_tokens, threads, temperature, tg), temperature=temperature)
                    measure(f"llama.cpp speculative ({label})",
                            llama_parts(bin_dir, chat, new_tokens, threads, temperature, tg, dg), k="llama",
                            temperature=temperature)

            run_plan()

    if "transformers" in phases:  # its own phase: transformers' copies of both models do not fit in memory beside the rest
        from transformers import AutoModelForCausalLM
        if ggufs is not None:  # loaded by transformers from the same GGUF files minispec converted
            load = lambda g: AutoModelForCausalLM.from_pretrained(str(Path(g).parent), gguf_file=Path(g).name,  # noqa: E731
                                                                  dtype=torch.float32).eval()
            hf_target, hf_draft = load(ggufs[0]), load(ggufs[1])
        else:
            hf_target = AutoModelForCausalLM.from_pretrained(_exported(target_dir), dtype=torch.float32).eval()
            hf_draft = AutoModelForCausalLM.from_pretrained(_exported(draft_dir), dtype=torch.float32).eval()
        measure("minispec target-only", gen(0.0))
        measure("minispec target-only", gen(0.7), temperature=0.7)
        measure("minispec speculate", spec(draft, "auto", 0.0), k="auto")
        measure("minispec speculate", spec(draft, "auto", 0.7), k="auto", temperature=0.7)

        def hf_gen(assistant, temperature):
            def one(ids, i, n):
                torch.manual_seed(i)
                kw = dict(do_sample=temperature > 0, max_new_tokens=n, min_new_tokens=n,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
                if temperature > 0:
                    kw.update(temperature=temperature, top_k=None, top_p=None)
                if assistant is not None:
                    kw["assistant_model"] = assistant
                with torch.inference_mode():
                    out = hf_target.generate(torch.tensor([ids]), **kw)
                return out.shape[1] - len(ids), None
            return over_prompts(one)
        measure("transformers generate", hf_gen(None, 0.0))
        measure("transformers assisted generation", hf_gen(hf_draft, 0.0), k="hf")
        measure("transformers assisted generation", hf_gen(hf_draft, 0.7), k="hf", temperature=0.7)
        run_plan()
        del hf_target, hf_draft

    load = (f"import torch; torch.set_num_threads({threads}); from minispec import Transformer; "
            f"t = Transformer.from_pretrained({target_dir!r}, dtype=torch.{target_dtype}); ids = list(range(1, 40))\n")
    mem_target = process_memory_mb(load + f"t.generate(ids, max_new_tokens={new_tokens}, stop_tokens=[])")
    mem_both = process_memory_mb(load + f"from minispec.cli import load_draft; d = load_draft({draft_dir!r}, None, t)\n"
                                 f"t.speculate(d, ids, k=4, max_new_tokens={new_tokens}, stop_tokens=[])")
    res = {"target": Path(target_dir).name, "draft": Path(draft_dir).name, "rows": rows, "new_tokens": new_tokens, "repeats": repeats, "threads": threads, "prompts": len(prompts),
           "target_step_ms": t_target * 1e3, "draft_step_ms": statistics.median(c["draft"] for c in cost_samples) * 1e3,
           "draft_cost_ratio": cost("draft"), "draft2_cost_ratio": cost("draft2"), "cost_samples": len(cost_samples),
           "prefill_cost": {name: cost(("prefill", name)) for name in ("target", "draft")},  # in target steps
           "verify_cost": {kk: cost(("verify", kk)) for kk in range(max(ks) + 1)},  # k drafts -> x one target step
           "trunk_cost": {kk: cost(("trunk", kk)) for kk in range(max(ks) + 1)},  # the same without the lm_head
           "rss_mb_target": {"peak": mem_target[0], "after_run": mem_target[1]},
           "rss_mb_target_and_draft": {"peak": mem_both[0], "after_run": mem_both[1]},
           "draft_dtype": draft_form(draft), "target_dtype": target_dtype, "baseline_tok_s": base["tok_s"], "baseline_t07_tok_s": base_t["tok_s"]}
    if plot:
        plot_spec(res, plot)
    return res


def bench_drafts(target_dir: str, options: list[tuple[str, str, str]], texts, new_tokens: int = 128,
                 k: int = 4, repeats: int = 1, threads: int = 2) -> dict:
    """Draft options side by side against one fp32 target: each (label, checkpoint, form: a dtype name or "int4",
    as load_draft takes it) drafts greedily
    at a fixed k on the same prompts, interleaved with target-only per prompt (the order alternating);
    per option: acceptance, tokens per round, its decode step over the target's, end-to-end tokens/s."""
    torch.set_num_threads(threads)
    target = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    drafts = [load_draft(d, None, target, form) for _, d, form in options]
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]

    runs = [lambda ids, n=new_tokens: (len(target.generate(ids, max_new_tokens=n, stop_tokens=[])), None)]
    runs += [lambda ids, n=new_tokens, d=d: (lambda r: (len(r.tokens), r.stats))(
        target.speculate(d, ids, k=k, max_new_tokens=n, stop_tokens=[])) for d in drafts]
    for run in runs:  # warm up: first touch of the weights, the thread tuner
        run(prompts[0], WARM_TOKENS)
    secs, toks, stats = [[0.0] * len(runs) for _ in range(repeats)], [0] * len(runs), [[] for _ in runs]
    for r in range(repeats):
        for u, ids in enumerate(prompts):
            order = range(len(runs)) if (r + u) % 2 == 0 else range(len(runs) - 1, -1, -1)
            for i in order:
                t = time.perf_counter()
                n, st = runs[i](ids)
                secs[r][i] += time.perf_counter() - t
                toks[i] += n
                stats[i].append(st)
            print(f"prompt {u + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    t_target = step_time(target, prompts[0], repeats=15) * 1e3
    rate = lambda i: statistics.median(toks[i] / repeats / secs[r][i] for r in range(repeats))  # noqa: E731
    rows = [{"draft": "target-only", "tok_s": rate(0)}]
    for i, (label, d, dt) in enumerate(options, start=1):
        st = merge_stats(stats[i])
        rows.append({"draft": label, "dtype": dt, "tok_s": rate(i),
                     "speedup": rate(i) / rate(0), "acceptance": st.acceptance_rate,
                     "per_round": st.mean_accepted, "draft_step_ratio": step_time(drafts[i - 1], prompts[0], repeats=15) * 1e3 / t_target})
    return {"rows": rows, "k": k, "new_tokens": new_tokens, "prompts": len(prompts), "threads": threads,
            "target_step_ms": t_target}


def draft_form(draft: Transformer) -> str:
    """How a draft computes: "int4" (its products) or its dtype's name."""
    return "int4" if draft.config.int4 else str(draft.dtype).removeprefix("torch.")


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


def dtype_distance(target_dir: str, texts, dtype: str = "bfloat16", new_tokens: int = 128, threads: int = 2) -> dict:
    """How far the target in `dtype` moves from the fp32 target: over the fp32 model's own greedy continuation
    of each prompt, per position KL(p_fp32 || p_dtype) and whether the two argmaxes agree; and how many greedy
    tokens the `dtype` model generates before it first leaves the fp32 model's."""
    torch.set_num_threads(threads)
    ref = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    low = Transformer.from_pretrained(target_dir, dtype=getattr(torch, dtype))

    def logits(model, ids: list[int], start: int) -> torch.Tensor:
        cache = model.new_cache(num_blocks=(len(ids) + 15) // 16 + 1, block_size=16)
        s = cache.new_sequence()
        return model.step(cache, [s], [ids], all_logits=True)[0, start - 1:-1].float()

    kls, agree, rows = [], [], []
    for i, text in enumerate(texts):
        ids = ref.tokenizer.encode_chat([{"role": "user", "content": text}])
        cont = ref.generate(ids, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
        mine = low.generate(ids, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
        with torch.inference_mode():
            lp, lq = (torch.log_softmax(logits(m, ids + cont, len(ids)), -1) for m in (ref, low))
        p = lp.exp()
        kl = torch.where(p > 0, p * (lp - lq), torch.zeros(())).sum(-1)
        match = lp.argmax(-1) == lq.argmax(-1)
        kls += kl.tolist()
        agree += match.tolist()
        same = next((j for j, (a, b) in enumerate(zip(cont, mine)) if a != b), len(cont))
        rows.append({"prompt": i, "kl_mean": kl.mean().item(), "argmax_agreement": match.float().mean().item(),
                     "greedy_same_prefix": same})
        print(f"prompt {i + 1}/{len(texts)}: KL {rows[-1]['kl_mean']:.2e}, argmax agreement "
              f"{rows[-1]['argmax_agreement']:.3f}, same greedy tokens {same}/{len(cont)}", file=sys.stderr, flush=True)
    return {"dtype": dtype, "rows": rows, "new_tokens": new_tokens, "kl_mean": statistics.fmean(kls),
            "kl_median": statistics.median(kls), "kl_max": max(kls), "argmax_agreement": statistics.fmean(agree)}


def llama_cpp_bin() -> Path | None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp import bin_dir
    return bin_dir()


def f32_gguf(bin_dir: Path, gguf: str) -> str:
    """The GGUF requantized to F32 by llama.cpp's own tool (made once, beside its build): every weight
    dequantized, so llama.cpp computes with exactly the fp32 weights minispec converted."""
    out = bin_dir.parent.parent / "gguf-f32" / (Path(gguf).stem + "-f32.gguf")
    if not out.is_file():
        import subprocess
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", gguf, str(tmp), "F32"], check=True,
                       capture_output=True)
        tmp.replace(out)
    return str(out)


def llama_parts(bin_dir: Path, chats: list[str], new_tokens: int, threads: int, temperature: float, target: str,
                draft: str | None = None):
    """One part per prompt: llama.cpp's plain decoding (llama-completion) or, with a draft, its speculative
    decoding (llama-speculative, its default draft settings); the prompt is the chat-rendered text. Returns
    (tokens, None, seconds) with seconds as llama.cpp reports them: prompt processing plus generation,
    not the process start or the model load."""
    import re
    import subprocess
    import tempfile

    def one(text: str, i: int, n: int):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        common = ["-m", target, "-f", f.name, "-n", str(n), "--ignore-eos", "-t", str(threads),
                  "--temp", str(temperature), "-s", str(i), "-c", "4096"]
        if draft is None:  # (llama-speculative has no --no-warmup; its timings exclude the warm-up anyway)
            cmd = [str(bin_dir / "llama-completion"), *common, "-no-cnv", "--no-warmup"]
        else:
            cmd = [str(bin_dir / "llama-speculative"), *common, "-md", draft, "-td", str(threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        Path(f.name).unlink()
        log = out.stdout + out.stderr
        if out.returncode:
            raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {log[-500:]}")
        if draft is None:
            ms = [float(m) for m in re.findall(r"eval time =\s*([\d.]+) ms", log)[-2:]]  # prompt eval, then eval
            n = int(re.findall(r"eval time =\s*[\d.]+ ms /\s*(\d+) runs", log)[-1])
            return n + 1, None, sum(ms) / 1e3  # the first token comes out of the prompt pass
        enc = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
        dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        return int(dec.group(1)), None, enc + float(dec.group(2))
    return [lambda n=new_tokens, text=text, i=i: one(text, i, n) for i, text in enumerate(chats)]


def _exported(src: str) -> str:
    """A transformers copy of a minispec checkpoint (tools/export_hf.py) in a temporary directory."""
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from export_hf import export
    dst = Path(tempfile.mkdtemp(prefix="minispec-bench-")) / Path(src).name
    export(src, dst, progress=False)
    return str(dst)


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


def longest_survival(res: dict, row: dict) -> list[float]:
    """The survival curve of the same contender's largest fixed k ([] if none)."""
    longest = max((r for r in res["rows"] if r["engine"] == row["engine"] and r["batch"] == row["batch"]
                   and r["temperature"] == row["temperature"] and isinstance(r["k"], int) and r.get("survival")),
                  key=lambda r: r["k"], default=None)
    return [] if longest is None else longest["survival"]


def predicted_speedup(res: dict, row: dict, measured_tokens: bool = False) -> float | None:
    """The cost model's speedup over target-only for a batch-1 row with a fixed k: target-only's measured
    time per token in the row's phase over the model's time per token for the row, built from costs measured
    alone (the probes, in target steps of target_step_ms): a call of n new tokens costs both prefills and
    then n / (tokens per round) rounds, each the verify pass over k drafts, k - 1 draft steps, and the
    first draft step, which feeds 2 new tokens after a round that accepted every draft (the last draft and
    the bonus token).
    The baseline is the row measured beside the others, not a probe: a decode step streams the weights, and
    here its time moved by 20% within a minute with the neighbours' memory traffic while the compute-bound
    verify passes moved by 5% (2026-12-02): probes of the step between the prompts put the model 6-12% under
    the rows' speed-ups, the baseline's own time 0-7%.
    Tokens per round from the acceptance runs of the contender's largest k (run_tokens); measured_tokens: the
    row's own measured tokens per round instead, so that only the cost side is modelled."""
    from minispec.speculative import GREEDY_HEAD_CHUNK
    k, a = row.get("k"), row.get("acceptance")
    runs = run_tokens(res, row)
    if (row["batch"] != 1 or not isinstance(k, int) or a is None or k not in res["verify_cost"] or runs is None
            or "prompt-lookup" in row["engine"]):  # prompt lookup drafts fewer than k where its match is short
        return None
    tokens, all_accepted = (row["measured_per_round"], runs[1]) if measured_tokens else runs
    c, c2 = res["draft_cost_ratio"], res.get("draft2_cost_ratio", res["draft_cost_ratio"])
    if row["temperature"] == 0:  # the trunk, then the lm_head over each chunk of positions reached (greedy_verify)
        surv = [1.0, *longest_survival(res, row)]  # surv[j]: P(the first j drafts all accepted)
        head = lambda n: res["verify_cost"][n - 1] - res["trunk_cost"][n - 1]  # noqa: E731  (the head over n rows)
        verify = res["trunk_cost"][k] + sum(surv[j0] * head(min(GREEDY_HEAD_CHUNK, k + 1 - j0))
                                            for j0 in range(0, k + 1, GREEDY_HEAD_CHUNK))
    else:
        verify = res["verify_cost"][k]
    round_cost = verify + (k - 1) * c + all_accepted * c2 + (1 - all_accepted) * c
    n, pre = res["new_tokens"], res.get("prefill_cost", {"target": 0.0, "draft": 0.0})  # a call: prefill, then rounds
    base = phase_baselines(res).get((row.get("phase", 1), row["batch"], row["temperature"]))
    if not base:
        return None
    seconds_per_token = (pre["target"] + pre["draft"] + n / tokens * round_cost) / n * res["target_step_ms"] / 1e3
    return 1.0 / base / seconds_per_token


def phase_baselines(res: dict) -> dict:
    """(phase, batch, temperature) -> minispec target-only's rate: each row is read against the target-only
    measured in its own phase (interleaved with it)."""
    return {(r.get("phase", 1), r["batch"], r["temperature"]): r["tok_s"] for r in res["rows"]
            if r["engine"] == "minispec target-only"}


def spec_table(res: dict) -> str:
    from minispec.speculative import GREEDY_HEAD_CHUNK
    res = {**res, **{key: {int(k): v for k, v in res[key].items()} for key in ("verify_cost", "trunk_cost")}}  # JSON keys
    base = phase_baselines(res)
    lines = ["| engine | batch | k | T | tokens/s | vs minispec target-only | cost model | cost model, measured "
             "tokens/round | acceptance | tokens/round measured | predicted (runs) | draft + verify per round, "
             "target steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in res["rows"]:
        ref = base.get((r.get("phase", 1), r["batch"], r["temperature"]))
        k = r["k"] if not str(r["k"]).startswith("auto") or r.get("mean_k") is None else f"{r['k']} ({r['mean_k']:.1f})"
        model, model_m = predicted_speedup(res, r), predicted_speedup(res, r, measured_tokens=True)
        lines.append(f"| {r['engine']} | {r['batch']} | {'' if k is None else k} | {r['temperature']} | {r['tok_s']:.1f} | "
                     f"{fmt(r['tok_s'] / ref if ref else None, '.2f')}x | {fmt(model, '.2f')}{'x' if model else ''} | "
                     f"{fmt(model_m, '.2f')}{'x' if model_m else ''} | "
                     f"{fmt(r.get('acceptance'), '.2f')} | "
                     f"{fmt(r.get('measured_per_round'), '.2f')} | {fmt((run_tokens(res, r) or (None,))[0], '.2f')} | "
                     + (f"{r['draft_s_round'] * 1e3 / res['target_step_ms']:.2f} + "
                        f"{r['verify_s_round'] * 1e3 / res['target_step_ms']:.2f} |" if "draft_s_round" in r else " |"))
    lines.append("")
    vc = ", ".join(f"{k}: {v:.2f} ({res['trunk_cost'][k]:.2f})" for k, v in sorted(res["verify_cost"].items()))
    lines.append(f"Draft step {res['draft_step_ms']:.1f} ms vs target step {res['target_step_ms']:.1f} ms "
                 f"(ratio {res['draft_cost_ratio']:.3f}; over 2 new tokens {res.get('draft2_cost_ratio', 0):.3f}). The "
                 f"target's verify pass over k drafts, in target steps (in brackets: without the lm_head): {vc}. Cost "
                 f"model: the speculative row's time per token against target-only's measured beside it; tokens per round from the acceptance runs of the largest k (1 + S_1 + ... + S_k, S_j the share "
                 f"of rounds accepting their first j drafts), over that verify pass (greedy: the trunk, then the lm_head "
                 f"over each chunk of {GREEDY_HEAD_CHUNK} positions the round reaches) plus k draft steps, the first over 2 new tokens after "
                 f"a round that accepted all, and each call's prefill (target {res.get('prefill_cost', {}).get('target', 0):.1f}, "
                 f"draft {res.get('prefill_cost', {}).get('draft', 0):.1f} target steps). Resident memory (peak / after the run): target alone "
                 f"{res['rss_mb_target']['peak']:.0f} / {res['rss_mb_target']['after_run']:.0f} MB, target + draft "
                 f"{res['rss_mb_target_and_draft']['peak']:.0f} / {res['rss_mb_target_and_draft']['after_run']:.0f} MB. "
                 f"{res['new_tokens']} new tokens x "
                 f"{res['prompts']} prompts, medians of {res['repeats']}, {res['threads']} threads, {res.get('target_dtype', 'float32')} target, "
                 f"{res.get('draft_dtype', 'float32')} draft; the step costs are medians of {res.get('cost_samples', 1)} probes "
                 f"taken between the prompts, interleaved with the rows.")
    return "\n".join(lines)


def plot_spec(res: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to get the plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = phase_baselines(res)
    ratio = lambda r: r["tok_s"] / base[r.get("phase", 1), r["batch"], r["temperature"]]  # noqa: E731
    first = [r for r in res["rows"] if r["batch"] == 1 and r.get("phase", 1) == 1]
    for temp, style in ((0.0, "o-"), (0.7, "s--")):
        spec = [r for r in first if r["engine"] == "minispec speculate" and r["temperature"] == temp]
        pts = [(r["k"], ratio(r)) for r in spec if isinstance(r["k"], int)]
        if pts:
            ax.plot(*zip(*pts), style, label=f"minispec speculate, T={temp}")
        for r in (r for r in spec if r["k"] == "auto"):
            ax.axhline(ratio(r), color="C2" if temp == 0 else "C3", lw=0.8, ls=":", label=f"speculate k=auto, T={temp}")
    ax.axhline(1.0, color="k", lw=1, label="minispec target-only")
    colors = iter(["tab:gray", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold"])
    for r in res["rows"]:
        if r["batch"] == 1 and not r["engine"].startswith("minispec"):
            ax.axhline(ratio(r), color=next(colors), lw=1, ls="-" if r["temperature"] == 0 else "--",
                       label=f"{r['engine']}, T={r['temperature']}")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("tokens/s over minispec target-only (same phase)")
    ax.set_title(f"{res.get('target', 'target')} drafted by {res.get('draft', 'draft')}, 2 CPU threads, batch 1",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["core", "spec", "drafts", "greedy", "distance"], nargs="?", default="spec")
    ap.add_argument("--pair", choices=sorted(PAIRS), default="smollm2",
                    help="smollm2 (the default) or coder: Qwen2.5-Coder-1.5B drafted by its 0.5B (make weights-coder)")
    ap.add_argument("--target", default=None, help="the target checkpoint (default: the pair's)")
    ap.add_argument("--draft", default=None, help="the draft checkpoint (default: the pair's)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (coder pair; built by `make bench`)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers in the spec benchmark")
    ap.add_argument("--quick", action="store_true", help="fewer k values at T=0.7")
    ap.add_argument("--phases", default="minispec,llama.cpp,transformers",
                    help="the spec benchmark's phases to run (default all three; each re-measures target-only)")
    ap.add_argument("--plot", default=None, help="write the spec benchmark's plot to this PNG")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="fixed k values for the spec benchmark")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=None, help="use only the pair's first N prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="minispec's target dtype in spec and greedy (default float32; bfloat16 where the CPU has "
                         "native bf16 products)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    if args.which == "spec":
        target, draft, texts, ggufs = PAIRS[args.pair]
        res = bench_spec(args.target or target, args.draft or draft, args.new_tokens, args.repeats, args.threads,
                         ks=tuple(int(k) for k in args.ks.split(",")),
                         batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                         plot=args.plot, quick=args.quick, texts=texts[:args.prompts], ggufs=ggufs,
                         phases=[p for p in args.phases.split(",")
                                 if not (p == "llama.cpp" and args.no_llama or p == "transformers" and args.no_hf)],
                         target_dtype=args.target_dtype)
        print(json.dumps(res, indent=2) if args.json else spec_table(res))
    elif args.which == "drafts":  # the pair's small model as converted, and --draft (e.g. a subset head): fp32, fp16, int4
        target, draft, texts, _ = PAIRS[args.pair]
        dirs = [DRAFT_SOURCES[args.pair]] + ([args.draft] if args.draft else [])
        options = [(Path(d).name, d, form) for d in dirs for form in ("float32", "float16", "int4")]
        res = bench_drafts(args.target or target, options, texts[:args.prompts], args.new_tokens,
                           int(args.ks.split(",")[0]), args.repeats, args.threads)
        print(json.dumps(res, indent=2) if args.json else "\n".join(
            f"| {r['draft']} | {r.get('dtype', 'fp32')} | {r['tok_s']:.2f} | " + (
                f"{r['speedup']:.2f}x | {r['acceptance']:.3f} | {r['per_round']:.2f} | {r['draft_step_ratio']:.3f} |"
                if "speedup" in r else "1.00x | | | |") for r in res["rows"]))
    elif args.which == "greedy":  # exactness, not speed: greedy speculate equals generate on every bench prompt
        target, draft, texts, _ = PAIRS[args.pair]
        res = greedy_check(args.target or target, args.draft or draft, texts[:args.prompts], args.new_tokens,
                           args.threads, args.target_dtype)
        print(json.dumps(res, indent=2) if args.json else
              f"greedy speculate == generate on {sum(r['equal'] for r in res['rows'])} of {len(res['rows'])} prompts "
              f"({res['new_tokens']} new tokens, a {res['target_dtype']} target, the {res['draft_form']} draft)")
    elif args.which == "distance":  # how far a bf16 target's outputs move from the fp32 target's
        target, _, texts, _ = PAIRS[args.pair]
        res = dtype_distance(args.target or target, texts[:args.prompts], "bfloat16", args.new_tokens, args.threads)
        print(json.dumps(res, indent=2) if args.json else
              f"bfloat16 against float32 over {len(res['rows'])} prompts x {res['new_tokens']} tokens: KL mean "
              f"{res['kl_mean']:.2e}, median {res['kl_median']:.2e}, max {res['kl_max']:.2e}; argmax agreement "
              f"{res['argmax_agreement']:.4f}")
    else:
        res = bench_core(args.new_tokens, args.repeats, args.threads)
        print_core(res, args.json)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def print_core(res: dict, as_json: bool) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
