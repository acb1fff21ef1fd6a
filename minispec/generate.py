"""Autoregressive generation over the paged KV cache: prefill, then one token per step.

`generate` takes one prompt (a list of ids) or a ragged batch (a list of
lists). All sequences are prefilled together in one forward pass, then decode
together; a sequence that stops leaves the batch and frees its blocks.
"""

from __future__ import annotations

from typing import Callable

from .cache import MAX_BLOCK_SIZE
from .errors import InputError, check_int, is_int
from .sampling import SamplingParams, check_logits, logits_to_probs, make_generators, sample

OnTokens = Callable[[int, list[int]], None]  # (index of the sequence in the batch, newly committed tokens)


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
    if not is_int(n) or n < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {n!r}")


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens=None,
             on_tokens: OnTokens | None = None, block_size: int = 16):
    """Generate up to max_new_tokens after each prompt.

    prompts: list[int] (one prompt) or list[list[int]] (a ragged batch).
    temperature 0 is greedy; top_k / top_p filter as in Hugging Face.
    seed: sequence i of a batch samples from a generator seeded with seed + i.
    stop_tokens: ids that end a sequence (kept in the output); None = the eos id(s).
    on_tokens(i, tokens): called as tokens are committed, for streaming.
    A sequence also stops at the model's max_seq_len.
    Returns the new tokens only: list[int], or list[list[int]] for a batch.
    """
    params = SamplingParams(temperature, top_k, top_p, seed)
    check_max_new_tokens(max_new_tokens)
    check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
    batch, single = normalize_prompts(model, prompts)
    stops = resolve_stop_tokens(model, stop_tokens)
    out: list[list[int]] = [[] for _ in batch]
    if max_new_tokens == 0:
        return out[0] if single else out
    max_len = model.config.max_seq_len
    budget = [min(max_new_tokens, max_len - len(p)) for p in batch]  # prompt + output <= max_seq_len
    active = [i for i in range(len(batch)) if budget[i] > 0]
    if not active:
        return out[0] if single else out
    cache = model.new_cache(block_size=block_size)  # grows by blocks as the sequences do; nothing reserved up front
    gens = make_generators(seed, len(batch))
    seqs = {i: cache.new_sequence() for i in active}
    logits = model.step(cache, [seqs[i] for i in active], [batch[i] for i in active])  # prefill: (B, vocab)
    while active:
        if params.greedy:  # the one-hot distribution's only token: no need to build and sample it
            check_logits(logits)  # NaN logits would otherwise "pick" the NaN's index
            picks = logits.argmax(-1).tolist()
        else:
            probs = logits_to_probs(logits, params)
            picks = [sample(probs[row], gens[i]) for row, i in enumerate(active)]
        still, next_tokens = [], []
        for row, i in enumerate(active):
            tok = picks[row]
            out[i].append(tok)
            if on_tokens is not None:
                on_tokens(i, [tok])
            if tok in stops or len(out[i]) >= budget[i]:
                cache.free(seqs[i])
            else:
                still.append(i)
                next_tokens.append([tok])
        active = still
        if active:
            logits = model.step(cache, [seqs[i] for i in active], next_tokens)
    return out[0] if single else out
