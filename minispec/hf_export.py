"""Export a minispec checkpoint to a Hugging Face directory that transformers loads.

`export_hf(src, dst)` writes config.json, generation_config.json (bos/eos), model.safetensors with
Hugging Face tensor names (minispec.checkpoint.minispec_to_hf_name) and the tokenizer files, so
`transformers.AutoModelForCausalLM.from_pretrained(dst)` gives the same logits as minispec. A model
without q/k/v biases exports as LlamaForCausalLM; one with them (qkv_bias) as Qwen2ForCausalLM, the
architecture whose attention is exactly that (Llama's attention_bias would also put a bias on o_proj).
The weights keep their stored dtype and are streamed one tensor at a time. `dst` appears only once it is
complete. transformers itself is not needed to export.

The command line is tools/export_hf.py; the equivalence harness exports with it in-process
(minispec.equivalence.engines).
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from . import quantized
from .checkpoint import (
    CONFIG_NAME,
    TOKENIZER_FILES,
    WEIGHTS_NAME,
    CheckpointError,
    atomic_output_dir,
    check_dtypes,
    check_head_ids,
    check_state_dict,
    expected_tensors,
    minispec_to_hf_name,
)
from .config import ModelConfig
from .model import Transformer
from .safetensors_writer import TORCH_DTYPE, TensorEntry, copy_files, write_safetensors

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExportWarning(UserWarning):
    """The export is usable but not the same model everywhere (a subset lm_head): the message says where."""


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


def _check(f, slices: dict, wfile: Path, cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The weights file's tensors against `cfg`: layers, shapes, dtypes, head ids (a CheckpointError if wrong).
    Returns the model's tensor shapes (a kept matrix under its own name) and the kept matrices' forms
    (minispec.quantized)."""
    dtypes = {n: s.get_dtype() for n, s in slices.items()}
    shapes, kept = quantized.split_kept({n: tuple(s.get_shape()) for n, s in slices.items()}, dtypes, str(wfile))
    check_state_dict(shapes, expected_tensors(Transformer, cfg, shapes, str(wfile)), str(wfile))  # layers first
    check_dtypes({n: dt for n, dt in dtypes.items() if n in shapes}, str(wfile))
    if "head_ids" in slices:
        check_head_ids(f.get_tensor("head_ids"), cfg.vocab_size, str(wfile))
    return shapes, kept


def _kept(f, name: str, form: str) -> torch.Tensor:
    """A kept matrix's stored values in float32 (transformers computes them in fp32, minispec's CPU kernels
    with bf16 scales: docs/design.md, "Quantized targets")."""
    return quantized.dequantize(form, quantized.read_parts(name, form, f.get_tensor))


def _full_head(f, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """A subset lm_head's rows scattered into a full-vocabulary one whose other rows are zero."""
    full = torch.zeros(cfg.vocab_size, cfg.dim, dtype=dtype)
    full[f.get_tensor("head_ids")] = f.get_tensor("lm_head.weight")
    return full


def _entries(f, slices: dict, cfg: ModelConfig, src: Path, shapes: dict[str, tuple[int, ...]],
             kept: dict[str, str]) -> list[TensorEntry]:
    """The tensors to write, under their Hugging Face names, each read from `f` when its turn comes."""
    parts = quantized.part_names(kept)
    slices = {n: s for n, s in slices.items() if n not in parts}
    dtypes = {n: TORCH_DTYPE[s.get_dtype()] for n, s in slices.items()}
    entries = [TensorEntry(minispec_to_hf_name(n), shapes[n], dtypes[n], functools.partial(f.get_tensor, n))
               for n in slices if n not in ("head_ids", "lm_head.weight")]
    entries += [TensorEntry(minispec_to_hf_name(name), shapes[name], torch.float32,
                            functools.partial(_kept, f, name, form)) for name, form in kept.items()]
    if "lm_head.weight" in slices and cfg.head_vocab_size is None:
        entries.append(TensorEntry("lm_head.weight", shapes["lm_head.weight"], dtypes["lm_head.weight"],
                                   functools.partial(f.get_tensor, "lm_head.weight")))
    elif cfg.head_vocab_size is not None:
        # transformers' Llama has no subset head: a full-vocabulary lm_head scores the other ids with logit 0
        # instead of -inf. A usable draft for transformers' assisted generation, but not the same
        # distribution outside the subset.
        warnings.warn(f"{src} has a {cfg.head_vocab_size}-id subset lm_head; the export scores the other ids with "
                      "logit 0 instead of -inf", ExportWarning, stacklevel=3)
        head_dtype = dtypes["lm_head.weight"]
        entries.append(TensorEntry("lm_head.weight", (cfg.vocab_size, cfg.dim), head_dtype,
                                   functools.partial(_full_head, f, cfg, head_dtype)))
    return entries


def export_hf(src: str | Path, dst: str | Path, overwrite: bool = False, progress: bool = True) -> dict:
    """Write the minispec checkpoint in `src` as a Hugging Face checkpoint at `dst`; return its config.json dict.

    Raises CheckpointError (an InputError) for a source that is not a loadable minispec checkpoint and
    OSError where `dst` exists (without `overwrite`) or cannot be written. A subset lm_head exports with an
    ExportWarning. progress: a progress bar on stderr.
    """
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
        shapes, kept = _check(f, slices, wfile, cfg)
        entries = _entries(f, slices, cfg, src, shapes, kept)
        embed = slices.get("embed_tokens.weight")
        hf = hf_config_from_minispec(cfg, TORCH_DTYPE[embed.get_dtype()] if embed is not None else torch.float32)
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
