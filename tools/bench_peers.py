"""The benchmark's peers: transformers (the core benchmark, the spec benchmark's transformers phase) and llama.cpp.

Each spec-benchmark phase here registers its rows on the run (bench_plan.SpecRun) beside minispec's
target-only and speculate re-measured, then runs them interleaved: the peers' copies of the weights do not
fit in memory beside the minispec phase's, so each has a phase of its own.
"""

from __future__ import annotations

import functools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minispec import ModelConfig, Transformer
from minispec.checkpoint import minispec_to_hf_name
from minispec.hf_export import export_hf

from export_hf import notes

SMOLLM2_SHAPE = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                     max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True, bos_id=1, eos_id=2)


# ---------------------------------------------------------------------------
# the core benchmark: minispec generate against transformers' on random weights
# ---------------------------------------------------------------------------

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


def core_minispec(model: Transformer, prompt: list[int], new_tokens: int) -> list[int]:
    return model.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])


def core_transformers(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def bench_core(new_tokens: int = 128, repeats: int = 3, threads: int = 2) -> dict:
    """minispec greedy generate against transformers' on random weights of SmolLM2-135M's shape, and the
    memory-bandwidth floor: the fp32 weight bytes read per decode step over the measured read bandwidth."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SMOLLM2_SHAPE))
    hf = hf_twin(model)
    prompt = torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (16,), generator=torch.Generator().manual_seed(1)).tolist()
    run_minispec = functools.partial(core_minispec, model, prompt, new_tokens)
    run_hf = functools.partial(core_transformers, hf, prompt, new_tokens)
    run_minispec(), run_hf()  # warm up both
    (t_ms, out_ms), (t_hf, out_hf) = timed(run_minispec, run_hf, repeats=repeats)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = read_bandwidth()
    floor = bw / weight_bytes
    return {
        "new_tokens": new_tokens, "threads": threads, "repeats": repeats,
        "minispec_tok_s": new_tokens / t_ms, "transformers_tok_s": new_tokens / t_hf,
        "ratio_vs_transformers": t_hf / t_ms, "weight_bytes": weight_bytes, "read_bandwidth_GB_s": bw / 1e9,
        "floor_tok_s": floor, "fraction_of_floor": new_tokens / t_ms / floor,
        "same_tokens": out_ms == out_hf,
    }


# ---------------------------------------------------------------------------
# llama.cpp (the coder pair, from the GGUF files minispec converted)
# ---------------------------------------------------------------------------

def llama_cpp_bin() -> Path | None:
    from llama_cpp import bin_dir  # tools/llama_cpp.py, beside this file
    return bin_dir()


def f32_gguf(bin_dir: Path, gguf: str) -> str:
    """The GGUF requantized to F32 by llama.cpp's own tool (made once, beside its build): every weight
    dequantized, so llama.cpp computes with exactly the fp32 weights minispec converted."""
    out = bin_dir.parent.parent / "gguf-f32" / (Path(gguf).stem + "-f32.gguf")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", gguf, str(tmp), "F32"], check=True,
                       capture_output=True)
        tmp.replace(out)
    return str(out)


def llama_command(bin_dir: Path, prompt_file: str, n: int, threads: int, temperature: float, seed: int,
                  target: str, draft: str | None) -> list[str]:
    """llama-completion's command line (no draft) or llama-speculative's (its default draft settings)."""
    common = ["-m", target, "-f", prompt_file, "-n", str(n), "--ignore-eos", "-t", str(threads),
              "--temp", str(temperature), "-s", str(seed), "-c", "4096"]
    if draft is None:  # (llama-speculative has no --no-warmup; its timings exclude the warm-up anyway)
        return [str(bin_dir / "llama-completion"), *common, "-no-cnv", "--no-warmup"]
    return [str(bin_dir / "llama-speculative"), *common, "-md", draft, "-td", str(threads)]


def llama_timings(log: str, speculative: bool) -> tuple[int, None, float]:
    """(tokens, None, seconds) from a llama.cpp log: prompt processing plus generation as it reports them."""
    if not speculative:
        ms = [float(m) for m in re.findall(r"eval time =\s*([\d.]+) ms", log)[-2:]]  # prompt eval, then eval
        n = int(re.findall(r"eval time =\s*[\d.]+ ms /\s*(\d+) runs", log)[-1])
        return n + 1, None, sum(ms) / 1e3  # the first token comes out of the prompt pass
    enc = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    return int(dec.group(1)), None, enc + float(dec.group(2))


def llama_one(bin_dir: Path, threads: int, temperature: float, target: str, draft: str | None, text: str, i: int,
              n: int) -> tuple[int, None, float]:
    """One prompt through llama.cpp's plain decoding (llama-completion) or, with a draft, its speculative
    decoding (llama-speculative); the prompt is the chat-rendered text. Returns (tokens, None, seconds) with
    seconds as llama.cpp reports them: prompt processing plus generation, not the process start or the
    model load."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = llama_command(bin_dir, f.name, n, threads, temperature, i, target, draft)
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    Path(f.name).unlink()
    log = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {log[-500:]}")
    return llama_timings(log, draft is not None)


def llama_phase(run, ggufs: tuple[str, str]) -> None:
    """llama.cpp's phase (its copies of the weights fill the page cache too): its plain and speculative decoding
    on the GGUF files requantized to F32 and as shipped, beside minispec target-only and speculate k=auto."""
    bin_dir = llama_cpp_bin()
    if bin_dir is None:
        print("llama.cpp is not built (python tools/llama_cpp.py): its rows are skipped", file=sys.stderr)
        return
    chat = [run.target.tokenizer.apply_chat_template(m) for m in run.messages]
    run.measure("minispec target-only", run.gen(0.0))
    run.measure("minispec speculate", run.spec(run.draft, "auto", 0.0), k="auto")
    for label, (tg, dg) in (("F32", tuple(f32_gguf(bin_dir, g) for g in ggufs)), ("shipped", ggufs)):
        for temperature in (0.0,):  # the llama.cpp goal is greedy (T=0.7 rows: add 0.7 here)
            run.measure(f"llama.cpp completion ({label})",
                        run.parts(llama_one, bin_dir, run.threads, temperature, tg, None, items=chat),
                        temperature=temperature)
            run.measure(f"llama.cpp speculative ({label})",
                        run.parts(llama_one, bin_dir, run.threads, temperature, tg, dg, items=chat), k="llama",
                        temperature=temperature)
    run.run_plan()


# ---------------------------------------------------------------------------
# transformers: generate and assisted generation with the same draft
# ---------------------------------------------------------------------------

def hf_exported(src: str) -> str:
    """A transformers copy of a minispec checkpoint (minispec.hf_export) in a temporary directory."""
    dst = Path(tempfile.mkdtemp(prefix="minispec-bench-")) / Path(src).name
    with notes():  # as tools/export_hf.py shows them
        export_hf(src, dst, progress=False)
    return str(dst)


def load_hf_pair(target_dir: str, draft_dir: str, ggufs: tuple[str, str] | None) -> tuple:
    """The pair in transformers, fp32: from the same GGUF files minispec converted, or exported from minispec's."""
    from transformers import AutoModelForCausalLM
    if ggufs is not None:
        return tuple(AutoModelForCausalLM.from_pretrained(str(Path(g).parent), gguf_file=Path(g).name,
                                                          dtype=torch.float32).eval() for g in ggufs)
    return tuple(AutoModelForCausalLM.from_pretrained(hf_exported(d), dtype=torch.float32).eval()
                 for d in (target_dir, draft_dir))


def hf_generate_one(hf_target, assistant, temperature: float, ids: list[int], i: int, n: int) -> tuple[int, None]:
    """transformers' generate on one prompt (assisted generation with `assistant`), seeded with the prompt's index."""
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


def transformers_phase(run, target_dir: str, draft_dir: str, ggufs: tuple[str, str] | None) -> None:
    """transformers' phase (its copies of both models do not fit in memory beside the rest): generate and
    assisted generation with the same draft, beside minispec target-only and speculate k=auto."""
    hf_target, hf_draft = load_hf_pair(target_dir, draft_dir, ggufs)
    run.measure("minispec target-only", run.gen(0.0))
    run.measure("minispec target-only", run.gen(0.7), temperature=0.7)
    run.measure("minispec speculate", run.spec(run.draft, "auto", 0.0), k="auto")
    run.measure("minispec speculate", run.spec(run.draft, "auto", 0.7), k="auto", temperature=0.7)
    run.measure("transformers generate", run.parts(hf_generate_one, hf_target, None, 0.0))
    run.measure("transformers assisted generation", run.parts(hf_generate_one, hf_target, hf_draft, 0.0), k="hf")
    run.measure("transformers assisted generation", run.parts(hf_generate_one, hf_target, hf_draft, 0.7), k="hf",
                temperature=0.7)
    run.run_plan()
