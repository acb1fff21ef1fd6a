"""Export a minispec checkpoint to a Hugging Face directory that transformers loads.

    python tools/export_hf.py SRC_DIR DST_DIR [--overwrite]

The output holds config.json, generation_config.json (bos/eos), model.safetensors
with Hugging Face tensor names (minispec.checkpoint.minispec_to_hf_name) and the
tokenizer files, so `transformers.AutoModelForCausalLM.from_pretrained(DST_DIR)`
gives the same logits as minispec. A model without q/k/v biases exports as
LlamaForCausalLM; one with them (qkv_bias) as Qwen2ForCausalLM, the
architecture whose attention is exactly that (Llama's attention_bias would
also put a bias on o_proj). The weights keep their stored dtype. DST_DIR
appears only once it is complete.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

try:  # run from a source checkout without installing minispec
    import minispec  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import TORCH_DTYPE, TensorEntry, atomic_output_dir, copy_files, run_tool, tool_parser, write_safetensors
from minispec.checkpoint import (CONFIG_NAME, TOKENIZER_FILES, WEIGHTS_NAME, CheckpointError, check_dtypes,
                                 check_head_ids, check_state_dict, expected_tensors, minispec_to_hf_name)
from minispec.config import ModelConfig
from minispec.model import Transformer

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_from_minispec(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """minispec ModelConfig -> a Hugging Face config.json dict (LlamaForCausalLM, or Qwen2ForCausalLM for qkv_bias).

    RoPE is written in the layout every transformers version reads: top-level
    rope_theta and rope_scaling (5.x folds them into rope_parameters on load).
    """
    hf = {
        "architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.qkv_bias else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }
    if cfg.qkv_bias:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


def export(src: str | Path, dst: str | Path, overwrite: bool = False, progress: bool = True) -> dict:
    """Write the minispec checkpoint in `src` as a Hugging Face checkpoint at `dst`; return its config.json dict."""
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.load(str(src / CONFIG_NAME))
    wfile = src / WEIGHTS_NAME
    if not wfile.is_file():
        raise CheckpointError(f"{src}: no {WEIGHTS_NAME}")
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(safe_open(str(wfile), framework="pt"))
            slices = {n: f.get_slice(n) for n in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{wfile} cannot be read as safetensors ({type(e).__name__}: {e}); "
                                  "the file may be truncated or corrupt") from None
        shapes = {n: tuple(s.get_shape()) for n, s in slices.items()}
        check_state_dict(shapes, expected_tensors(Transformer, cfg, shapes, str(wfile)), str(wfile))  # layers first
        check_dtypes({n: s.get_dtype() for n, s in slices.items()}, str(wfile))
        if "head_ids" in slices:
            check_head_ids(f.get_tensor("head_ids"), cfg.vocab_size, str(wfile))
        dtypes = {n: TORCH_DTYPE[s.get_dtype()] for n, s in slices.items()}
        entries = [TensorEntry(minispec_to_hf_name(n), shapes[n], dtypes[n], lambda n=n: f.get_tensor(n))
                   for n in slices if n not in ("head_ids", "lm_head.weight")]
        if "lm_head.weight" in slices and cfg.head_vocab_size is None:
            entries.append(TensorEntry("lm_head.weight", shapes["lm_head.weight"], dtypes["lm_head.weight"],
                                       lambda: f.get_tensor("lm_head.weight")))
        elif cfg.head_vocab_size is not None:
            # transformers' Llama has no subset head: scatter its rows into a full-vocabulary lm_head whose
            # other rows are zero (logit 0 instead of -inf). A usable draft for transformers' assisted
            # generation, but not the same distribution outside the subset.
            print(f"note: {src} has a {cfg.head_vocab_size}-id subset lm_head; the export scores the other "
                  "ids with logit 0 instead of -inf", file=sys.stderr)

            def full_head():
                full = torch.zeros(cfg.vocab_size, cfg.dim, dtype=dtypes["lm_head.weight"])
                full[f.get_tensor("head_ids")] = f.get_tensor("lm_head.weight")
                return full
            entries.append(TensorEntry("lm_head.weight", (cfg.vocab_size, cfg.dim), dtypes["lm_head.weight"], full_head))
        hf = hf_config_from_minispec(cfg, dtypes.get("embed_tokens.weight", torch.float32))
        gen = {k: v for k, v in (("bos_token_id", cfg.bos_id), ("eos_token_id", cfg.eos_id)) if v is not None}
        with atomic_output_dir(dst, overwrite=overwrite) as tmp:
            write_safetensors(tmp / "model.safetensors", entries, metadata={"format": "pt"},
                              show_progress=progress, desc=f"exporting {src.name}")
            for name, d in (("config.json", hf), ("generation_config.json", gen)):
                with open(tmp / name, "w") as out:
                    json.dump(d, out, indent=2)
                    out.write("\n")
            copy_files(src, tmp, TOKENIZER_FILES)
    return hf


def main(argv: list[str] | None = None) -> int:
    args = tool_parser(__doc__.split("\n\n")[0],
                       src_help="minispec checkpoint directory (config.json + model.safetensors)",
                       dst_help="Hugging Face checkpoint directory to create").parse_args(argv)

    def job() -> str:
        hf = export(args.src, args.dst, overwrite=args.overwrite, progress=not args.quiet)
        return f"wrote {args.dst} ({hf['architectures'][0]})"
    return run_tool(job)


if __name__ == "__main__":
    sys.exit(main())
