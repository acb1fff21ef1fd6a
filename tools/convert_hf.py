"""Convert a Hugging Face Llama / Mistral / Qwen2 checkpoint directory to a minispec checkpoint.

    python tools/convert_hf.py SRC_DIR DST_DIR [--dtype float32|bfloat16|float16] [--overwrite]

SRC_DIR is what `save_pretrained` writes (or a Hub snapshot): config.json, the
weights as model.safetensors, sharded model-0000x-of-0000y.safetensors with
model.safetensors.index.json, or pytorch_model.bin (sharded with
pytorch_model.bin.index.json), and the tokenizer files. DST_DIR becomes a
minispec checkpoint (config.json, model.safetensors, tokenizer files) that
`Transformer.from_pretrained` loads.

minispec's module names are Hugging Face's without the "model." prefix, so the
conversion is a rename (minispec.checkpoint.hf_to_minispec_name), never a
permutation: minispec applies RoPE in the same rotate-half layout as
transformers, so q_proj/k_proj rows are used as stored.

What is refused, with a message saying why: an architecture other than the three
above, sliding-window attention (minispec attends to the whole context),
rope scaling other than Llama 3's, biases other than Qwen2's q/k/v, a missing or
misshapen tensor, an integer, boolean or FP8 tensor, an unreadable weights file,
config values of the wrong type (strings for numbers, "false" for false), a
shard index naming files outside SRC_DIR, and a pickle (pytorch_model.bin) that
holds anything but tensors: it is read with torch.load(weights_only=True) only.
The layer count is compared with the weights' headers before anything is built.
An embedding with more rows than the tokenizer has ids (Qwen2: 151,936 rows,
151,665 tokens) gets `sampled_vocab_size`, so the padding rows are never sampled.
Tensors are streamed one at a time, the result is loaded back as a check, and
DST_DIR appears only when the conversion has fully succeeded.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from minispec.checkpoint import (
    CONFIG_NAME,
    TOKENIZER_FILES,
    WEIGHTS_NAME,
    CheckpointError,
    check_output_dir,
    check_state_dict,
    expected_tensors,
    hf_to_minispec_name,
)
from minispec.config import ModelConfig, is_int
from minispec.errors import show
from minispec.model import Transformer
from minispec.tokenizer import load_tokenizer

from _common import (
    DTYPES,
    TORCH_DTYPE,
    ConversionError,
    TensorEntry,
    atomic_output_dir,
    check_output_loads,
    copy_files,
    read_json,
    run_tool,
    tool_parser,
    write_safetensors,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# a tensor found in a weights file, before it is read: (shape, dtype, load)
_Source = tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ---- config.json (pure functions of the parsed JSON) ----

def architecture(hf: dict) -> str:
    """The checkpoint's architecture name, e.g. "LlamaForCausalLM"; a clear error if minispec cannot run it."""
    archs = hf.get("architectures") or []
    if not archs and hf.get("model_type") in _ARCH_OF_MODEL_TYPE:
        archs = [_ARCH_OF_MODEL_TYPE[hf["model_type"]]]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        got = archs[0] if len(archs) == 1 else (archs or f"none (model_type={hf.get('model_type')!r})")
        raise ConversionError(f"architecture {got} is not supported; minispec converts "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers < 5 writes top-level "rope_theta" and "rope_scaling"; 5.x
    writes one "rope_parameters" dict holding rope_theta and the scaling keys.
    """
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConversionError(f"config.json: {key} must be an object or null, got {show(hf[key])}")
    params = dict(hf.get("rope_parameters") or {})
    if "layer_types" in hf and any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(f"per-layer rope_parameters {show(params, 200)} are not supported")
    theta = _number(hf.get("rope_theta", params.get("rope_theta", 10000.0)), "rope_theta")
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    factor = hf.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0) if scaling else 1.0)
    if factor != 1.0:
        raise ConversionError(f"partial_rotary_factor={factor} is not supported (minispec rotates the whole head)")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConversionError(f"rope scaling type {kind!r} is not supported (only 'llama3'); the config has {scaling}")
    scaling = dict(scaling)
    # transformers falls back to max_position_embeddings when the original length is not given
    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    missing = [k for k in _LLAMA3_KEYS if scaling.get(k) is None]
    if missing:
        raise ConversionError(f"llama3 rope scaling lacks {missing}; the config has {scaling}")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_KEYS}}


def _number(v, name: str) -> float:
    """A config.json number as a float; "1e-5" (a string) or true is refused, not converted."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ConversionError(f"config.json: {name} must be a number, got {show(v)}")
    return float(v)


def _check_features(hf: dict, arch: str) -> None:
    """Refuse what minispec's Transformer does not compute, rather than convert it into a different model."""
    max_pos = hf.get("max_position_embeddings")
    window = hf.get("sliding_window")
    for name, v in (("max_position_embeddings", max_pos), ("sliding_window", window)):
        if v is not None and not is_int(v):
            raise ConversionError(f"config.json: {name} must be an integer or null, got {show(v)}")
    sliding = window is not None and (arch == "MistralForCausalLM" or hf.get("use_sliding_window", False))
    if sliding and (max_pos is None or window < max_pos):
        raise ConversionError(
            f"{arch} with sliding-window attention (sliding_window={window} < max_position_embeddings={max_pos}) "
            "is unsupported: minispec attends to the whole context, so outputs would differ past the window")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConversionError(f"hidden_act={hf['hidden_act']!r} is not supported (minispec's MLP is SwiGLU, 'silu')")
    if hf.get("attention_bias", False):
        raise ConversionError("attention_bias=true (a bias on q/k/v and o_proj) is not supported; "
                              "minispec has q/k/v biases only, as in Qwen2")
    if hf.get("mlp_bias", False):
        raise ConversionError("mlp_bias=true is not supported (minispec's MLP has no biases)")


def _norm_eos(value, source: str) -> int | list[int] | None:
    """eos may be an int or a list (Llama 3 stops on several); keep the order, drop duplicates and Nones.

    A token string ("</s>"), a float or a bool is refused: eos_token_id names ids, not tokens.
    """
    if value is None or is_int(value):
        return value
    if not isinstance(value, list) or not all(v is None or is_int(v) for v in value):
        raise ConversionError(f"{source}: eos_token_id must be a token id or a list of ids, got {show(value)}; "
                              "a token string belongs in tokenizer_config.json's eos_token")
    ids = list(dict.fromkeys(v for v in value if v is not None))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def config_from_hf(hf: dict, generation_config: dict | None = None) -> ModelConfig:
    """A Hugging Face config.json (parsed) -> minispec ModelConfig.

    bos/eos ids come from generation_config.json when given (it is what
    transformers' generate stops on), else from config.json.
    """
    arch = architecture(hf)
    _check_features(hf, arch)
    theta, scaling = _rope(hf)
    gen = generation_config or {}
    bos = gen.get("bos_token_id", hf.get("bos_token_id"))
    eos_source = "generation_config.json" if "eos_token_id" in gen else "config.json"
    eos = _norm_eos(gen.get("eos_token_id", hf.get("eos_token_id")), eos_source)
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            ffn_dim=hf["intermediate_size"],
            norm_eps=_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            # all three architectures default to untied in transformers
            tie_embeddings=hf.get("tie_word_embeddings", False),  # a bool: ModelConfig refuses "false"
            qkv_bias=arch == "Qwen2ForCausalLM",
            bos_id=bos,
            eos_id=eos,
        )
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}, which a {arch} config must have") from None
    except ValueError as e:
        raise ConversionError(f"config.json describes a model minispec cannot build: {e}") from None


def special_ids_from_tokenizer_files(src: Path) -> tuple[int | None, int | None]:
    """bos/eos ids named by tokenizer_config.json (token strings), looked up in its added tokens or tokenizer.json."""
    tc_path = src / "tokenizer_config.json"
    if not tc_path.is_file():
        return None, None
    tc = read_json(tc_path)
    tj_path = src / "tokenizer.json"
    try:
        vocab = {v["content"]: int(k) for k, v in (tc.get("added_tokens_decoder") or {}).items() if isinstance(v, dict)}
        if tj_path.is_file():
            tj = read_json(tj_path)
            vocab.update({t["content"]: t["id"] for t in tj.get("added_tokens") or []})
            model_vocab = (tj.get("model") or {}).get("vocab")
            if isinstance(model_vocab, dict):
                vocab = {**model_vocab, **vocab}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{src}: tokenizer_config.json's added_tokens_decoder or tokenizer.json's added_tokens "
                              f"are malformed ({type(e).__name__}: {show(str(e))})") from None

    def lookup(key):
        tok = tc.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return vocab.get(tok) if isinstance(tok, str) else None

    return lookup("bos_token"), lookup("eos_token")


# ---- weights ----

def find_weight_files(src: Path) -> list[Path]:
    """The weight files of a Hugging Face checkpoint directory, safetensors preferred over .bin."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (src / index_name).is_file():
            weight_map = read_json(src / index_name).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{src / index_name} has no weight_map")
            files = [src / _shard_name(f, src / index_name) for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConversionError(f"{src / index_name} lists shard(s) {missing} that are not in {src}; "
                                      "download every shard")
            return files
        if (src / single).is_file():
            return [src / single]
    present = sorted(p.name for p in src.iterdir())
    raise ConversionError(f"{src} holds no model.safetensors, sharded safetensors with model.safetensors.index.json, "
                          f"or pytorch_model.bin; it has {present}")


def _shard_name(name, index: Path) -> str:
    """A shard file named by an index: a relative path inside the checkpoint directory, never `../x` or `/x`.

    Checked by name, not by where a symlink points: Hugging Face's cache links shards to blobs elsewhere.
    """
    p = Path(name) if isinstance(name, str) else None
    if p is None or not name or p.is_absolute() or p.drive or ".." in p.parts:
        raise ConversionError(f"{index} names shard {show(name)}, which is not a file inside {index.parent}; "
                              "an index may only name files in its own directory")
    return name


def _unpickle_reason(e: Exception) -> str:
    """The line of torch's weights_only error that says what it refused (its advice to retry unsafely is left out)."""
    for line in str(e).splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()
    return f"{type(e).__name__}: {show(str(e).splitlines()[0] if str(e) else '', 120)}"


def _open_weights(path: Path, stack: contextlib.ExitStack) -> dict[str, _Source]:
    """{name: (shape, dtype, load)} for one weight file, reading only its header / memory-mapping it."""
    try:
        if path.suffix == ".safetensors":
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            out = {}
            for n in f.keys():
                sl = f.get_slice(n)
                if sl.get_dtype() not in TORCH_DTYPE:
                    raise ConversionError(f"{path}: tensor {n!r} has dtype {sl.get_dtype()}, which minispec does not "
                                          f"read (it reads {', '.join(sorted(TORCH_DTYPE))})")
                out[n] = (tuple(sl.get_shape()), TORCH_DTYPE[sl.get_dtype()], lambda f=f, n=n: f.get_tensor(n))
            return out
        # .bin: weights_only refuses pickled code; mmap keeps the shard on disk until each tensor is used
        with warnings.catch_warnings():  # torch's notes on pickle protocols: the error below says what matters
            warnings.simplefilter("ignore", UserWarning)
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the pre-zip legacy format cannot be memory-mapped
                state = torch.load(str(path), map_location="cpu", weights_only=True)
    except ConversionError:
        raise
    except Exception as e:
        if path.suffix == ".safetensors":
            raise ConversionError(f"{path} cannot be read as safetensors ({type(e).__name__}: {show(str(e), 200)}); "
                                  "the file may be truncated or corrupt: re-download or re-save it") from None
        raise ConversionError(f"{path} cannot be read as a PyTorch checkpoint of plain tensors "
                              f"({_unpickle_reason(e)}); "
                              "minispec reads pickles only with torch.load(weights_only=True), which refuses pickled "
                              "code: if the file is truncated or corrupt re-download or re-save it, else get the "
                              "weights as safetensors") from None
    if isinstance(state, dict):
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    else:
        bad = ["(not a dict)"]
    if bad:
        raise ConversionError(f"{path} is not a state dict of tensors (offending entries: {show(bad[:5], 200)})")
    return {n: (tuple(t.shape), t.dtype, lambda t=t: t) for n, t in state.items()}


def _check_dtype(name: str, dtype: torch.dtype, cast: bool, path: Path) -> None:
    """Weights must be floating point; one that is not F32/BF16/F16 converts only with --dtype (a cast)."""
    if not dtype.is_floating_point:
        raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype}; model weights are floating point, so this "
                              "is not a Llama-family checkpoint minispec can convert")
    if not cast and dtype not in DTYPES.values():
        raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype}; pass --dtype float32, bfloat16 or float16 "
                              "to cast it")


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, overwrite: bool = False,
            progress: bool = True) -> ModelConfig:
    """Convert the Hugging Face checkpoint in `src` into a minispec checkpoint at `dst`; return its config.

    dtype: "float32", "bfloat16" or "float16" to cast the weights; None keeps them as stored.
    """
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_output_dir(dst, overwrite)  # before the work, not after it
    hf = read_json(src / "config.json")
    gen = read_json(src / "generation_config.json") if (src / "generation_config.json").is_file() else None
    cfg = config_from_hf(hf, gen)
    if cfg.bos_id is None or cfg.eos_id is None:
        bos, eos = special_ids_from_tokenizer_files(src)
        try:
            cfg = ModelConfig(**{**vars(cfg), "bos_id": cfg.bos_id if cfg.bos_id is not None else bos,
                                 "eos_id": cfg.eos_id if cfg.eos_id is not None else eos})
        except ValueError as e:
            raise ConversionError(f"{src / 'tokenizer_config.json'}: {e}") from None
    tokenizer = load_tokenizer(src)
    if tokenizer is not None and cfg.sampled_vocab_size is None and tokenizer.max_id + 1 < cfg.vocab_size:
        # the embedding has rows past the tokenizer's ids (Qwen2: 151,936 for 151,665 tokens): never sampled
        cfg.sampled_vocab_size = tokenizer.max_id + 1
    with contextlib.ExitStack() as stack:
        # minispec name -> (shape, source dtype, loader), in file order
        tensors: dict[str, _Source] = {}
        for path in find_weight_files(src):
            for hf_name, info in _open_weights(path, stack).items():
                try:
                    name = hf_to_minispec_name(hf_name)
                except CheckpointError as e:
                    raise ConversionError(f"{path}: {e}") from None
                if name is None or (name == "lm_head.weight" and cfg.tie_embeddings):
                    continue  # a cached buffer, or the copy of a tied embedding: config.json says it is shared
                if name in tensors:
                    raise ConversionError(f"tensor {hf_name!r} appears in more than one shard ({path.name} and "
                                          "another)")
                _check_dtype(hf_name, info[1], dtype is not None, path)
                tensors[name] = info
        shapes = {n: s for n, (s, _, _) in tensors.items()}
        where = f"{src} (tensor names shown without Hugging Face's 'model.' prefix)"
        check_state_dict(shapes, expected_tensors(Transformer, cfg, shapes, where), where)  # layers counted first
        out_dtype = DTYPES[dtype] if dtype else None
        entries = [TensorEntry(n, s, out_dtype or dt, load) for n, (s, dt, load) in tensors.items()]
        with atomic_output_dir(dst, overwrite=overwrite) as tmp:
            write_safetensors(tmp / WEIGHTS_NAME, entries, metadata={"format": "pt", "producer": "minispec convert_hf"},
                              show_progress=progress, desc=f"converting {src.name}")
            cfg.save(str(tmp / CONFIG_NAME))
            copy_files(src, tmp, TOKENIZER_FILES)
            check_output_loads(tmp, dst, src)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = tool_parser(__doc__.split("\n\n")[0],
                       src_help="Hugging Face checkpoint directory (config.json + weights + tokenizer)",
                       dst_help="minispec checkpoint directory to create",
                       dtype_help="cast the weights (default: as stored)").parse_args(argv)

    def job() -> str:
        cfg = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet)
        return f"wrote {args.dst}: {json.dumps({k: v for k, v in vars(cfg).items() if v is not None})}"
    return run_tool(job)


if __name__ == "__main__":
    sys.exit(main())
