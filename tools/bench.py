"""Benchmarks, measured side by side in one run (the machines are shared and noisy: compare ratios, quote medians).

    python tools/bench.py core     # minispec greedy generate vs transformers' LlamaForCausalLM.generate,
                                   # random weights of SmolLM2-135M's shape, fp32, 2 threads

The memory-bandwidth floor is the fp32 weight bytes read per decode step over the
measured read bandwidth of this machine (a reduction over a 512 MiB tensor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from minispec import ModelConfig, Transformer
from minispec.checkpoint import minispec_to_hf_name

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


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


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
    t_ms, out_ms = timed(run_minispec, repeats)
    t_hf, out_hf = timed(run_hf, repeats)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["core"], nargs="?", default="core")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    res = bench_core(args.new_tokens, args.repeats, args.threads)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"| engine | tokens/s (median of {res['repeats']}) |\n|---|---|")
        print(f"| minispec generate | {res['minispec_tok_s']:.1f} |")
        print(f"| transformers generate | {res['transformers_tok_s']:.1f} |")
        print(f"\nminispec / transformers: {res['ratio_vs_transformers']:.2f}x; "
              f"bandwidth floor {res['floor_tok_s']:.1f} tok/s ({res['weight_bytes'] / 1e6:.0f} MB at "
              f"{res['read_bandwidth_GB_s']:.1f} GB/s), minispec at {res['fraction_of_floor']:.2f} of it; "
              f"same greedy tokens: {res['same_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
