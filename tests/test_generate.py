"""generate: greedy equals step-by-step argmax of the full forward; batching; seeds; stop tokens; bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_model

MODEL = tiny_model(seed=0, scale=5.0)


def reference_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=20), n=st.integers(1, 12),
       block_size=st.sampled_from([1, 2, 5, 16]))
def test_greedy_equals_full_forward_argmax(prompt, n, block_size):
    out = MODEL.generate(prompt, max_new_tokens=n, temperature=0.0, stop_tokens=[], block_size=block_size)
    assert out == reference_greedy(MODEL, prompt, n)


def test_batched_equals_one_by_one():
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    batch = MODEL.generate(prompts, max_new_tokens=10, stop_tokens=[])
    assert batch == [MODEL.generate(p, max_new_tokens=10, stop_tokens=[]) for p in prompts]
    # sampling: sequence i of a batch draws from seed + i, so it equals the single run with that seed
    sampled = MODEL.generate(prompts, max_new_tokens=10, temperature=1.0, seed=7, stop_tokens=[])
    assert sampled == [MODEL.generate(p, max_new_tokens=10, temperature=1.0, seed=7 + i, stop_tokens=[])
                       for i, p in enumerate(prompts)]


def test_same_seed_same_tokens_and_different_seed_differs():
    kw = dict(max_new_tokens=20, temperature=1.2, top_k=10, top_p=0.95, stop_tokens=[])
    a = MODEL.generate([1, 2, 3], seed=3, **kw)
    assert a == MODEL.generate([1, 2, 3], seed=3, **kw)
    assert a != MODEL.generate([1, 2, 3], seed=4, **kw)


def test_stop_tokens_end_a_sequence_and_stay_in_output():
    free = MODEL.generate([1, 2, 3], max_new_tokens=12, stop_tokens=[])
    stop = free[4]
    out = MODEL.generate([1, 2, 3], max_new_tokens=12, stop_tokens=[stop])
    assert out == free[:free.index(stop) + 1]


def test_streaming_callback_sees_every_token_in_order():
    seen = {0: [], 1: []}
    out = MODEL.generate([[1, 2], [3]], max_new_tokens=6, stop_tokens=[], on_tokens=lambda i, t: seen[i].extend(t))
    assert [seen[0], seen[1]] == out


def test_stops_at_max_seq_len():
    model = tiny_model(seed=0, max_seq_len=10)
    assert len(model.generate([1, 2, 3, 4, 5, 6, 7], max_new_tokens=20, stop_tokens=[])) == 3
    assert model.generate(list(range(10)), max_new_tokens=5) == []


@pytest.mark.parametrize("prompt, kw, msg", [
    ([], {}, "empty prompt"),
    ([[1], []], {}, "prompt 1 is empty"),
    ([1, 32], {}, "token id 32, outside the vocabulary"),
    ([1, -1], {}, "token id -1"),
    ([1] * 129, {}, "longer than max_seq_len"),
    ("hello", {}, "encode text"),
    ([1], dict(temperature=-0.5), "temperature must be a number >= 0"),
    ([1], dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ([1], dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ([1], dict(top_k=0), "top_k must be an integer >= 1"),
    ([1], dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
])
def test_bad_input(prompt, kw, msg):
    with pytest.raises(ValueError, match=msg):
        MODEL.generate(prompt, **kw)
