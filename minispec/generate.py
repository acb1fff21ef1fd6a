"""Autoregressive generation over the paged KV cache: prefill, then one token per step.

`generate` takes one prompt (a list of ids) or a ragged batch (a list of lists). All sequences are prefilled
together in one forward pass, then decode together; a sequence that stops leaves the batch and frees its blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from .cache import MAX_BLOCK_SIZE
from .errors import (
    GenerationError,
    check_callable,
    check_int,
    check_logits,
    check_max_new_tokens,
    check_seed,
    normalize_prompts,
    resolve_stop_tokens,
)
from .sampling import SamplingParams, logits_to_probs, make_generators, sample
from .threads import as_caller, decoding_loop

OnTokens = Callable[[int, list[int]], None]  # (index of the sequence in the batch, newly committed tokens)


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens=None,
             on_tokens: OnTokens | None = None, block_size: int = 16):
    """Generate up to max_new_tokens after each prompt: list[int] (one prompt) or list[list[int]] (a ragged batch).

    temperature 0 is greedy; top_k / top_p filter as in Hugging Face.
    seed: sequence i of a batch samples from a generator seeded with seed + i.
    stop_tokens: ids that end a sequence (kept in the output); None = the eos id(s). max_seq_len also ends it.
    on_tokens(i, tokens): called as tokens are committed, for streaming.
    Returns the new tokens only: list[int], or list[list[int]] for a batch.
    """
    params = SamplingParams(temperature, top_k, top_p)
    check_seed(seed)
    check_max_new_tokens(max_new_tokens)
    check_callable("on_tokens", on_tokens, GenerationError)
    check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
    batch, single = normalize_prompts(model, prompts)
    stops = resolve_stop_tokens(model, stop_tokens)
    out: list[list[int]] = [[] for _ in batch]
    budget = [min(max_new_tokens, model.config.max_seq_len - len(p)) for p in batch]  # prompt + output <= max_seq_len
    active = [i for i in range(len(batch)) if budget[i] > 0]
    if not active:
        return out[0] if single else out
    with decoding_loop():  # PyTorch at one thread between the steps
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
                    as_caller(on_tokens, i, [tok])
                if tok in stops or len(out[i]) >= budget[i]:
                    cache.free(seqs[i])
                else:
                    still.append(i)
                    next_tokens.append([tok])
            active = still
            if active:
                logits = model.step(cache, [seqs[i] for i in active], next_tokens)
    return out[0] if single else out
