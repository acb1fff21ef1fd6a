"""Tokenizers: one interface, two backends.

- tokenizer.json, run by Hugging Face's `tokenizers` library (byte-level BPE such as GPT-2,
  SmolLM2 or Llama 3; anything else that library reads);
- tokenizer.model, a SentencePiece model run by `sentencepiece` (Llama 2, Mistral, TinyLlama).

`load_tokenizer(dir)` picks tokenizer.json when present, else tokenizer.model, and reads
tokenizer_config.json for the special tokens, add_bos_token and the chat template.

The tokenizer.json backend gives the ids transformers gives for the same files. The
SentencePiece backend gives sentencepiece's own ids (what the model was trained on) and,
like transformers, matches control pieces written in the text (``<s>``) whole. It differs
from transformers only where transformers departs from sentencepiece: on text that starts
with whitespace or an added token, transformers adds no dummy-prefix space. Both backends'
`decode` keep special tokens unless `skip_special_tokens=True`, as transformers does.

`Tokenizer.fingerprint` hashes what decides the ids (vocabulary, merges or piece scores,
added tokens, special ids) so a draft and a target can prove they share a tokenizer.
`Tokenizer.decoder_stream()` turns ids into text as they are generated without ever
emitting half a UTF-8 character, and its pieces add up to `decode(all_ids)`.

Tokenizer files come from strangers: every file must be UTF-8 (or a sentencepiece
protobuf), every field of tokenizer_config.json the type it should be, and the vocabulary
non-empty; anything else is a TokenizerError naming the file. A chat template is code:
it runs in jinja's immutable sandbox, in a forked child process with a time limit, a
memory limit and a limit on the text it writes, so a template that loops or allocates
without bound is stopped with a TokenizerError instead of hanging or exhausting memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import numbers
import os
import re
import select
import signal
import time
import warnings
from datetime import datetime
from pathlib import Path

try:
    import resource  # POSIX: the chat template renderer's memory limit
except ImportError:  # pragma: no cover - Windows
    resource = None
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import protobuf
from .errors import InputError, show

JSON_FILE, SPM_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"
# the tokenizer files a checkpoint carries verbatim, when present (load reads them, save writes them back,
# and the converters copy them): the one list of them
TOKENIZER_FILES = (JSON_FILE, SPM_FILE, CONFIG_FILE, "special_tokens_map.json", "chat_template.jinja")


# the limits a chat template renders under (see _render_chat_template)
CHAT_TEMPLATE_SECONDS = 10.0  # wall-clock time
CHAT_TEMPLATE_MAX_CHARS = 16 * 2**20  # length of the rendered prompt
CHAT_TEMPLATE_MEMORY = 2**30  # bytes of memory the rendering may add (Linux)


class TokenizerError(InputError):
    """Tokenizer files are missing, inconsistent, or cannot be used."""


def _token_text(tok, where: str) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    text = tok.get("content") if isinstance(tok, dict) else tok
    if text is not None and not isinstance(text, str):
        raise TokenizerError(f"{where} must be a token string or {{\"content\": string}}, got {show(tok)}")
    return text


def _text(data: bytes, name: str) -> str:
    """A tokenizer file's bytes as text; a TokenizerError naming the file when they are not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{name} is not UTF-8 text ({e.reason} at byte {e.start}); "
                             "re-create or re-download it") from None


def _json_object(data: bytes, name: str) -> dict:
    """A tokenizer file holding a JSON object (tokenizer_config.json, special_tokens_map.json)."""
    text = _text(data, name)
    try:
        d = json.loads(text)
    except RecursionError:
        raise TokenizerError(f"{name} nests JSON too deeply") from None
    except ValueError as e:  # invalid JSON, or an integer past Python's digit limit
        raise TokenizerError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{name} must hold a JSON object, got {type(d).__name__}")
    return d


# ---------------------------------------------------------------------------------------------
# backends: plain encode/decode without bos/eos; the Tokenizer adds those

def _library_call(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) from the tokenizers library; its failures become a TokenizerError naming tokenizer.json.

    A damaged file can make the library's Rust code panic, which reaches Python as a PanicException:
    a BaseException, so it is caught here too (interrupts and exits are not).
    """
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise TokenizerError(f"{JSON_FILE} {what} ({type(e).__name__}: {show(str(e), 300)})") from None


class _JsonBackend:
    """tokenizer.json through the `tokenizers` library."""

    kind = "tokenizer.json"

    def __init__(self, data: bytes):
        from tokenizers import Tokenizer as HFTokenizer
        text = _text(data, JSON_FILE)
        self.tok = _library_call("cannot be read by the tokenizers library", HFTokenizer.from_str, text)
        # the file's own padding and truncation settings are for batching to a fixed shape; transformers turns
        # them off on every call, so they are off here too (a Fixed padding of 10**9 would abort the process)
        self.tok.no_padding()
        self.tok.no_truncation()
        self.spec = json.loads(text)  # what the library just parsed
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.max_id = max(vocab.values()) if vocab else -1
        self.special_ids = frozenset(t["id"] for t in self.spec.get("added_tokens", []) if t.get("special"))

    def encode(self, text: str) -> list[int]:
        return _library_call("fails to encode", self.tok.encode, text, add_special_tokens=False).ids

    def encode_with_template(self, text: str) -> list[int]:
        """What the file's own post-processor adds (e.g. Llama 3's <|begin_of_text|>)."""
        return _library_call("fails to encode", self.tok.encode, text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return _library_call("fails to decode", self.tok.decode, ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def fingerprint_payload(self) -> dict:
        model = self.spec.get("model", {})
        vocab = model.get("vocab")
        if isinstance(vocab, dict):  # BPE, WordPiece: token -> id, listed in id order
            vocab = sorted(([i, t] for t, i in vocab.items()))
        merges = model.get("merges")
        if merges is not None:  # older files spell a merge "a b", newer ones ["a", "b"]
            merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
        added = sorted([t["id"], t["content"], bool(t.get("special"))] for t in self.spec.get("added_tokens", []))
        return {"model": model.get("type"), "vocab": vocab, "merges": merges, "added": added}


class _SentencePieceBackend:
    """tokenizer.model through `sentencepiece`.

    Two things sentencepiece does not do and Hugging Face does, done here: control pieces
    written in the text (``<s>``) are matched whole, and the text after such a piece gets no
    dummy-prefix space (what HF's Metaspace(prepend_scheme="first") does). The second needs a
    copy of the model with NormalizerSpec.add_dummy_prefix off, made by editing the protobuf:
    ModelProto field 3 is the NormalizerSpec, whose field 3 is add_dummy_prefix.
    """

    kind = "tokenizer.model"

    def __init__(self, data: bytes):
        import sentencepiece as spm
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=data)
            fields = protobuf.fields(data)
            normalizer = b""
            self.types = []  # piece types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)
            for f, _, v in fields:
                if f == 1:
                    self.types.append(dict((ff, vv) for ff, _, vv in protobuf.fields(v)).get(3, 1))
                elif f == 3:
                    normalizer = v
            norm = {f: v for f, _, v in protobuf.fields(normalizer)}
        except Exception as e:
            raise TokenizerError(f"{SPM_FILE} cannot be read by sentencepiece ({e}); the file may be corrupt") from None
        self.add_dummy_prefix = bool(norm.get(3, 1))
        self.normalizer = {"name": norm.get(1, b"").decode("utf-8", "replace"),
                           "add_dummy_prefix": self.add_dummy_prefix,
                           "remove_extra_whitespaces": bool(norm.get(4, 1)), "escape_whitespaces": bool(norm.get(5, 1))}
        self.sp_no_prefix = self.sp
        if self.add_dummy_prefix:
            patched = b"".join(p for p in self._without_dummy_prefix(fields))
            self.sp_no_prefix = spm.SentencePieceProcessor(model_proto=patched)
        self.vocab_size = self.sp.get_piece_size()
        self.max_id = self.vocab_size - 1  # sentencepiece's ids are 0 .. piece count - 1
        self.special_ids = frozenset(i for i, t in enumerate(self.types) if t in (2, 3))
        # control and unknown pieces written in the text are matched whole, longest first
        names = sorted((self.sp.id_to_piece(i) for i in self.special_ids), key=len, reverse=True)
        self.piece_ids = {self.sp.id_to_piece(i): i for i in sorted(self.special_ids, reverse=True)}
        self.split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None

    @staticmethod
    def _without_dummy_prefix(fields):
        for f, wire, v in fields:
            if f == 3:
                body = b"".join(protobuf.field(ff, vv, w) for ff, w, vv in protobuf.fields(v) if ff != 3)
                yield protobuf.field(3, body + protobuf.field(3, 0), 2)
            else:
                yield protobuf.field(f, v, wire)

    def encode(self, text: str) -> list[int]:
        if self.split is None:
            return self.sp.encode(text) if text else []
        ids, first = [], True
        for k, part in enumerate(self.split.split(text)):
            if k % 2:  # a special piece
                ids.append(self.piece_ids[part])
            elif part:
                ids += (self.sp if first else self.sp_no_prefix).encode(part)
            first = False
        return ids

    def encode_with_template(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """sentencepiece's decode, with special pieces shown as their text unless skipped (as Hugging Face does)."""
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        parts, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    parts.append(self._decode_run(run, at_start=not parts))
                    run = []
                parts.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self._decode_run(run, at_start=not parts))
        return "".join(parts)

    def _decode_run(self, ids, at_start: bool) -> str:
        # sentencepiece drops the dummy-prefix space of a run's first piece; only the text's very
        # first piece had one added, so after a special piece the space is kept
        text = self.sp.decode(ids)
        if not at_start and self.add_dummy_prefix and self.sp.id_to_piece(ids[0]).startswith("\u2581"):
            text = " " + text
        return text

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def fingerprint_payload(self) -> dict:
        pieces = [[self.sp.id_to_piece(i), self.sp.get_score(i), self.types[i]] for i in range(self.vocab_size)]
        return {"model": "sentencepiece", "pieces": pieces, "normalizer": self.normalizer}


# ---------------------------------------------------------------------------------------------
# the Tokenizer

class Tokenizer:
    """Text <-> token ids for one checkpoint; see the module docstring.

    bos_id / eos_id: the special ids (None when the tokenizer has none); eos_ids: a tuple of
    every end-of-sequence id. add_bos: whether encode() prepends bos by default: tokenizer_config's
    add_bos_token when it says; otherwise True for SentencePiece (as Llama does) and, for
    tokenizer.json, whatever the file's own post-processor does (Llama 3 adds
    <|begin_of_text|>, GPT-2 and SmolLM2 add nothing).
    """

    def __init__(self, files: dict[str, bytes]):
        self._files = dict(files)
        if JSON_FILE in files:
            self.backend = _JsonBackend(files[JSON_FILE])
        elif SPM_FILE in files:
            self.backend = _SentencePieceBackend(files[SPM_FILE])
        else:
            raise TokenizerError(f"no {JSON_FILE} or {SPM_FILE} among the tokenizer files {sorted(files)}")
        if self.backend.vocab_size < 1:
            raise TokenizerError(f"{self.backend.kind} holds no tokens (an empty or damaged file); "
                                 "re-create or re-download it")
        self.config = _json_object(files[CONFIG_FILE], CONFIG_FILE) if CONFIG_FILE in files else {}
        specials = {}
        if "special_tokens_map.json" in files:
            specials = _json_object(files["special_tokens_map.json"], "special_tokens_map.json")
        for flag in ("add_bos_token", "add_eos_token"):
            if flag in self.config and not isinstance(self.config[flag], bool):
                raise TokenizerError(f"{CONFIG_FILE}: {flag} must be true or false, got {show(self.config[flag])}")
        self.special_tokens = {}  # bos_token, eos_token, ... -> text, for chat templates
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(self.config.get(name, specials.get(name)), f"{CONFIG_FILE}: {name}")
            if text is not None:
                self.special_tokens[name] = text
        self.bos_id = self._special_id("bos_token")
        eos = self.config.get("eos_token", specials.get("eos_token"))
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = tuple(i for i in (self._id_of(_token_text(t, f"{CONFIG_FILE}: eos_token"), "eos_token")
                                         for t in eos_list) if i is not None)
        if isinstance(self.backend, _SentencePieceBackend):
            sp = self.backend.sp
            if self.bos_id is None and "bos_token" not in self.config and sp.bos_id() >= 0:
                self.bos_id = sp.bos_id()
            if not self.eos_ids and "eos_token" not in self.config and sp.eos_id() >= 0:
                self.eos_ids = (sp.eos_id(),)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if i is not None:
                self.special_tokens.setdefault(name, self.backend.id_to_token(i))
        self.add_bos = self._default_add_bos()
        self.add_eos = self.config.get("add_eos_token", False)
        self.chat_template = self._find_chat_template()

    # -- construction helpers

    def _id_of(self, text: str | None, what: str) -> int | None:
        if text is None:
            return None
        i = self.backend.token_to_id(text)
        if i is None:
            raise TokenizerError(f"{CONFIG_FILE}: {what} {text!r} is not in the vocabulary")
        return i

    def _special_id(self, name: str) -> int | None:
        return self._id_of(self.special_tokens.get(name), name)

    def _default_add_bos(self) -> bool:
        if "add_bos_token" in self.config:
            return self.config["add_bos_token"] and self.bos_id is not None
        if isinstance(self.backend, _SentencePieceBackend):
            return self.bos_id is not None
        templated = self.backend.encode_with_template("a")
        return self.bos_id is not None and len(templated) > 1 and templated[0] == self.bos_id

    def _find_chat_template(self) -> str | None:
        if "chat_template.jinja" in self._files:
            return _text(self._files["chat_template.jinja"], "chat_template.jinja")
        t = self.config.get("chat_template")
        if isinstance(t, list):  # several named templates: the default one
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            t = named.get("default")
        if t is not None and not isinstance(t, str):
            raise TokenizerError(f"{CONFIG_FILE}: chat_template must be a string (or a list of named templates), "
                                 f"got {show(t)}")
        return t

    # -- the interface

    @property
    def kind(self) -> str:
        return self.backend.kind

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def max_id(self) -> int:
        """The largest token id; above vocab_size - 1 when a tokenizer.json's ids have gaps (an added token at 40)."""
        return self.backend.max_id

    def encode(self, text: str, bos: bool | None = None, eos: bool = False) -> list[int]:
        """Text -> ids. bos=None follows `self.add_bos`; special tokens in the text are matched whole."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self.backend.encode(text)
        if bos if bos is not None else self.add_bos:
            if self.bos_id is None:
                raise TokenizerError("bos=True, but this tokenizer has no bos token")
            ids = [self.bos_id] + ids
        if eos:
            if self.eos_id is None:
                raise TokenizerError("eos=True, but this tokenizer has no eos token")
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Ids -> text; special tokens are shown unless skip_special_tokens."""
        ids = self.check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens) if ids else ""

    def check_ids(self, ids) -> list[int]:
        """Token ids (a list, or a tensor/array of integers) as a list of ints, each in the vocabulary.

        A float or bool id is refused, never truncated (1.7 is not token 1, True is not token 1).
        """
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TokenizerError(f"token ids must be a list of integers, got {show(ids)}")
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TokenizerError(f"token id {show(i)} is not an integer")
            if not 0 <= i <= self.max_id:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.max_id + 1})")
            if self.max_id >= self.vocab_size and self.backend.id_to_token(int(i)) is None:  # a gap in the ids
                raise TokenizerError(f"token id {i} is not in the vocabulary (the tokenizer has no token {i})")
            out.append(int(i))
        return out

    def decoder_stream(self, skip_special_tokens: bool = False) -> DecoderStream:
        """An incremental decoder: push(ids) returns the new complete text; flush() the rest."""
        return DecoderStream(self, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the vocabulary, merges/pieces, added tokens and special ids (hex); computed once."""
        payload = {**self.backend.fingerprint_payload(), "bos_id": self.bos_id, "eos_ids": list(self.eos_ids)}
        blob = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the checkpoint's own Jinja chat template over `messages` ([{"role", "content"}, ...]).

        Rendered as transformers does: a sandboxed jinja2 environment with trim_blocks and
        lstrip_blocks, the special tokens (bos_token, eos_token, ...) as variables, and the
        tojson filter, raise_exception and strftime_now helpers. Encode the result with bos=False:
        templates write their own bos.
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template'); "
                                 "use a plain prompt instead of --chat")
        return _render_chat_template(self.chat_template, messages, add_generation_prompt,
                                     **self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages -> prompt ids, ending with the assistant's header when add_generation_prompt:
        the chat template rendered, then encoded without an added bos (the template writes its own)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt), bos=False)

    def save(self, path) -> None:
        """Write the tokenizer files (as they were read) into the directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, data in self._files.items():
            (path / name).write_bytes(data)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, "
                f"add_bos={self.add_bos})")


class DecoderStream:
    """Incremental detokenization for streaming.

    push(ids) returns only text that can no longer change: it decodes a short window of
    recent ids and holds back output while it ends in U+FFFD (an incomplete UTF-8 character,
    e.g. the first byte token of an emoji). Decoding a window rather than one token at a time
    keeps context-dependent detail right, such as the space a SentencePiece "\u2581" piece
    stands for, which decode() drops only at the very start of a text. The window restarts at
    the last point where everything before it was emitted whole, so the joined output of all
    pushes plus flush() equals decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: a position where the text before it is final
        self.read = 0  # ids[prefix:read] decode to text that has already been emitted

    def push(self, ids) -> str:
        self.ids.extend(self.tok.check_ids(ids))
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character decodes to U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]


def _render_chat_template(template: str, messages, add_generation_prompt: bool, **variables) -> str:
    """Render a chat template in jinja's sandbox, in a child process, under the CHAT_TEMPLATE_* limits.

    The sandbox keeps the template from reaching Python internals; the child process keeps it from
    hanging the caller or exhausting its memory: a render that runs past CHAT_TEMPLATE_SECONDS is
    killed, one that allocates more than CHAT_TEMPLATE_MEMORY gets a MemoryError (Linux's address-space
    limit), and one that writes more than CHAT_TEMPLATE_MAX_CHARS is stopped. Each case is a
    TokenizerError. A fork costs tens of milliseconds in a process that holds a model; where there is
    no fork (Windows), or none is granted, the template renders in-process with the output limit only.
    """
    variables = dict(variables, messages=messages, add_generation_prompt=add_generation_prompt)
    text = _render_in_child(template, variables) if hasattr(os, "fork") else None
    return _render_limited(template, variables, CHAT_TEMPLATE_MAX_CHARS) if text is None else text


def _render_limited(template: str, variables: dict, max_chars: int) -> str:
    """Render in an immutable sandbox as transformers does, stopping once the output passes max_chars.

    Rendered as transformers does: trim_blocks and lstrip_blocks, the loopcontrols extension, the
    tojson filter, raise_exception and strftime_now. Whatever the template raises is its own failure,
    a TokenizerError.
    """
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        parts, n = [], 0
        for piece in env.from_string(template).generate(**variables):
            n += len(piece)
            if n > max_chars:
                raise TokenizerError(f"the chat template writes more than {max_chars} characters; "
                                     "it may loop without end")
            parts.append(piece)
        return "".join(parts)
    except TokenizerError:
        raise
    except TemplateError as e:
        raise TokenizerError(f"the chat template failed: {e}") from None
    except MemoryError:
        raise TokenizerError("the chat template needs more memory than a prompt can; "
                             "it may allocate without bound") from None
    except RecursionError:
        raise TokenizerError("the chat template recurses without end") from None
    except Exception as e:  # an error in the template's own code (a TypeError, ...)
        raise TokenizerError(f"the chat template failed: {type(e).__name__}: {show(str(e), 200)}") from None


def _render_in_child(template: str, variables: dict) -> str | None:
    """_render_limited in a forked child under a time and memory limit; its result comes back through a pipe.

    None when no child can be started (the system refuses a pipe or a fork).
    """
    try:
        r, w = os.pipe()
    except OSError:
        return None
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns about forking a process with threads; the child
            warnings.simplefilter("ignore", DeprecationWarning)  # only renders (pure Python) and exits
            pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:
        os.close(r)
        _child_render(w, template, variables)
    os.close(w)
    try:
        data = _read_child(r, pid, time.monotonic() + CHAT_TEMPLATE_SECONDS, 4 * CHAT_TEMPLATE_MAX_CHARS + 1)
    finally:
        os.close(r)
    if data[:1] == b"O":
        return data[1:].decode("utf-8", "surrogatepass")
    if data[:1] == b"E":
        raise TokenizerError(data[1:].decode("utf-8", "replace"))
    raise TokenizerError("the chat template's renderer died before it finished (out of memory?); the template "
                         "may allocate without bound")


def _child_render(fd: int, template: str, variables: dict) -> None:
    """In the forked child: render under the memory limit, write b"O" + text or b"E" + error to `fd`, and
    leave with os._exit, running none of the parent's cleanup (atexit, buffered output, pytest's)."""
    try:
        _limit_memory(CHAT_TEMPLATE_MEMORY)
        try:
            text = _render_limited(template, variables, CHAT_TEMPLATE_MAX_CHARS)
            payload = b"O" + text.encode("utf-8", "surrogatepass")
        except TokenizerError as e:
            payload = b"E" + str(e).encode("utf-8", "replace")
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
    finally:
        os._exit(0)


def _read_child(fd: int, pid: int, deadline: float, max_bytes: int) -> bytes:
    """Everything the child writes to `fd`, then reap it; kill it past the deadline or max_bytes."""
    chunks, n = [], 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TokenizerError(f"the chat template ran longer than {CHAT_TEMPLATE_SECONDS:g} s; it may loop "
                                     "without end")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            n += len(chunk)
            if n > max_bytes:
                raise TokenizerError(f"the chat template writes more than {CHAT_TEMPLATE_MAX_CHARS} characters")
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.waitpid(pid, 0)


def _limit_memory(extra: int) -> None:
    """Cap this process's address space at its current size plus `extra` bytes (Linux; elsewhere no cap)."""
    if resource is None:
        return
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (OSError, ValueError):
        pass


def load_tokenizer(path) -> Tokenizer | None:
    """The tokenizer in checkpoint directory `path`, or None when it has no tokenizer.json / tokenizer.model."""
    path = Path(path)
    if not any((path / n).is_file() for n in (JSON_FILE, SPM_FILE)):
        return None
    files = {n: (path / n).read_bytes() for n in TOKENIZER_FILES if (path / n).is_file()}
    try:
        return Tokenizer(files)
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}") from None
