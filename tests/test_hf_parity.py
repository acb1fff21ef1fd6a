"""Logits parity with Hugging Face transformers on tiny random Llama-family models.

minispec's Transformer is checked against transformers' LlamaForCausalLM and
Qwen2ForCausalLM (the reference implementations) over MHA, GQA, MQA, tied and
untied embeddings, several rope_theta values, Llama 3 rope scaling, an explicit
head_dim and Qwen2's q/k/v biases; both through the full causal forward and
through the paged KV cache (ragged prefill, then decode and multi-token steps).

Weights are re-drawn at O(1) scale (embeddings and linears ~N(0, 1/width),
norm gains ~1+N(0,0.2^2), biases ~N(0,0.5^2)) so that attention, RoPE and the
norms move the logits by O(1): with transformers' default std=0.02 init the
logits are ~1e-2 and a RoPE bug could hide under a 1e-4 tolerance. The
"config matters" test proves the tolerance can fail.

The HF config -> ModelConfig mapping is the converter's (tools/convert_hf.py),
and the weight copy uses minispec.checkpoint.hf_to_minispec_name: one map each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minispec import ModelConfig, Transformer
from minispec.checkpoint import hf_to_minispec_name

from convert_hf import ConversionError, config_from_hf
from helpers import HF_VOCAB, LLAMA3, hf_logits, make_hf

pytest.importorskip("transformers")  # make_hf needs it

VOCAB, T, BATCH, TOL = HF_VOCAB, 48, 2, 1e-4

# name -> (architecture, HF config overrides)
CASES = {
    "mha": ("llama", dict(num_key_value_heads=4)),
    "gqa": ("llama", dict(num_key_value_heads=2)),
    "mqa": ("llama", dict(num_key_value_heads=1)),
    "tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "theta500k": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-6)),
    "llama3_scaling": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama3_scaling_theta10k": ("llama", dict(num_key_value_heads=1, rope_theta=10000.0, rope_scaling=LLAMA3,
                                              tie_word_embeddings=True)),
    "head_dim32": ("llama", dict(num_key_value_heads=2, head_dim=32)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2_tied_mqa": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0)),
}


def to_minispec(hf_model, **config_changes) -> Transformer:
    """The same model in minispec: config via the converter's config_from_hf, weights via hf_to_minispec_name."""
    cfg = config_from_hf(hf_model.config.to_dict())
    if config_changes:
        cfg = dataclasses.replace(cfg, **config_changes)
    model = Transformer(cfg)
    state = {}
    for hf_name, t in hf_model.state_dict().items():
        name = hf_to_minispec_name(hf_name)
        if name is None or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        state[name] = t
    model.load_state_dict(state, strict=True)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(seed))


def paged_logits(model: Transformer, x: torch.Tensor, prefill: list[int], chunks=(1, 1, 3)) -> torch.Tensor:
    """Logits for every token of x, computed through the paged cache.

    A ragged prefill (prefill[b] tokens of row b), then steps appending
    chunks[i % len(chunks)] tokens to every sequence that still has tokens
    (multi-token steps are what speculative verification does).
    """
    cache = model.new_cache(num_blocks=2 * BATCH * T // 8, block_size=8)
    seqs = [cache.new_sequence() for _ in range(x.shape[0])]
    out = torch.full((x.shape[0], x.shape[1], VOCAB), float("nan"))
    lo = list(prefill)
    lg = model.step(cache, seqs, [x[b, :lo[b]].tolist() for b in range(len(seqs))], all_logits=True)
    for b in range(len(seqs)):
        out[b, :lo[b]] = lg[b, :lo[b]]
    i = 0
    while any(p < x.shape[1] for p in lo):
        active = [b for b in range(len(seqs)) if lo[b] < x.shape[1]]
        n = [min(chunks[i % len(chunks)], x.shape[1] - lo[b]) for b in active]
        lg = model.step(cache, [seqs[b] for b in active], [x[b, lo[b]:lo[b] + k].tolist() for b, k in zip(active, n)],
                        all_logits=True)
        for j, (b, k) in enumerate(zip(active, n)):
            out[b, lo[b]:lo[b] + k] = lg[j, :k]
            lo[b] += k
        i += 1
    cache.check_consistency()
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request):
    arch, overrides = CASES[request.param]
    hf = make_hf(arch, seed=sorted(CASES).index(request.param), **overrides)
    return request.param, hf, to_minispec(hf)


def test_forward_matches_transformers(models):
    name, hf, ms = models
    x = tokens()
    ref = hf_logits(hf, x)
    assert ref.std() > 0.3, "logits too small for the tolerance to mean anything"
    torch.testing.assert_close(ms(x), ref, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")


def test_paged_cache_matches_transformers(models):
    name, hf, ms = models
    x = tokens()
    ref = hf_logits(hf, x)
    got = paged_logits(ms, x, prefill=[13, 29])
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0, msg=lambda m: f"{name} (paged): {m}")


@pytest.mark.parametrize("case,change", [
    ("llama3_scaling", {"rope_scaling": None}),  # the scaling really changes the frequencies at T=48
    ("theta500k", {"rope_theta": 10000.0}),
    ("gqa", {"norm_eps": 1e-2}),
])
def test_config_matters(case, change):
    """Negative control: the same weights under a wrong config are far outside the tolerance."""
    arch, overrides = CASES[case]
    hf = make_hf(arch, **overrides)
    x = tokens()
    diff = (to_minispec(hf, **change)(x) - hf_logits(hf, x)).abs().max().item()
    assert diff > 100 * TOL, f"{case} with {change}: max |diff| {diff:.2e}; the parity test could not see this change"


# ---- config_from_hf: the HF config.json -> ModelConfig mapping (pure) ----

def _llama_json(**kw) -> dict:
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
         "tie_word_embeddings": False, "hidden_act": "silu"}
    d.update(kw)
    return d


def test_config_from_hf_legacy_and_v5_rope_layouts_agree():
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    legacy = config_from_hf(_llama_json(rope_theta=500000.0, rope_scaling=rs))  # transformers < 5
    v5 = config_from_hf(_llama_json(rope_parameters={**rs, "rope_theta": 500000.0}))  # transformers 5
    assert legacy == v5
    assert legacy == ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                 norm_eps=1e-5, rope_theta=500000.0, rope_scaling=rs, max_seq_len=256,
                                 tie_embeddings=False, qkv_bias=False, bos_id=1, eos_id=2)


def test_config_from_hf_defaults_and_special_ids():
    cfg = config_from_hf(_llama_json(eos_token_id=[2, 7, 2], tie_word_embeddings=True))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.eos_id, cfg.tie_embeddings) == (10000.0, None, [2, 7], True)
    # generation_config.json wins: it is what transformers' generate stops on (Llama 3 lists several eos)
    cfg = config_from_hf(_llama_json(), {"bos_token_id": 5, "eos_token_id": [9, 8]})
    assert (cfg.bos_id, cfg.eos_id) == (5, [9, 8])
    # llama3 scaling without original_max_position_embeddings falls back to max_position_embeddings, as in transformers
    cfg = config_from_hf(_llama_json(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0}))
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256
    qwen = config_from_hf(_llama_json(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=32,
                                      use_sliding_window=False))
    assert qwen.qkv_bias
    mistral = config_from_hf(_llama_json(architectures=["MistralForCausalLM"], sliding_window=256))
    assert not mistral.qkv_bias  # a window as long as the context is no window
    assert config_from_hf(_llama_json(architectures=None, model_type="mistral", sliding_window=None)).n_layers == 2


@pytest.mark.parametrize("changes,needles", [
    ({"architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, ["sliding_window=64", "unsupported"]),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64},
     ["sliding", "unsupported"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "llama3"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"hidden_act": "gelu"}, ["gelu"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
])
def test_config_from_hf_refuses_clearly(changes, needles):
    with pytest.raises(ConversionError) as e:
        config_from_hf(_llama_json(**changes))
    for needle in needles:
        assert needle in str(e.value)
