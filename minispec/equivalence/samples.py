"""Samples from any engine: the JSONL format the harness reads (--samples-file) and writes (--save-samples).

The first line states the sampling settings, null for a filter that is off:

    {"temperature": 0.7, "top_k": 50, "top_p": null, "new_tokens": 8, "engine": "vllm", "engine_version": "0.9.1"}

(other keys on it, such as "model" or "seed", are kept in the report as they are).
Every other line is one sample, `{"prompt": [ids], "tokens": [ids]}`, with exactly
`new_tokens` new ids, drawn with stop tokens disabled; prompts may differ from line
to line. `SampleSet` holds such a file grouped by distinct prompt (prompt-major, in
order of first appearance), the layout `target_pit` scores in one batched pass per
prompt.

A samples file must be a regular file (a FIFO would block, /dev/zero never ends), and no line may be longer
than the longest sample the target can score (`line_limit`), so reading one is bounded by its own size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, is_int, is_number, one_line, show
from ..sampling import SamplingParams

SETTINGS_KEYS = ("temperature", "top_k", "top_p", "new_tokens", "engine", "engine_version")
MIN_SAMPLES = 10  # the fewest samples a test (the PIT harness's, the two-sample audit's, each run's) takes
SAMPLE_KEYS = ("prompt", "tokens")
BYTES_PER_ID = 32  # a token id as JSON writes it, with its separator and room for spaces
LINE_SLACK = 1 << 20  # the rest of a line: keys, and whatever the settings line states besides the settings


class EquivalenceInputError(InputError):
    """Bad input to the harness (an argument, a samples file), found before any sampling; the command line exits
    with status 2 on it."""


class SamplesFileError(EquivalenceInputError):
    """A samples file that cannot be tested as it is: the message names the file, the line and what to change."""


@dataclass
class SampleSet:
    """Samples grouped by prompt: prompts[j] has counts[j] samples, tokens holds them all prompt-major."""
    settings: dict  # SETTINGS_KEYS, plus any other keys of the settings line
    prompts: list[list[int]]
    counts: list[int]
    tokens: list[list[int]]
    source: str = "(in memory)"

    @property
    def params(self) -> SamplingParams:
        s = self.settings
        return SamplingParams(s["temperature"], s["top_k"], s["top_p"])

    @property
    def new_tokens(self) -> int:
        return self.settings["new_tokens"]

    def per_sample_prompts(self):
        """(prompt index, prompt) of every sample, in the order of `tokens`."""
        for j, (p, n) in enumerate(zip(self.prompts, self.counts)):
            for _ in range(n):
                yield j, p

    def lines(self):
        """The JSONL lines of this set: the settings, then one line per sample."""
        yield json.dumps(self.settings)
        for (_, p), t in zip(self.per_sample_prompts(), self.tokens):
            yield json.dumps({"prompt": list(p), "tokens": list(t)})

    def write(self, path) -> None:
        """Write the set as JSONL, atomically: the file appears complete or not at all."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for line in self.lines():
                    f.write(line + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def group(settings: dict, pairs, source: str = "(in memory)") -> SampleSet:
    """A SampleSet from (prompt, tokens) pairs in any order: grouped by prompt, first appearance first."""
    by_prompt: dict[tuple, list[list[int]]] = {}
    for prompt, tokens in pairs:
        by_prompt.setdefault(tuple(prompt), []).append(list(tokens))
    prompts = [list(p) for p in by_prompt]
    return SampleSet(dict(settings), prompts, [len(v) for v in by_prompt.values()],
                     [t for v in by_prompt.values() for t in v], source)


def check_settings(s, where: str) -> dict:
    """The settings line's values, checked; raises SamplesFileError naming the field and the fix."""
    if not isinstance(s, dict):
        raise SamplesFileError(f"{where}: the first line must be a JSON object with the sampling settings "
                               f"{', '.join(SETTINGS_KEYS)}; got {type(s).__name__}")
    missing = [k for k in SETTINGS_KEYS if k not in s]
    if missing:
        raise SamplesFileError(f"{where}: the settings line lacks {', '.join(missing)} (it needs "
                               f"{', '.join(SETTINGS_KEYS)}; null for a filter that is off)")
    t, k, p, n = s["temperature"], s["top_k"], s["top_p"], s["new_tokens"]
    if not is_number(t) or not math.isfinite(t) or t < 0:
        raise SamplesFileError(f"{where}: temperature must be a number >= 0 (0 = greedy), got {t!r}")
    if k is not None and (not is_int(k) or k < 1):
        raise SamplesFileError(f"{where}: top_k must be an integer >= 1 or null (off), got {k!r}; an engine's "
                               "'off' value (vLLM's -1, llama.cpp's 0) is written null")
    if p is not None and (not is_number(p) or not 0 < p <= 1):
        raise SamplesFileError(f"{where}: top_p must be in (0, 1] or null (off), got {p!r}")
    if not is_int(n) or n < 1:
        raise SamplesFileError(f"{where}: new_tokens must be an integer >= 1, got {n!r}")
    if not isinstance(s["engine"], str) or not s["engine"]:
        raise SamplesFileError(f"{where}: engine must be a non-empty string (e.g. \"vllm\"), got {s['engine']!r}")
    if s["engine_version"] is not None and not isinstance(s["engine_version"], str):
        raise SamplesFileError(f"{where}: engine_version must be a string (or null if unknown), "
                               f"got {s['engine_version']!r}")
    return s


def _ids(v, what: str, where: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise SamplesFileError(f"{where}: {what} must be a list of integer token ids")
    bad = next((t for t in v if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplesFileError(f"{where}: {what} holds token id {show(bad)}, outside the target's vocabulary "
                               f"[0, {vocab_size}); the samples must come from a model with the target's tokenizer")
    return v


def check_sample(prompt, tokens, where: str, new_tokens: int, vocab_size: int, max_seq_len: int) -> None:
    """One sample: integer ids in the vocabulary, a non-empty prompt, exactly new_tokens new ids, in the window."""
    _ids(prompt, "prompt", where, vocab_size)
    _ids(tokens, "tokens", where, vocab_size)
    if not prompt:
        raise SamplesFileError(f"{where}: the prompt is empty; give at least one token id (e.g. the bos token)")
    if len(tokens) != new_tokens:
        raise SamplesFileError(f"{where}: {len(tokens)} new tokens, but the settings say new_tokens={new_tokens}; "
                               "sample with stop tokens disabled (e.g. ignore_eos / min_tokens) so every sample has "
                               f"exactly {new_tokens}")
    if len(prompt) + new_tokens > max_seq_len:
        raise SamplesFileError(f"{where}: prompt ({len(prompt)} tokens) + {new_tokens} new tokens exceeds the "
                               f"target's max_seq_len={max_seq_len}; the target cannot score it")


def _check_count(n: int, where: str, min_samples: int) -> None:
    if n < min_samples:
        raise SamplesFileError(f"{where} holds {n} sample(s); the test needs at least {min_samples} "
                               "(a few hundred or more for useful power)")


def validate(samples: SampleSet, vocab_size: int, max_seq_len: int, min_samples: int) -> None:
    """The checks `read_samples` makes, on a SampleSet built in memory."""
    check_settings(samples.settings, f"{samples.source} settings")
    for i, ((_, p), t) in enumerate(zip(samples.per_sample_prompts(), samples.tokens)):
        check_sample(p, t, f"{samples.source} sample {i}", samples.new_tokens, vocab_size, max_seq_len)
    _check_count(len(samples.tokens), samples.source, min_samples)


def open_regular(path, what: str, error: type[InputError] = SamplesFileError):
    """`path` opened for binary reading if it is a regular file; else `error` naming it. Opened without blocking
    and checked on the open file: a FIFO would wait for a writer, a device such as /dev/zero never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{what} {path} is not a regular file (a pipe or device): give a file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_output_path(path, what: str, error: type[InputError] = SamplesFileError) -> None:
    """An output file's path: absent or a regular file (a FIFO would block the write, a device would be
    replaced or written into); else `error`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise error(f"cannot write {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what} {path} exists and is not a regular file (a pipe, device or folder): give a file")


def line_limit(max_seq_len: int) -> int:
    """The longest line a samples file for a target of this window may hold (bytes)."""
    return BYTES_PER_ID * max_seq_len + LINE_SLACK


def _lines(path: Path, limit: int):
    """(line number, text) of the file's non-blank lines, each read up to `limit` bytes."""
    with open_regular(path, "samples file") as f:
        for no, raw in enumerate(iter(lambda: f.readline(limit + 1), b""), 1):
            if len(raw) > limit:
                raise SamplesFileError(f"{path} line {no} is longer than {limit} bytes, more than any sample the "
                                       "target can score; is it a samples file?")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SamplesFileError(f"cannot read samples file {path}: line {no} is not UTF-8 text") from None
            if line.strip():
                yield no, line


def read_samples(path, vocab_size: int, max_seq_len: int, min_samples: int) -> SampleSet:
    """Read and check a samples file against the target's vocabulary and window (SamplesFileError if it cannot
    be tested as it is)."""
    path = Path(path)
    try:
        lines = list(_lines(path, line_limit(max_seq_len)))
    except OSError as e:
        raise SamplesFileError(f"cannot read samples file {path}: {e.strerror or e}") from None
    if not lines:
        raise SamplesFileError(f"{path} is empty: the first line states the settings, each further line is one sample")
    rows = []
    for no, line in lines:
        try:
            rows.append((no, json.loads(line)))
        except json.JSONDecodeError as e:
            raise SamplesFileError(f"{path} line {no} is not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:  # arrays or objects nested thousands deep: no sample is shaped like that
            raise SamplesFileError(f"{path} line {no} nests its JSON too deeply to read; a sample is "
                                   '{"prompt": [ids], "tokens": [ids]}') from None
        except ValueError as e:  # Python's limit on integer digits (4300): no token id is that long
            raise SamplesFileError(f"{path} line {no} holds a number too long to read ({one_line(e).split(':')[0]}); "
                                   "token ids are small integers") from None
    settings = check_settings(rows[0][1], f"{path} line {rows[0][0]}")
    T = settings["new_tokens"]
    pairs = []
    for no, row in rows[1:]:
        where = f"{path} line {no}"
        if not isinstance(row, dict):
            raise SamplesFileError(f"{where}: a sample must be a JSON object {{\"prompt\": [ids], \"tokens\": [ids]}}")
        mixed = [k for k in SETTINGS_KEYS if k in row and row[k] != settings[k]]
        if mixed:
            k = mixed[0]
            raise SamplesFileError(f"{where}: mixed settings ({k}={row[k]!r} here, {settings[k]!r} on the settings "
                                   "line); one file holds one run's settings: split it into one file per setting")
        missing = [k for k in SAMPLE_KEYS if k not in row]
        if missing:
            raise SamplesFileError(f"{where}: a sample needs {' and '.join(SAMPLE_KEYS)}; this line lacks "
                                   f"{', '.join(missing)}")
        prompt, tokens = row["prompt"], row["tokens"]
        check_sample(prompt, tokens, where, T, vocab_size, max_seq_len)
        pairs.append((prompt, tokens))
    _check_count(len(pairs), str(path), min_samples)
    return group(settings, pairs, str(path))
