"""The model over the paged cache: prefill + decode equals the full forward; config validation."""

import pytest
import torch
import torch.nn.functional as F

from minispec import ModelConfig, Transformer

from helpers import tiny_model


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_cached_decode_equals_full_forward_ragged(block_size):
    model = tiny_model(seed=1, n_kv_heads=2)
    torch.manual_seed(2)
    lens = [11, 4, 17]  # a ragged batch
    seqs_tokens = [torch.randint(0, 32, (n,)).tolist() for n in lens]
    full = [model(torch.tensor([t]))[0] for t in seqs_tokens]  # (T, V) each
    cache = model.new_cache(num_blocks=64, block_size=block_size)
    seqs = [cache.new_sequence() for _ in lens]
    prefill = [3, 1, 5]  # prompts of different lengths, in one forward
    out = model.step(cache, seqs, [t[:p] for t, p in zip(seqs_tokens, prefill)], all_logits=True)
    for b, p in enumerate(prefill):
        torch.testing.assert_close(out[b, :p], full[b][:p], atol=1e-4, rtol=0)
    pos = list(prefill)
    while True:  # decode one token at a time for every sequence that still has tokens
        live = [b for b in range(3) if pos[b] < lens[b]]
        if not live:
            break
        logits = model.step(cache, [seqs[b] for b in live], [[seqs_tokens[b][pos[b]]] for b in live])
        for row, b in enumerate(live):
            torch.testing.assert_close(logits[row], full[b][pos[b]], atol=1e-4, rtol=0)
            pos[b] += 1
    cache.check_consistency()


def test_multi_token_steps_after_truncate_match_full_forward():
    """Verify-style steps (several tokens at once) after a rollback read no stale entries."""
    model = tiny_model(seed=3)
    tokens = torch.randint(0, 32, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    full = model(torch.tensor([tokens]))[0]
    cache = model.new_cache(num_blocks=16, block_size=3)
    (s,) = [cache.new_sequence()]
    model.step(cache, [s], [tokens[:6]])
    model.step(cache, [s], [[7, 8, 9, 10, 11]])  # a speculative run that gets rejected
    cache.truncate(s, 6)
    out = model.step(cache, [s], [tokens[6:12]], all_logits=True)[0]
    torch.testing.assert_close(out, full[6:12], atol=1e-4, rtol=0)


def test_forward_keeps_no_state(model):
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    a = model(x)
    model(torch.randint(0, 32, (1, 5)))
    assert torch.equal(model(x), a)
    assert a.shape == (2, 9, 32) and a.dtype == torch.float32


def test_bf16_runs_close_to_fp32():
    model = tiny_model(seed=5)
    x = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = model(x)
    low = model.to(torch.bfloat16)(x)
    assert (low - ref).abs().max() < 0.1


def test_config_derives_only_unset_fields():
    c = ModelConfig(vocab_size=10, dim=64, n_layers=1, n_heads=8)
    assert (c.n_kv_heads, c.head_dim, c.ffn_dim) == (8, 8, 256)
    c = ModelConfig(vocab_size=10, dim=64, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=100)
    assert (c.n_kv_heads, c.head_dim, c.ffn_dim) == (2, 16, 100)
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw, msg", [
    (dict(n_heads=8, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(n_heads=5), "not divisible"),
    (dict(eos_id=99), "outside the vocabulary"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "not supported"),
    (dict(sampled_vocab_size=0), "sampled_vocab_size must be in"),
    (dict(sampled_vocab_size=17), "sampled_vocab_size must be in"),
])
def test_bad_config(kw, msg):
    base = dict(vocab_size=16, dim=32, n_layers=1, n_heads=4)
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**base)


def test_forward_rejects_bad_ids(model):
    with pytest.raises(ValueError, match="token id 32 is outside the vocabulary"):
        model(torch.tensor([[1, 32]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_subset_head_scores_only_its_ids(tmp_path):
    """A draft's frequent-token head: logits outside head_ids are -inf, so their probability is exactly 0."""
    model = tiny_model(seed=6, tie_embeddings=False, head_vocab_size=5)
    with torch.no_grad():
        model.head_ids.copy_(torch.tensor([3, 9, 0, 31, 17]))
    x = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(2))
    logits = model(x)
    finite = torch.isfinite(logits[0, -1]).nonzero().flatten().tolist()
    assert finite == [0, 3, 9, 17, 31]
    h = model._trunk(x, torch.arange(6).view(1, 6))
    torch.testing.assert_close(logits[0, :, 9], (h @ model.lm_head.weight.T)[0, :, 1])
    model.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    loaded = Transformer.from_pretrained(tmp_path / "d")
    assert loaded.head_ids.tolist() == [3, 9, 0, 31, 17] and loaded.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs tie_embeddings=False"):
        ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, head_vocab_size=5)


def _padded_vocab_model(seed: int, sampled: int | None) -> Transformer:
    """A tiny model whose ids 24..31 have by far the largest logits: real rows near 0, the last 8 rows at std ~6,
    so at nearly every position one of them is far ahead; unmasked, they are sampled nearly always."""
    model = tiny_model(seed=seed, tie_embeddings=False, sampled_vocab_size=sampled)
    with torch.no_grad():
        model.lm_head.weight[:24] *= 0.01
        model.lm_head.weight[24:] *= 50.0
    return model


def test_padding_ids_are_never_sampled():
    """Ids at or above sampled_vocab_size (padding rows of an embedding, as in Qwen2's) get logit -inf and are
    never produced: by generate and speculate at temperature 1, from a target and a draft that both favour them."""
    target, draft = _padded_vocab_model(0, sampled=24), _padded_vocab_model(1, sampled=24)
    x = torch.randint(0, 24, (2, 5), generator=torch.Generator().manual_seed(3))
    logits = target(x)
    assert torch.isneginf(logits[..., 24:]).all() and torch.isfinite(logits[..., :24]).all()
    cache = target.new_cache(num_blocks=8)
    assert torch.isneginf(target.step(cache, [cache.new_sequence()], [x[0].tolist()])[..., 24:]).all()
    prompts = [[1, 2, 3], [7]]
    for seed in range(3):
        for out in (target.generate(prompts, max_new_tokens=24, temperature=1.0, seed=seed, stop_tokens=[]),
                    target.speculate(draft, prompts, k=3, max_new_tokens=24, temperature=1.0, seed=seed,
                                     stop_tokens=[]).tokens):
            assert all(len(t) == 24 and max(t) < 24 for t in out), out
    # negative control: the same weights without the bound sample the padding ids almost every time
    unmasked = _padded_vocab_model(0, sampled=None)
    out = unmasked.generate(prompts, max_new_tokens=24, temperature=1.0, seed=0, stop_tokens=[])
    assert sum(t >= 24 for seq in out for t in seq) > 40  # of 48


def test_an_int4_model_stays_close_and_drafts_exactly(tmp_path):
    target = tiny_model(seed=3, scale=3.0)
    tok = torch.tensor([[1, 5, 9, 2, 7, 3]])
    ref = target(tok)
    target.config.int4 = True  # recorded in config.json: a plain from_pretrained loads the int4 form
    target.save_pretrained(tmp_path / "d")
    target.config.int4 = False
    draft = Transformer.from_pretrained(tmp_path / "d")
    assert draft.config.int4 and draft.dtype == torch.float32 and draft.head_packed is not None
    assert not any(p.dim() == 2 for n, p in draft.named_parameters() if n != "embed_tokens.weight")
    got = draft(tok)
    assert not torch.equal(got, ref) and (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    assert not Transformer.from_pretrained(tmp_path / "d", int4=False).config.int4
    assert Transformer.from_pretrained(tmp_path / "d", dtype=torch.float16).dtype == torch.float16  # float: as asked
    with pytest.raises(ValueError, match="float32"):
        Transformer.from_pretrained(tmp_path / "d", dtype=torch.float16, int4=True)
    with pytest.raises(ValueError, match="not saved"):
        draft.save_pretrained(tmp_path / "e")
    assert not (tmp_path / "e").exists()
    prompt = [1, 5, 9, 2]
    res = target.speculate(draft, prompt, k=3, max_new_tokens=24, temperature=0.0, stop_tokens=[])
    assert res.tokens == target.generate(prompt, max_new_tokens=24, temperature=0.0, stop_tokens=[])


def _decode_and_verify_logits(m: Transformer, prompt: list[int], new: list[int], block_size: int, scatter: bool):
    """Logits at each of `new` from one decode step per token, and from one pass over all of them (a verify)."""
    out = []
    for one_pass in (False, True):
        cache = m.new_cache(num_blocks=64, block_size=block_size)
        if scatter:  # another sequence takes blocks in between: this one's slots are not consecutive (the gather path)
            other = cache.new_sequence()
        s = cache.new_sequence()
        for j, chunk in enumerate([prompt[:3], prompt[3:]]):
            m.step(cache, [s], [chunk])
            if scatter:
                m.step(cache, [other], [[j + 1] * block_size])
        if one_pass:
            out.append(m.step(cache, [s], [new], all_logits=True)[0])
        else:
            out.append(torch.stack([m.step(cache, [s], [[t]])[0] for t in new]))
    return out


@pytest.mark.parametrize("scatter", [False, True])
def test_a_bfloat16_decode_step_computes_the_bits_of_a_verify_pass(monkeypatch, scatter):
    """In bf16 a row's logits must not depend on how many tokens its pass holds, or greedy speculation would drift
    from greedy generation at near-ties: one-row products are computed as two (kernels.linear) and a pass over
    several tokens attends row by row (kernels.row_wise_attention). Negative controls: SDPA over all rows at
    once, and the kernels' switch off (which gives that guarantee up, as minispec.kernels says)."""
    from minispec import kernels
    torch.manual_seed(3)
    m = Transformer(ModelConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=128,
                                qkv_bias=True), dtype=torch.bfloat16)
    prompt, new = [5, 17, 3, 90, 41, 8, 8, 60, 2, 77, 13], [33, 4, 71, 71, 12, 9, 50, 1, 26]
    for block_size in (4, 16):
        dec, ver = _decode_and_verify_logits(m, prompt, new, block_size, scatter)
        assert torch.equal(dec, ver)
    x = torch.randn(7, 64).bfloat16()
    w = m.embed_tokens.weight
    assert torch.equal(kernels.linear(x[:1], w), kernels.linear(x, w)[:1])
    assert torch.equal(kernels.linear(x[:1].view(1, 1, 64), w), kernels.linear(x[:2].view(2, 1, 64), w)[:1])

    def all_rows(q, ctx, n_kv_heads):  # one SDPA call over every row, causal by its mask
        T, L = q.shape[2], ctx.shape[2]
        mask = torch.arange(L).view(1, L) <= torch.arange(L - T, L).view(T, 1)
        return F.scaled_dot_product_attention(q, ctx[:, :n_kv_heads], ctx[:, n_kv_heads:], attn_mask=mask,
                                              enable_gqa=True)
    with kernels.plain():
        dec, ver = _decode_and_verify_logits(m, prompt, new, 16, scatter)
    assert torch.allclose(dec.float(), ver.float(), atol=0.1) and not torch.equal(dec, ver)
    monkeypatch.setattr(kernels, "row_wise_attention", all_rows)
    dec, ver = _decode_and_verify_logits(m, prompt, new, 16, scatter)
    assert torch.allclose(dec.float(), ver.float(), atol=0.1) and not torch.equal(dec, ver)
