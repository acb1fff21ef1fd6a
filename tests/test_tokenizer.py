"""minispec.tokenizer against the references: transformers for SmolLM2's byte-level BPE (tokenizer.json
rebuilt from the GGUF), sentencepiece and transformers for a SentencePiece model trained here.

The text lines are generated deterministically: unicode, CJK, emoji (with ZWJ sequences and
flags), digits of several scripts, whitespace runs, code, newlines, mixed case, special tokens.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import pytest

from minispec.tokenizer import Tokenizer, TokenizerError, load_tokenizer

import convert_gguf as conv

FRAGMENTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "HELLO World", "hElLo WoRlD", "I'm", "don't",
    "WE'LL", "they've", "it's", "naïve café", "Ünïcödé", "résumé", "Straße", "Ελληνικά", "Русский текст", "中文字符",
    "日本語のテキスト", "한국어", "مرحبا بالعالم", "שלום", "हिन्दी", "🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🚀✨", "∑∫√∞",
    "→⇒", "12345", "3.14159", "1,000,000", "+1 (555) 010-9999", "٣٤٥", "½ ¾", "x² + y³", "Ⅻ", "0x1F", "2024-06-01",
    "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "def f(x):\n    return x * 2",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }", '{"key": [1, 2, 3], "nested": {"a": null}}',
    "SELECT * FROM users WHERE id = 42;", "<div class=\"x\">hi</div>", "$ ls -la /tmp && echo $HOME", "a=b&c=d",
    "https://example.com/path?q=1#frag", "user@example.org", "¿Qué?", "¡Hola!", "...", "—", "–", "“quoted”",
    "‘single’", "«guillemets»", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "ALLCAPS",
    "snake_case_name", "camelCaseName", "__init__", "#include <stdio.h>", "// comment", "/* block */", "0", "00",
    "007", "9999999999", "e=mc^2", "αβγ", "ﬁ ligature", "Ａｌｐｈａ", "ｶﾀｶﾅ", "\u00a0nbsp", "zero\u200bwidth",
]
ALPHABETS = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n",
             ".,;:!?-_()[]{}'\"/\\@#$%^&*+=<>|~`", "éèêëàâäôöùûüçñß", "的一是不了人我在有他这中大来上",
             "あいうえおかきくけこ", "😀😂🥲🤖🎉🔥💡", "абвгдежзийклмн"]
WORDS = ["the", "The", "THE", "model", "token", "speculative", "decoding"]


def varied_lines(n: int = 600, seed: int = 0) -> list[str]:
    """n deterministic lines of four kinds, in turn: fragments, mixed alphabets, random code points, word salad."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 5))]
            line = "".join(p + rng.choice(["", " ", "  ", "\n", "\t", ", "]) for p in parts)
        elif kind == 1:
            line = "".join(rng.choice(rng.choice(ALPHABETS)) for _ in range(rng.randint(1, 40)))
        elif kind == 2:  # code points across the BMP and the emoji planes, never surrogates
            line = "".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF),
                                           rng.randint(0x3000, 0x9FFF), rng.randint(0xAC00, 0xD7A3),
                                           rng.randint(0x1F300, 0x1FAFF)]))
                           for _ in range(rng.randint(1, 12)))
        else:
            words = [rng.choice(WORDS + [str(rng.randint(0, 10**6)), f"{rng.random():.4f}", "x" * rng.randint(1, 20),
                                         " " * rng.randint(1, 6)]) for _ in range(rng.randint(1, 12))]
            line = rng.choice([" ", "", "\n", "  "]).join(words)
            if rng.random() < 0.3:
                line = " " * rng.randint(1, 3) + line
            if rng.random() < 0.3:
                line += " " * rng.randint(1, 3)
        lines.append(line)
    return lines


def training_lines() -> list[str]:
    """Text to train the small test tokenizers on: the natural-language kinds of varied_lines."""
    return [line for i, line in enumerate(varied_lines(2000, seed=7)) if i % 4 in (0, 3)]


def write_dir(tmp_path_factory, basename: str, files: dict[str, bytes]) -> Path:
    """A new temporary directory holding `files` (file name -> contents)."""
    d = tmp_path_factory.mktemp(basename)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


# ---------------------------------------------------------------------------------------------
# fixtures: SmolLM2's tokenizer rebuilt from its GGUF, and a SentencePiece model trained here

@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory, smol_gguf) -> Path:
    """Only the tokenizer files of the converted checkpoint (no weights needed here)."""
    return write_dir(tmp_path_factory, "smol_tok", conv.tokenizer_files(conv.read_metadata(conv.open_gguf(smol_gguf))))


@pytest.fixture(scope="module")
def smol(smol_dir) -> Tokenizer:
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def smol_hf(smol_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()), model_writer=buf, vocab_size=500, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, byte_fallback=True,
        character_coverage=0.98, split_digits=True, allow_whitespace_only_pieces=True, user_defined_symbols=["<tool>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2, max_sentence_length=100000)
    return write_dir(tmp_path_factory, "spm", {"tokenizer.model": buf.getvalue()})


@pytest.fixture(scope="module")
def spm_tok(spm_dir) -> Tokenizer:
    return load_tokenizer(spm_dir)


@pytest.fixture(scope="module")
def spm_hf(spm_tok):
    """transformers' LlamaTokenizer built from the model's pieces: vocab, merges ordered by piece score,
    control pieces as special tokens, user-defined pieces as added tokens (what transformers' own
    SentencePiece conversion does; reading the .model file directly would need protobuf)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken
    from transformers.tokenization_utils_base import generate_merges
    sp, types = spm_tok.backend.sp, spm_tok.backend.types
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    hf = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, {sp.id_to_piece(i): sp.get_score(i)
                                                                                 for i in range(n)}))
    hf.add_tokens([AddedToken(sp.id_to_piece(i), normalized=False, special=types[i] == 3)
                   for i in range(n) if types[i] in (3, 4)])
    return hf


# ---------------------------------------------------------------------------------------------
# SmolLM2: tokenizer.json (byte-level BPE)

def test_smollm2_basics(smol):
    assert smol.kind == "tokenizer.json" and smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.eos_ids) == (1, 2, (2,))
    assert smol.add_bos is False  # tokenizer.ggml.add_bos_token = false, as SmolLM2's own config says
    assert smol.encode("hi") == smol.encode("hi", bos=False) and smol.encode("hi", bos=True)[0] == 1
    assert smol.encode("hi", eos=True)[-1] == 2
    assert smol.encode("<|im_start|>user") == [1, 4093]  # control tokens in the text are matched whole
    assert smol.encode("") == [] and smol.decode([]) == ""


def test_smollm2_matches_transformers_on_varied_lines(smol, smol_hf):
    lines = varied_lines(600)
    assert len(lines) >= 500
    for line in lines:
        ids = smol.encode(line)
        assert ids == smol_hf.encode(line), repr(line)
        assert smol.decode(ids) == smol_hf.decode(ids) == line, repr(line)  # byte-level BPE is lossless
        assert smol.decode(ids, skip_special_tokens=True) == smol_hf.decode(ids, skip_special_tokens=True)


def test_smollm2_matches_transformers_own_gguf_tokenizer(smol, smol_gguf):
    """An independent rebuild of the same GGUF metadata: transformers' GGUF tokenizer.

    transformers ignores tokenizer.ggml.pre = "smollm", which in llama.cpp (and in SmolLM2's
    original tokenizer.json) splits every digit off before GPT-2's regex. So: identical on lines
    without numbers as is, and identical on every line once its pre-tokenizer gets the digit split.
    """
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    hf = transformers.AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    lines = varied_lines(600)
    no_digits = [l for l in lines if not any(c.isnumeric() for c in l)]
    assert len(no_digits) > 250
    for line in no_digits:
        assert smol.encode(line) == hf.encode(line), repr(line)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for line in lines:
        ids = smol.encode(line)
        assert ids == hf.encode(line), repr(line)
        assert smol.decode(ids) == hf.decode(ids)


def test_smollm2_chat_template_matches_transformers(smol, smol_hf):
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
         {"role": "user", "content": "Another, in 日本語 🙂"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    text = smol.apply_chat_template(conversations[0])
    assert text.endswith("<|im_start|>assistant\n")
    assert smol.encode(text, bos=False)[:1] == [1]  # the template writes <|im_start|> itself


# ---------------------------------------------------------------------------------------------
# SentencePiece: tokenizer.model

def test_sentencepiece_matches_sentencepiece(spm_tok, spm_dir):
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    assert spm_tok.kind == "tokenizer.model" and spm_tok.vocab_size == 500
    assert spm_tok.add_bos and (spm_tok.bos_id, spm_tok.eos_ids) == (1, (2,))  # no tokenizer_config: Llama's default
    lines = [l for l in varied_lines(600, seed=3) if not any(s in l for s in ("<s>", "</s>", "<unk>"))]
    assert len(lines) >= 500
    for line in lines:
        assert spm_tok.encode(line) == ref.encode(line, add_bos=True), repr(line)
        assert spm_tok.encode(line, bos=False, eos=True) == ref.encode(line, add_eos=True)
        ids = ref.encode(line)
        assert spm_tok.decode(ids) == ref.decode(ids), repr(line)


def test_sentencepiece_matches_transformers(spm_tok, spm_hf):
    lines = varied_lines(600, seed=3) + ["<s>hello</s> world", "hi <s> there", "a</s>", "x<tool>y", "<unk>", "\n", ""]
    # Hugging Face's Metaspace adds no dummy prefix to text that starts with whitespace or with an
    # added token, where sentencepiece does; the test above holds those to sentencepiece itself
    compared = [l for l in lines if not (l[:1].isspace() or l.startswith("<tool>"))]
    assert len(compared) >= 500
    for line in compared:
        assert spm_tok.encode(line, bos=False) == spm_hf.encode(line, add_special_tokens=False), repr(line)
    for line in lines:
        ids = spm_tok.encode(line)
        assert spm_tok.decode(ids) == spm_hf.decode(ids), repr(line)
        assert spm_tok.decode(ids, skip_special_tokens=True) == spm_hf.decode(ids, skip_special_tokens=True)


def test_sentencepiece_special_pieces_in_text(spm_tok):
    sp = spm_tok.backend.sp
    pieces = [sp.id_to_piece(i) for i in spm_tok.encode("hi <s> there</s>", bos=False)]
    assert "<s>" in pieces and "</s>" in pieces and "<" not in pieces
    # after a special piece the text gets no dummy-prefix space: "<s>x" is not "<s> x"
    assert spm_tok.encode("<s>hello", bos=False)[1:] != spm_tok.encode(" hello", bos=False)
    assert spm_tok.decode(spm_tok.encode("<s>hello</s> world", bos=False)) == "<s>hello</s> world"


# ---------------------------------------------------------------------------------------------
# streaming

def _stream(tok, ids, rng, skip):
    s = tok.decoder_stream(skip_special_tokens=skip)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(s.push(ids[i:i + n]))
        i += n
    return out, s.flush()


@pytest.mark.parametrize("which", ["smol", "spm_tok"])
def test_incremental_decode_equals_full_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    cases = [tok.encode(l) for l in varied_lines(200, seed=5)]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 50))] for _ in range(200)]
    for ids in cases:
        for skip in (False, True):
            pieces, tail = _stream(tok, ids, rng, skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("which", ["smol", "spm_tok"])
def test_stream_never_emits_half_a_character(which, request):
    tok = request.getfixturevalue(which)
    text = "a🙂b 中文 👨‍👩‍👧 ok"
    ids = tok.encode(text, bos=False)
    s = tok.decoder_stream()
    out = [s.push([i]) for i in ids] + [s.flush()]
    assert "".join(out) == text
    assert not any("\ufffd" in piece for piece in out)
    # an emoji split over byte tokens comes out whole, once
    assert "🙂" in out or any(p.endswith("🙂") or "🙂" in p for p in out)


def test_stream_keeps_sentencepiece_spaces(spm_tok):
    ids = spm_tok.encode("hello world again", bos=True)
    s = spm_tok.decoder_stream(skip_special_tokens=True)
    assert "".join(s.push([i]) for i in ids) + s.flush() == "hello world again"


# ---------------------------------------------------------------------------------------------
# fingerprint, save/load, errors

def test_fingerprint_stable_across_save_and_load(smol, spm_tok, tmp_path):
    for tok, name in ((smol, "a"), (spm_tok, "b")):
        tok.save(tmp_path / name)
        again = load_tokenizer(tmp_path / name)
        assert again.fingerprint == tok.fingerprint
        assert len(tok.fingerprint) == 64
    assert smol.fingerprint != spm_tok.fingerprint


def test_fingerprint_changes_with_the_vocabulary(smol_dir, spm_dir, tmp_path):
    base = load_tokenizer(smol_dir).fingerprint
    spec = json.loads((smol_dir / "tokenizer.json").read_text())
    variants = {}
    merges = list(spec["model"]["merges"])
    variants["merge dropped"] = dict(spec, model=dict(spec["model"], merges=merges[:-1]))
    vocab = dict(spec["model"]["vocab"])
    a, b = "Ġthe", "Ġand"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    variants["ids swapped"] = dict(spec, model=dict(spec["model"], vocab=vocab))
    for label, s in variants.items():
        d = tmp_path / label.replace(" ", "_")
        shutil.copytree(smol_dir, d)
        (d / "tokenizer.json").write_text(json.dumps(s))
        assert load_tokenizer(d).fingerprint != base, label
    d = tmp_path / "other_eos"
    shutil.copytree(smol_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).fingerprint != base  # special ids are part of it
    shutil.copytree(smol_dir, tmp_path / "copy")
    assert load_tokenizer(tmp_path / "copy").fingerprint == base


def test_load_tokenizer_none_and_errors(tmp_path, smol_dir, smol):
    assert load_tokenizer(tmp_path) is None
    d = tmp_path / "bad"
    shutil.copytree(smol_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not-a-token|>"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="not-a-token"):
        load_tokenizer(d)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        smol.decode([49152])
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match="corrupt"):
        load_tokenizer(tmp_path / "corrupt")


def test_checkpoint_carries_the_tokenizer(smol, tmp_path):
    from minispec import ModelConfig, Transformer
    model = Transformer(ModelConfig(vocab_size=smol.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    model.tokenizer = smol
    model.save_pretrained(tmp_path / "ckpt")
    loaded = Transformer.from_pretrained(tmp_path / "ckpt")
    assert loaded.tokenizer.fingerprint == smol.fingerprint
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == \
        smol.apply_chat_template([{"role": "user", "content": "x"}])
