"""The errors minispec raises for input it refuses, and the core's input checks.

minispec reads files that come from strangers (checkpoints, GGUF files, tokenizers, chat
templates) and settings that come from users. Everything it refuses raises an `InputError`:
a ValueError whose one-line message names the file, field, tensor, setting or argument and
says what to do. Each area has its own subclass (ConfigError, CheckpointError,
TokenizerError, SamplingError, GenerationError, the converters' ConversionError), so a caller
can catch one area or all of them; an exception of any other type escaping a loader is a bug in
minispec. The checks of the core's arguments (prompts, stop tokens, sampling settings, logits, a
draft/target pair) live here, so the core reads as the algorithm; other areas keep theirs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping

import torch

MAX_SEED = 2**63 - 1  # seeds are non-negative and fit a signed 64-bit int (sequence i of a batch uses seed + i)


class InputError(ValueError):
    """A file, field, tensor, setting or argument that minispec refuses; the message says which and what to do."""


def show(value, limit: int = 60) -> str:
    """A short repr of `value` for an error message (a 10 MB string or a 4000-digit number stays one short line)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for str() (Python's 4300-digit limit)
        text = f"<int of about {value.bit_length() * 3 // 10} digits>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(e: BaseException) -> str:
    """An error's message on one line, as the command line prints it (some libraries' messages span several)."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: a MemoryError (Python's, numpy's), torch's OutOfMemoryError, or the
    RuntimeError torch's CPU allocator raises ("not enough memory"), which no other type marks."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "not enough memory" in str(e))


def check_callable(name: str, v, error: type[InputError] = InputError) -> None:
    """None or a callable: a callback given as something else (on_tokens=42) is refused before any work, not at
    its first call."""
    if v is not None and not callable(v):
        raise error(f"{name} must be a callable or None, got {show(v)}")


def is_int(v) -> bool:
    """A true integer: not a bool (True is 1 in Python), not a float, not a string."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v, lo: int, hi: int | None = None, error: type[InputError] = InputError) -> int:
    """`v` if it is an integer (not a bool) in [lo, hi]; else `error` (an InputError, so a ValueError) naming `name`."""
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise error(f"{name} must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {show(v)}")
    return v


class GenerationError(InputError):
    """A prompt, stop token or generation setting that generate (and speculate) refuse."""


def token_id(v) -> int | None:
    """`v` as a Python int if it is an integer token id: an int, or a numpy or torch integer scalar (what
    transformers-style callers hold); None for a bool, a float, a string or anything else."""
    if isinstance(v, bool) or type(v).__name__ in ("bool_", "bool"):  # numpy's bool is not Python's bool
        return None
    try:
        i = operator.index(v)
    except TypeError:
        return None
    return None if isinstance(i, bool) else i


def _is_id_list(v) -> bool:
    """A list, tuple or 1-d (or deeper) array of something: one prompt of a batch, not a token id."""
    return isinstance(v, (list, tuple)) or (hasattr(v, "tolist") and getattr(v, "ndim", 0) >= 1)


def _listed(v, what: str) -> list:
    """An iterable argument as a list, read once (an iterator stays usable); a GenerationError for what is no list."""
    if hasattr(v, "tolist"):  # numpy arrays, torch tensors
        v = v.tolist()
    if v is None or isinstance(v, (str, bytes, Mapping, set, frozenset)) or not isinstance(v, Iterable):
        raise GenerationError(f"{what} must be a list of token ids (or a list of such lists), got {type(v).__name__}"
                              + ("; encode text with model.tokenizer.encode(text) first" if isinstance(v, str) else ""))
    return list(v)


def normalize_prompts(model, prompts) -> tuple[list[list[int]], bool]:
    """Accept list[int] or list[list[int]] (numpy or torch integers too); return (batch, was_single) as Python ints.

    Raises GenerationError on anything else: None, a string, a dict, floats, a mix of ids and lists."""
    if isinstance(prompts, str):
        raise GenerationError("prompts must be token ids; encode text with model.tokenizer.encode(text) first")
    prompts = _listed(prompts, "prompts")
    if not prompts:
        raise GenerationError("empty prompt: give at least one token id (e.g. the bos token)")
    single = not _is_id_list(prompts[0])
    if single:
        raw = [prompts]
    else:
        raw = []
        for i, p in enumerate(prompts):
            if not _is_id_list(p):
                raise GenerationError(f"prompt {i} is {show(p)}: a batch is a list of prompts, each a list of "
                                      "token ids")
            raw.append(_listed(p, f"prompt {i}"))
    cfg = model.config
    batch = []
    for i, p in enumerate(raw):
        where = "prompt" if single else f"prompt {i}"
        if not p:
            raise GenerationError(f"{where} is empty: give at least one token id (e.g. the bos token)")
        ids = [token_id(t) for t in p]
        for t, v in zip(ids, p):
            if t is None:
                raise GenerationError(f"{where} holds {show(v)}; token ids must be integers")
            if not 0 <= t < cfg.vocab_size:
                raise GenerationError(f"{where} holds token id {show(t)}, outside the vocabulary "
                                      f"[0, {cfg.vocab_size})")
        if len(ids) > cfg.max_seq_len:
            raise GenerationError(f"{where} has {len(ids)} tokens, longer than max_seq_len={cfg.max_seq_len}")
        batch.append(ids)
    return batch, single


def resolve_stop_tokens(model, stop_tokens) -> frozenset[int]:
    """None -> the config's eos id(s); one id or any iterable of ids (read once) -> those ([] disables stopping)."""
    if stop_tokens is None:
        return frozenset(model.config.stop_ids)
    if hasattr(stop_tokens, "tolist"):  # numpy arrays and torch tensors, 0-d ones included
        stop_tokens = stop_tokens.tolist()
    if token_id(stop_tokens) is not None:
        stop_tokens = [stop_tokens]
    if isinstance(stop_tokens, (str, bytes, Mapping)) or not isinstance(stop_tokens, Iterable):
        raise GenerationError(f"stop_tokens must be a list of token ids or None, got {show(stop_tokens)}")
    given = list(stop_tokens)  # an iterator is read once: the check below and the set both use this list
    vocab = model.config.vocab_size
    ids = [token_id(t) for t in given]
    for t, v in zip(ids, given):
        if t is None or not 0 <= t < vocab:  # 1.5 or "2" would never match
            raise GenerationError(f"stop_tokens holds {show(v)}; stop tokens must be integer ids in [0, {vocab})")
    return frozenset(ids)


def check_max_new_tokens(n) -> None:
    """max_new_tokens must be an integer >= 0 (0 returns no tokens)."""
    if not is_int(n) or n < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {show(n)}")


def check_compatible(target, draft) -> None:
    """Draft and target must share the vocabulary and the tokenizer: the acceptance rule compares token ids.

    The one check of a draft/target pair, wherever a pair is formed (speculate, the command line, the harness)."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise GenerationError(f"draft vocab_size={dv} differs from target vocab_size={tv}: speculative decoding "
                              "compares token ids, so draft and target must share one tokenizer and vocabulary")
    tt, dt = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if (tt is None) != (dt is None):
        which = "target" if dt is None else "draft"
        raise GenerationError(f"only the {which} has a tokenizer, so they cannot be checked to match; load both "
                              "from checkpoints with the same tokenizer (or attach the same tokenizer to both)")
    if tt is not None and tt is not dt:
        ft, fd = getattr(tt, "fingerprint", None), getattr(dt, "fingerprint", None)
        if ft != fd:
            raise GenerationError(f"draft and target tokenizers differ (fingerprints {fd!r} vs {ft!r}); "
                                  "speculative decoding needs one shared tokenizer")


class SamplingError(InputError):
    """A sampling setting is invalid, or leaves a row of logits nothing that can be sampled."""


def check_seed(seed) -> None:
    """None, or an integer in [0, MAX_SEED]: 2**64, 1.5 and "abc" are refused, never truncated or wrapped."""
    if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise SamplingError(f"seed must be an integer in [0, 2**63 - 1] or None, got {show(seed)}")


def check_sampling(temperature, top_k, top_p) -> None:
    """The settings of a SamplingParams: each refused with a SamplingError that names it."""
    if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be a number >= 0 (0 = greedy), finite, got {show(temperature)}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise SamplingError(f"top_k must be an integer >= 1 or None, got {show(top_k)}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise SamplingError(f"top_p must be in (0, 1] or None, got {show(top_p)}")


def unsampleable(logits: torch.Tensor) -> str | None:
    """What makes some row of `logits` impossible to sample (NaN or +inf anywhere, or every entry -inf), or None.

    -inf alone is a probability of 0 (a subset head's other ids), so it is allowed. One pass over the logits
    and one device sync: a row's max is NaN if it holds a NaN (amax propagates it), +inf if it holds +inf and
    -inf only if every entry is -inf, so it is finite exactly when the row can be sampled.
    """
    top = logits.amax(-1)
    if bool(torch.isfinite(top).all()):
        return None
    return "NaN or +inf" if bool((torch.isnan(top) | torch.isposinf(top)).any()) else "-inf for every token"


def check_logits(logits: torch.Tensor) -> None:
    """Refuse model logits that no setting can sample from (see unsampleable), greedy included."""
    what = unsampleable(logits)
    if what is not None:
        raise SamplingError(f"the model's logits are {what} in some row: nothing can be sampled; the checkpoint's "
                            "weights or config (norm_eps, rope_theta, rope_scaling) are likely corrupt")


def check_token_ids(tokens, vocab_size: int) -> None:
    """Refuse a tensor (or nested list) of token ids with one outside [0, vocab_size)."""
    t = torch.as_tensor(tokens)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        bad = int(t.max()) if int(t.max()) >= vocab_size else int(t.min())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_proposal(drafter, rows: list[int], ks: list[int], proposal, vocab_size: int) -> tuple[list, list]:
    """What a drafter's propose() returned, checked: per row at most k integer ids in the vocabulary, each with
    its (n, V) distribution. A GenerationError naming the drafter's class (a bug in a custom Drafter) rather
    than a broadcasting or indexing error inside the acceptance step. Returns (drafts as lists of Python ints, qs)."""
    name = type(drafter).__name__
    drafts, qs = proposal if isinstance(proposal, tuple) and len(proposal) == 2 else (None, None)
    listed = isinstance(drafts, (list, tuple)) and isinstance(qs, (list, tuple))
    if not (listed and len(drafts) == len(qs) == len(rows)):
        raise GenerationError(f"{name}.propose must return (tokens, q): two lists with one entry per row asked for "
                              f"({len(rows)})")
    out = []
    for k, d, q, row in zip(ks, drafts, qs, rows):
        d = d.tolist() if hasattr(d, "tolist") else d
        if not isinstance(d, (list, tuple)):
            raise GenerationError(f"{name} proposed {show(d)} for sequence {row}; a draft is a list of token ids")
        if len(d) > max(k, 0):
            raise GenerationError(f"{name} proposed {len(d)} tokens for sequence {row}, more than the {k} asked for")
        ids = [token_id(t) for t in d]
        bad = next((v for t, v in zip(ids, d) if t is None or not 0 <= t < vocab_size), None)
        if bad is not None or any(t is None for t in ids):
            raise GenerationError(f"{name} proposed token {show(bad)} for sequence {row}, not an id in the "
                                  f"vocabulary [0, {vocab_size})")
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else None
        if shape != (len(d), vocab_size):
            raise GenerationError(f"{name} returned q of shape {shape if shape is not None else type(q).__name__} "
                                  f"for sequence {row}; it must be a ({len(d)}, {vocab_size}) tensor: one "
                                  "distribution over the vocabulary per proposed token")
        out.append(ids)
    return out, list(qs)


def resolve_dtype(dtype, names: dict[str, torch.dtype]) -> torch.dtype | None:
    """None, a floating torch.dtype, or one of `names` (minispec.config.DTYPES: "float16", ...) -> a torch.dtype
    or None. Anything else is an InputError: a string is never handed to torch to be read some other way."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    raise InputError(f"dtype must be None, a floating torch.dtype or one of {', '.join(names)}, got {show(dtype)}")


def resolve_device(device) -> torch.device | None:
    """None, or a device torch can use on this machine, as a torch.device; an InputError naming it otherwise
    ("potato", "cuda" on a machine without CUDA, "cuda:7" on one with two GPUs, "meta")."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"{show(device)} is not a device (cpu, cuda, cuda:1, mps, ...)") from None
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if dev.type == "meta" or backend is None or not hasattr(backend, "is_available"):
        raise InputError(f"device {str(dev)!r} cannot run a model here; use cpu or cuda")
    if not backend.is_available():
        raise InputError(f"device {str(dev)!r} is not available on this machine (torch {torch.__version__} sees no "
                         f"{dev.type}); use cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise InputError(f"device {str(dev)!r} does not exist: this machine has {count} {dev.type} device(s)")
    return dev
