"""Give a draft checkpoint a subset lm_head: it scores only the tokens a target is likely to emit.

A released draft's lm_head scores every one of its vocabulary's ids (151,936 rows for
Qwen2.5, 136M weights: a quarter of Qwen2.5-Coder-0.5B's bytes read per decode step). A
draft only has to propose tokens the target accepts, and they come from a much smaller set,
so this keeps the rows of the `--tokens` most frequent ones and gives every other id logit
-inf (`ModelConfig.head_vocab_size`, `Transformer.head_ids`). Speculation stays exact: a
token the draft never proposes has q = 0, and the target still emits it through the
residual whenever p says so. What it costs is acceptance, at the tokens left out.

Which tokens: with `--counts FILE` (a JSON list of token ids, e.g. the target's own
generations), the most frequent there; otherwise the lowest ids, which for a byte-level BPE
vocabulary are its earliest merges, the most frequent pieces of the text the tokenizer was
trained on. Special tokens and the stop ids are always kept.

    python tools/draft_head.py SRC_DIR DST_DIR [--tokens 32768] [--counts tokens.json] [--dtype float16] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from minispec import ModelConfig, Transformer
from minispec.checkpoint import check_output_dir, save_pretrained  # noqa: E402

from _common import ConversionError, run_tool

DEFAULT_TOKENS = 32768


def head_ids(cfg: ModelConfig, tokenizer, n: int, counts: list[int] | None = None) -> torch.Tensor:
    """The ids the subset head keeps, sorted: the n most frequent (or lowest) ids, the special tokens and stops."""
    live = cfg.sampled_vocab_size or cfg.vocab_size
    always = set(cfg.stop_ids)
    if tokenizer is not None:
        always |= {i for i in getattr(tokenizer.backend, "special_ids", ()) if i < live}
    if counts is not None:
        ranked = [t for t, _ in Counter(t for t in counts if 0 <= t < live).most_common()]
        ranked += [t for t in range(live) if t not in set(ranked)]
    else:
        ranked = list(range(live))
    keep = set(always)
    for t in ranked:
        if len(keep) >= n:
            break
        keep.add(t)
    return torch.tensor(sorted(keep), dtype=torch.long)


def make_subset_head(src: str, dst: str, n: int = DEFAULT_TOKENS, counts: list[int] | None = None,
                     dtype: torch.dtype | None = None, overwrite: bool = False) -> ModelConfig:
    """Write SRC's model with a subset head of `n` rows to DST; a DST that is not empty needs `overwrite`."""
    check_output_dir(dst, overwrite)  # before the work, not after it
    model = Transformer.from_pretrained(src)
    cfg = model.config
    if model.head_ids is not None:
        raise ConversionError(f"{src} already has a subset head ({cfg.head_vocab_size} tokens)")
    live = cfg.sampled_vocab_size or cfg.vocab_size
    if not 1 <= n < live:
        raise ConversionError(f"--tokens must be in [1, {live - 1}] for {src} ({live} tokens), got {n}")
    ids = head_ids(cfg, model.tokenizer, n, counts)
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    new_cfg = ModelConfig.from_dict({**cfg.to_dict(), "tie_embeddings": False, "head_vocab_size": len(ids)})
    with torch.device("meta"):
        draft = Transformer(new_cfg)
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "head_ids")}
    state["lm_head.weight"] = weight[ids].clone()
    state["head_ids"] = ids
    draft.load_state_dict(state, assign=True, strict=True)
    draft.tokenizer = model.tokenizer
    # the stored dtype is the one from_pretrained computes in; only the checkpoint's own files in DST are replaced
    save_pretrained(draft, dst, dtype=dtype, overwrite=overwrite)
    return new_cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"rows the head keeps (default {DEFAULT_TOKENS})")
    p.add_argument("--counts", default=None, help="a JSON list of token ids whose frequencies rank the tokens")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="store the draft in this dtype (default: as the source); float16 halves the bytes a draft "
                        "step reads, and the output stays the target's")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST's checkpoint files if it is not empty (only once the new ones are complete)")
    args = p.parse_args(argv)

    def run() -> str:
        counts = None
        if args.counts is not None:
            try:
                counts = json.loads(Path(args.counts).read_text(encoding="utf-8"))
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep, a 5000-digit number
                why = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
                raise ConversionError(f"--counts {args.counts} is not a readable JSON list of token ids "
                                      f"({why})") from None
            if not isinstance(counts, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in counts):
                raise ConversionError(f"--counts {args.counts} must hold a JSON list of token ids")
        dtype = getattr(torch, args.dtype) if args.dtype else None
        cfg = make_subset_head(args.src, args.dst, args.tokens, counts, dtype, overwrite=args.overwrite)
        return f"wrote {args.dst}: a {cfg.head_vocab_size}-row head over {cfg.vocab_size} ids" + (
            f", stored as {args.dtype}" if args.dtype else "")
    return run_tool(run)


if __name__ == "__main__":
    raise SystemExit(main())
