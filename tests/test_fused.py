"""A kept model's blocks as one compiled call a pass (minispec.fused, native/ms_layer.h).

- It is the path a kept model takes wherever a product library is built, and computes what the PyTorch blocks
  compute (within the rounding of the products' 8-bit activations; a broken RoPE, the control, is far outside).
- Every row alone: a verify pass, a ragged batch and a tree pass give each position the bits its decode steps give
  it, at 1 and 2 threads; greedy speculation equals greedy generation through it.
- The switch off, or a model it cannot take, runs the PyTorch blocks.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from test_quantized import batch_against_alone, kept_dir  # noqa: F401 - kept_dir is a fixture

from minispec import Transformer, fused, ggml, kernels
from minispec import model as model_module

pytest.importorskip("gguf")


@pytest.fixture(scope="module", params=["iqk", "ggml"])
def kept(kept_dir, request) -> Transformer:  # noqa: F811
    if (ggml._iqk_library() if request.param == "iqk" else ggml._library()) is None:
        pytest.skip(f"the {request.param} product is not built (python tools/build_ggml.py)")
    with mock.patch.dict(os.environ, {"MINISPEC_PRODUCT": request.param}):
        return Transformer.from_pretrained(kept_dir)


PROMPT, NEW = [1, 5, 3, 9, 4, 12, 7, 2], [10, 11, 6, 8, 3]


def passes(model, blocks: bool) -> list[torch.Tensor]:
    """A prefill, a decode step and a 5-row pass, every row's logits, with the compiled blocks or without."""
    model._fused = False if blocks else None
    cache = model.new_cache()
    s = cache.new_sequence()
    out = [model.step(cache, [s], [PROMPT], all_logits=True), model.step(cache, [s], [[4]], all_logits=True),
           model.step(cache, [s], [NEW], all_logits=True)]
    model._fused = False  # built again at the next pass
    return out


def test_a_kept_model_runs_its_blocks_as_one_compiled_call(kept):
    cache = kept.new_cache()
    kept.step(cache, [cache.new_sequence()], [PROMPT])
    assert isinstance(kept._fused, fused.Blocks) and len(kept._fused.blocks) == len(kept.layers)
    with mock.patch.object(fused.Blocks, "run", side_effect=AssertionError("not to be called")):
        with kernels.plain():  # the switch off: the PyTorch blocks
            kept(torch.tensor([PROMPT]))
            cache = kept.new_cache()
            kept.step(cache, [cache.new_sequence()], [PROMPT])
        with pytest.raises(AssertionError):
            cache = kept.new_cache()
            kept.step(cache, [cache.new_sequence()], [PROMPT])


def test_the_compiled_blocks_compute_what_the_pytorch_blocks_do(kept):
    # the same maths in another order: each side's activations rounded to 8 bits a block before a product, so a value
    # near a rounding boundary may round the other way; 0.5% of the logits' range bounds it
    for a, b in zip(passes(kept, True), passes(kept, False)):
        assert (a - b).abs().max() <= 5e-3 * b.abs().max()
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_the_closeness_check_catches_a_broken_block(kept):
    """The control: RoPE's sine table zeroed (keys and queries not rotated) moves the logits far past the bound."""
    good = passes(kept, False)
    kept._rope_tables(64)
    sin = kept.rope_sin.clone()
    kept.rope_sin.zero_()
    try:
        broken = passes(kept, True)
    finally:
        kept.rope_sin.copy_(sin)
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(broken, good)) > 5e-3


@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_count_gives_each_position_its_decode_steps_bits(kept, threads):
    cache = kept.new_cache()
    s = cache.new_sequence()
    kept.step(cache, [s], [PROMPT])
    f = cache.fork(s)
    new = [(3 * i + 1) % 16 for i in range(16)]
    with mock.patch.object(model_module, "product_threads", lambda: threads):
        one = torch.stack([kept.step(cache, [s], [[t]])[0] for t in new])
        for rows in (2, 5, 9, 16):
            g = cache.fork(f)
            assert torch.equal(kept.step(cache, [g], [new[:rows]], all_logits=True)[0], one[:rows]), rows
            cache.free(g)
    assert isinstance(kept._fused, fused.Blocks)


def test_a_ragged_batch_gives_each_position_its_own_decode_steps_bits(kept):
    batch, alone = batch_against_alone(kept)
    assert torch.equal(batch, alone)


def test_a_tree_pass_gives_each_node_the_bits_of_its_path_decoded(kept):
    cache = kept.new_cache()
    s = cache.new_sequence()
    kept.step(cache, [s], [PROMPT])
    f = cache.fork(s)
    tokens, parents = [4, 12, 7, 2, 10], [-1, 0, 0, 1, 2]  # two branches under the first node
    at = len(PROMPT)  # parents are indices in the sequence: the first node follows the prompt's last token
    tree = kept.step(cache, [s], [tokens], all_logits=True, parents=[[at + p for p in parents]])[0]
    for node in range(len(tokens)):
        path, n = [], node
        while n >= 0:
            path.insert(0, tokens[n])
            n = parents[n]
        g = cache.fork(f)
        assert torch.equal(kept.step(cache, [g], [path], all_logits=True)[0, -1], tree[node]), node
        cache.free(g)


def test_greedy_speculation_equals_greedy_generation_through_the_blocks(kept, kept_dir):  # noqa: F811
    draft = Transformer.from_pretrained(kept_dir, int4=False)
    prompts = [[1, 5, 3], [4, 12, 7, 2, 10, 11]]
    want = kept.generate(prompts, max_new_tokens=10, stop_tokens=[])
    for k in (2, 4):
        assert kept.speculate(draft, prompts, k=k, max_new_tokens=10, stop_tokens=[]).tokens == want
    assert isinstance(kept._fused, fused.Blocks)


def test_a_model_whose_blocks_are_not_all_compiled_products_runs_in_pytorch(kept_dir):  # noqa: F811
    with mock.patch.object(ggml, "available", lambda: False):  # the PyTorch forms
        model = Transformer.from_pretrained(kept_dir)
    assert fused.Blocks.build(model) is None
    cache = model.new_cache()
    model.step(cache, [cache.new_sequence()], [PROMPT])
    assert model._fused is None


def test_a_failing_product_is_an_error_not_a_half_computed_pass(kept):
    blocks = fused.Blocks.build(kept)
    blocks.blocks[0].o.type = 9999  # a type no product takes: the call returns its error code
    cache = kept.new_cache()
    kept._fused = blocks
    try:
        with pytest.raises(RuntimeError, match="refused"):
            kept.step(cache, [cache.new_sequence()], [PROMPT])
    finally:
        kept._fused = False


def test_the_blocks_run_in_their_products_library_and_never_mix_two(kept):
    """Each library has its own thread pool: the blocks' own work runs in the library of their products, and a model
    whose blocks' products come from two libraries runs its PyTorch blocks (two pools taking turns fight for the
    cores)."""
    blocks = fused.Blocks.build(kept)
    libs = {w.lib._handle for layer in kept.layers for w in fused._matrices(layer)}
    assert libs == {blocks.lib._handle}
    other = ggml._library() if blocks.lib._handle == getattr(ggml._iqk_library(), "_handle", None) else \
        ggml._iqk_library()
    if other is None:
        pytest.skip("one product library built: nothing to mix")
    w = kept.layers[0].mlp.down_proj.weight
    before = w.lib
    w.lib = other  # as a matrix the other library took would be
    try:
        assert fused.Blocks.build(kept) is None
    finally:
        w.lib = before
