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


def is_int(v) -> bool:
    """A true integer: not a bool (True is 1 in Python), not a float, not a string."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v, lo: int, hi: int | None = None) -> int:
    """`v` if it is an integer (not a bool) in [lo, hi]; else an InputError (a ValueError) naming `name`."""
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise InputError(f"{name} must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {v!r}")
    return v


class GenerationError(InputError):
    """A prompt, stop token or generation setting that generate (and speculate) refuse."""


def normalize_prompts(model, prompts) -> tuple[list[list[int]], bool]:
    """Accept list[int] or list[list[int]]; return (batch, was_single). Raises GenerationError on bad input."""
    if isinstance(prompts, str):
        raise GenerationError("prompts must be token ids; encode text with model.tokenizer.encode(text) first")
    if hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if not prompts:
        raise GenerationError("empty prompt: give at least one token id (e.g. the bos token)")
    single = not isinstance(prompts[0], (list, tuple))
    batch = [list(prompts)] if single else [list(p) for p in prompts]
    cfg = model.config
    for i, p in enumerate(batch):
        where = "prompt" if single else f"prompt {i}"
        if not p:
            raise GenerationError(f"{where} is empty: give at least one token id (e.g. the bos token)")
        for t in p:
            if not is_int(t):
                raise GenerationError(f"{where} holds {t!r}; token ids must be integers")
            if not 0 <= t < cfg.vocab_size:
                raise GenerationError(f"{where} holds token id {t}, outside the vocabulary [0, {cfg.vocab_size})")
        if len(p) > cfg.max_seq_len:
            raise GenerationError(f"{where} has {len(p)} tokens, longer than max_seq_len={cfg.max_seq_len}")
    return batch, single


def resolve_stop_tokens(model, stop_tokens) -> frozenset[int]:
    """None -> the config's eos id(s); an iterable of ids -> those ([] disables stopping)."""
    if stop_tokens is None:
        return frozenset(model.config.stop_ids)
    if isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    if isinstance(stop_tokens, str) or not hasattr(stop_tokens, "__iter__"):
        raise GenerationError(f"stop_tokens must be a list of token ids or None, got {stop_tokens!r}")
    vocab = model.config.vocab_size
    for t in stop_tokens:
        if not is_int(t) or not 0 <= t < vocab:  # 1.5 or "2" would never match
            raise GenerationError(f"stop_tokens holds {t!r}; stop tokens must be integer ids in [0, {vocab})")
    return frozenset(stop_tokens)


def check_max_new_tokens(n) -> None:
    """max_new_tokens must be an integer >= 0 (0 returns no tokens)."""
    if not is_int(n) or n < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {n!r}")


def check_compatible(target, draft) -> None:
    """Draft and target must share the vocabulary and the tokenizer: the rule compares token ids."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft vocab_size={dv} differs from target vocab_size={tv}: speculative decoding compares "
                         "token ids, so draft and target must share one tokenizer and vocabulary")
    tt, dt = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if (tt is None) != (dt is None):
        which = "target" if dt is None else "draft"
        raise ValueError(f"only the {which} has a tokenizer, so they cannot be checked to match; load both from "
                         "checkpoints with the same tokenizer (or attach the same tokenizer to both)")
    if tt is not None and tt is not dt:
        ft, fd = getattr(tt, "fingerprint", None), getattr(dt, "fingerprint", None)
        if ft != fd:
            raise ValueError(f"draft and target tokenizers differ (fingerprints {fd!r} vs {ft!r}); "
                             "speculative decoding needs one shared tokenizer")


class SamplingError(InputError):
    """A sampling setting is invalid, or leaves a row of logits nothing that can be sampled."""


def check_seed(seed) -> None:
    """None, or an integer in [0, MAX_SEED]: 2**64, 1.5 and "abc" are refused, never truncated or wrapped."""
    if seed is not None and (not is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise SamplingError(f"seed must be an integer in [0, 2**63 - 1] or None, got {seed!r}")


def check_sampling(temperature, top_k, top_p, seed) -> None:
    """The settings of a SamplingParams: each refused with a SamplingError that names it."""
    if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be a number >= 0 (0 = greedy), finite, got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise SamplingError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise SamplingError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    check_seed(seed)


def unsampleable(logits: torch.Tensor) -> str | None:
    """What makes some row of `logits` impossible to sample (NaN or +inf anywhere, or every entry -inf), or None.

    -inf alone is a probability of 0 (a subset head's other ids), so it is allowed. One device sync.
    """
    nonfinite = (torch.isnan(logits) | torch.isposinf(logits)).any()
    no_token = torch.isneginf(logits).all(-1).any()
    flags = torch.stack((nonfinite, no_token)).tolist()
    return "NaN or +inf" if flags[0] else "-inf for every token" if flags[1] else None


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


def check_proposal(drafter, rows: list[int], ks: list[int], drafts: list[list[int]]) -> None:
    """A drafter must not propose more tokens for a row than it was asked for (a bug in a custom Drafter)."""
    for k, d, row in zip(ks, drafts, rows):
        if len(d) > max(k, 0):
            raise RuntimeError(f"{type(drafter).__name__} proposed {len(d)} tokens for sequence {row}, "
                               f"more than the {k} asked for")
