"""The real Qwen2.5-Coder checkpoints (`make weights-coder`; the 0.5B alone: `make weights-coder-draft`).

The 0.5B converted by tools/convert_gguf.py is compared with transformers' own load of the same
GGUF file (fp32): logits on several prompts, 64 greedy tokens, the tokenizer on 640 lines of
code-heavy text, the chat template. Then speculative decoding: greedy speculate with the 0.5B
drafting for itself, and (slow, when converted) for the 1.5B, equals greedy generate.

Memory: the transformers model is loaded once, its outputs kept and the model freed before
minispec's loads (each module fixture loads one model once). Skipped, with the command that
makes them, when the converted checkpoints are absent; `make test` makes the 0.5B first.
"""

from __future__ import annotations

import gc
import random
import unicodedata
from pathlib import Path

import pytest
import torch

from minispec import Transformer
from minispec.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DRAFT_NAME, TARGET_NAME = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
GGUF_DIR = ROOT / "weights" / "gguf"
DRAFT_DIR, TARGET_DIR = ROOT / "weights" / DRAFT_NAME, ROOT / "weights" / TARGET_NAME
N_REAL_TOKENS = 151_665  # Qwen2's tokens; the embedding has 151,936 rows

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "// reverse a singly linked list in C\nstruct node {\n\tint value;\n\tstruct node *next;\n};\n\n"
    "struct node *reverse(",
    "# 计算列表的平均值\ndef mean(xs: list[float]) -> float:\n",
    "The capital of France is",
]
CHAT = "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."


def chat_prompt(tok, content: str = CHAT) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": content}])


# ---------------------------------------------------------------------------------------------
# code-heavy text, generated deterministically

IDENTS = ["x", "total", "user_id", "parseHeader", "MAX_LEN", "self", "data", "i", "node", "buf", "résumé", "数据", "值",
          "__init__", "_private", "camelCase", "snake_case", "HTTPServer", "tmp2", "ñ"]
COMMENTS = ["TODO: handle the empty case", "计算总和", "ここで初期化する", "빠른 경로", "fix #1234 🐛", "✅ done",
            "see RFC 9110", "O(n log n)", "€ 12,50", "— not thread-safe —", "🚀 fast path", "x² + y² = r²",
            "naïve but correct"]
STRINGS = ["hello, world", "日本語テキスト", "emoji: 😀👍🏽👨‍👩‍👧", "tab\\tseparated", "C:\\\\path\\\\to", "%d items",
           "{name}!", "<|im_start|>", "100%", "line\\n", "中文", "ÅÄÖ", "🇫🇷🇯🇵"]
MARKUP = ["<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>",
          "<|im_start|>user\n{code}<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>",
          "<|fim_prefix|>{code}<|fim_suffix|>\n<|fim_middle|>", "<|im_end|>",
          "<tool_call>\n{\"name\": \"run\"}\n</tool_call>", "<|file_sep|>src/main.rs", "<|repo_name|>minispec"]


def _number(rng: random.Random) -> str:
    return rng.choice([str(rng.randint(0, 9)), str(rng.randint(10, 10**9)), f"{rng.random() * 1000:.3f}",
                       hex(rng.randint(0, 2**32)), f"{rng.randint(1, 99)}e-{rng.randint(1, 12)}", "1_000_000",
                       "0b1011", str(-rng.randint(1, 500)), "３１４"])


def _statement(rng: random.Random) -> str:
    a, b, s = rng.choice(IDENTS), rng.choice(IDENTS), rng.choice(STRINGS)
    n, c = _number(rng), rng.choice(COMMENTS)
    return rng.choice([
        f"{a} = {b} + {n}", f"if {a} >= {n}:", f"return {a}[{b}:{n}]", f'print(f"{s} {{{a}}}")', f"# {c}",
        f"for {a} in range({n}):", f"def {a}({b}, *args, **kwargs) -> int:", f"{a}.append({b} ** 2)  # {c}",
        f"int {a} = {b} * {n}; // {c}", f"for (int i = 0; i < {n}; ++i) {{ {a}[i] += {b}; }}", f'const {a} = "{s}";',
        f"let mut {a}: Vec<u8> = Vec::with_capacity({n});", f"SELECT {a}, {b} FROM t WHERE id = {n};",
        f'{{"{a}": [{n}, "{s}", null, true]}}', f"$ grep -rn '{a}' src/ | wc -l", f"/* {c} */", f"-- {c}",
        f"assert {a} != {b}, '{s}'", f"{a} = lambda {b}: {b} if {b} else {n}", f"<div class=\"{a}\">{s}</div>",
        f"    @property\n    def {a}(self):", f"}} else if ({a} == {n}) {{", f"#include <{a}.h>", f"x{n} := {b}",
    ])


def _indent(rng: random.Random) -> str:
    return rng.choice(["", "", "    ", "        ", "\t", "\t\t", "  ", "            ", " \t", "\t    "])


def code_lines(n: int = 640, seed: int = 0) -> list[str]:
    """n deterministic code-heavy lines (some several lines long): indentation with spaces and tabs, comments in
    several scripts, numbers, emoji, string literals, trailing whitespace, and Qwen's chat and FIM markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        parts = [_indent(rng) + _statement(rng) for _ in range(rng.randint(1, 4))]
        line = rng.choice(["\n", "\n", "\n\n", "\r\n", "\n\t"]).join(parts)
        if i % 7 == 0:
            line = rng.choice(MARKUP).replace("{code}", line)
        if i % 11 == 0:
            line += rng.choice([" ", "  ", "\t", "\n", "\n\n\n", " \n"])
        lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------
# fixtures: transformers' outputs (its model freed afterwards), then minispec's model

def _require(path: Path, what: str, make: str) -> None:
    if not path.exists():
        pytest.skip(f"{what} is absent ({path}): run `{make}`")


@pytest.fixture(scope="module")
def draft_gguf() -> Path:
    path = GGUF_DIR / f"{DRAFT_NAME}.gguf"
    _require(path, "the Qwen2.5-Coder-0.5B GGUF", "make weights-coder-draft")
    _require(DRAFT_DIR / "model.safetensors", "the converted Qwen2.5-Coder-0.5B", "make weights-coder-draft")
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(draft_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(draft_gguf.parent, gguf_file=draft_gguf.name)


@pytest.fixture(scope="module")
def hf_reference(draft_gguf, hf_tokenizer):
    """transformers' fp32 logits on PROMPTS and 64 greedy tokens for two prompts; its model freed on return."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(draft_gguf.parent, gguf_file=draft_gguf.name,
                                                              dtype=torch.float32).eval()
    ref = {"logits": {}, "greedy": {}}
    with torch.no_grad():
        for p in PROMPTS:
            ids = hf_tokenizer.encode(p, add_special_tokens=False)
            ref["logits"][p] = (ids, model(torch.tensor([ids])).logits[0])
        chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False,
                                                add_generation_prompt=True)
        for p in (PROMPTS[0], chat):
            ids = hf_tokenizer.encode(p, add_special_tokens=False)
            out = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                 pad_token_id=hf_tokenizer.pad_token_id)
            ref["greedy"][p] = (ids, out[0, len(ids):].tolist())
    del model
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def qwen(hf_reference):
    """The converted 0.5B, loaded after transformers' model is gone."""
    return Transformer.from_pretrained(DRAFT_DIR)


@pytest.fixture(scope="module")
def qwen_greedy(qwen, hf_reference) -> dict[str, list[int]]:
    """minispec's 64 greedy tokens for the prompts transformers generated from (computed once, used twice)."""
    return {p: qwen.generate(ids, max_new_tokens=64, temperature=0.0, stop_tokens=[])
            for p, (ids, _) in hf_reference["greedy"].items()}


# ---------------------------------------------------------------------------------------------
# the 0.5B against transformers

@pytest.mark.slow
def test_config_and_stop_tokens(qwen):
    c = qwen.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim) == (24, 896, 14, 2, 4864)
    assert c.qkv_bias and not c.tie_embeddings and c.rope_theta == 1e6 and c.norm_eps == 1e-6
    assert c.vocab_size == 151_936 and c.sampled_vocab_size == N_REAL_TOKENS
    tok = qwen.tokenizer
    assert c.stop_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) == (151645, 151643)


@pytest.mark.slow
def test_logits_match_transformers(qwen, hf_reference):
    for prompt, (ids, ref) in hf_reference["logits"].items():
        assert qwen.tokenizer.encode(prompt) == ids, repr(prompt)
        logits = qwen(torch.tensor([ids]))[0]
        diff = (logits[:, :N_REAL_TOKENS] - ref[:, :N_REAL_TOKENS]).abs().max().item()
        assert diff <= 1e-3, f"{prompt!r}: logits differ by {diff}"
        # transformers scores the padding rows; minispec never samples them
        assert torch.isneginf(logits[:, N_REAL_TOKENS:]).all() and torch.isfinite(ref[:, N_REAL_TOKENS:]).all()


@pytest.mark.slow
def test_greedy_tokens_match_transformers(qwen, qwen_greedy, hf_reference):
    for prompt, (_, ref) in hf_reference["greedy"].items():
        ours = qwen_greedy[prompt]
        assert len(ours) == len(ref) == 64
        assert ours == ref, f"{prompt!r}:\n ours {qwen.tokenizer.decode(ours)!r}\n   hf {qwen.tokenizer.decode(ref)!r}"


@pytest.mark.slow
def test_tokenizer_matches_transformers_on_code(draft_gguf, hf_tokenizer):
    tok = load_tokenizer(DRAFT_DIR)
    lines = code_lines(640)
    assert all(unicodedata.normalize("NFC", line) == line for line in lines)  # see test_gguf's NFC check
    for feature in ("\t", "    ", "<|im_start|>", "计", "😀", "0x"):
        assert sum(feature in line for line in lines) >= 20, feature
    for line in lines:
        ids = tok.encode(line)
        assert ids == hf_tokenizer.encode(line, add_special_tokens=False), repr(line)
        assert tok.decode(ids) == hf_tokenizer.decode(ids) == line, repr(line)
        assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    text = "\n".join(lines)  # across line boundaries too
    assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    conversations = [[{"role": "user", "content": CHAT}],
                     [{"role": "system", "content": "Answer in 日本語."}, {"role": "user", "content": "def f(): pass"},
                      {"role": "assistant", "content": "```python\n\tpass\n```"}, {"role": "user", "content": "🙂?"}]]
    for messages in conversations:
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


# ---------------------------------------------------------------------------------------------
# speculative decoding on the real pair

@pytest.mark.slow
def test_greedy_speculate_with_itself_as_draft_equals_generate(qwen, qwen_greedy, hf_reference):
    chat = [p for p in hf_reference["greedy"] if p.startswith("<|im_start|>")]
    assert len(chat) == 1
    ids = hf_reference["greedy"][chat[0]][0]
    assert ids == chat_prompt(qwen.tokenizer)
    res = qwen.speculate(qwen, ids, k=4, max_new_tokens=64, temperature=0.0, stop_tokens=[])
    assert res.tokens == qwen_greedy[chat[0]]
    assert res.stats.acceptance_rate == 1.0  # a draft identical to its target: every draft token is kept


@pytest.fixture(scope="module")
def coder_target():
    _require(TARGET_DIR / "model.safetensors", "the converted Qwen2.5-Coder-1.5B", "make weights-coder")
    return Transformer.from_pretrained(TARGET_DIR)


@pytest.mark.slow
def test_greedy_speculate_on_the_1_5b_equals_generate(coder_target, qwen):
    assert coder_target.tokenizer.fingerprint == qwen.tokenizer.fingerprint
    assert coder_target.config.sampled_vocab_size == N_REAL_TOKENS
    prompt = chat_prompt(coder_target.tokenizer)
    ref = coder_target.generate(prompt, max_new_tokens=48, temperature=0.0, stop_tokens=[])
    res = coder_target.speculate(qwen, prompt, k=4, max_new_tokens=48, temperature=0.0, stop_tokens=[])
    assert res.tokens == ref, coder_target.tokenizer.decode(res.tokens)
    assert 0.3 < res.stats.acceptance_rate < 1.0  # a real draft: agrees often, not always


@pytest.mark.slow
def test_greedy_speculate_with_its_int4_form_as_draft_equals_generate(qwen, qwen_greedy, hf_reference):
    """The 0.5B's int4 form drafting for the fp32 0.5B: an inexact draft, the target's own greedy tokens."""
    draft = Transformer.from_pretrained(DRAFT_DIR, int4=True)
    assert draft.config.int4 and not qwen.config.int4
    prompt = next(p for p in hf_reference["greedy"] if p.startswith("<|im_start|>"))
    res = qwen.speculate(draft, hf_reference["greedy"][prompt][0], k=4, max_new_tokens=64, temperature=0.0,
                         stop_tokens=[])
    assert res.tokens == qwen_greedy[prompt]
    assert 0.5 < res.stats.acceptance_rate  # int4 products stay close to the fp32 ones


@pytest.mark.slow
def test_a_bfloat16_target_speculates_its_own_greedy_tokens(hf_reference):
    """The 0.5B in bf16 as the target, its int4 form drafting: greedy speculate equals the bf16 model's own greedy
    generate on every reference prompt (bf16 rounds a row by how its pass was computed unless each row is
    computed alike: test_model.test_a_bfloat16_decode_step_computes_the_bits_of_a_verify_pass)."""
    target = Transformer.from_pretrained(DRAFT_DIR, dtype=torch.bfloat16)
    draft = Transformer.from_pretrained(DRAFT_DIR, int4=True)
    rates = []
    for prompt, (ids, *_) in hf_reference["greedy"].items():
        ref = target.generate(ids, max_new_tokens=48, temperature=0.0, stop_tokens=[])
        res = target.speculate(draft, ids, k=4, max_new_tokens=48, temperature=0.0, stop_tokens=[])
        assert res.tokens == ref, prompt
        rates.append(res.stats.acceptance_rate)
    assert min(rates) < 1.0  # the verify passes rejected drafts: rows after a rejection were recomputed
