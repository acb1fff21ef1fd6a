"""The draft tokens an engine reports, read in one place: per answer (llama.cpp's `timings`, in its native
/completion answer and its OpenAI-compatible one alike; SGLang's `meta_info`), per server (vLLM's Prometheus
/metrics spec-decode counters, read before and after a run), and summed over a run (`Tally`).

Every count is checked before it is used: a non-negative integer, no more accepted than drafted, and a server whose
counters vanished or went back during the run (a restart) is a one-line ServerError naming the server. None stands
for "the engine tells nothing", never for zero.
"""

from __future__ import annotations

import math
import re

from ..errors import is_int, show
from .http import SMALL_REQUEST_S, ServerError, base_url, get_text

MAX_DRAFT_COUNT = 2**31 - 1  # llama.cpp counts drafted tokens in an int32


def count(v, what: str, where: str) -> int | None:
    """A count the server reported: a non-negative integer, None when absent, else ServerError."""
    if v is None:
        return None
    if not is_int(v) or v < 0:
        raise ServerError(f"{where} reported {what} = {show(v)}, not a count")
    return int(v)


def checked(drafted: int | None, accepted: int | None, names: str, where: str) -> tuple[int | None, int | None]:
    """One answer's draft counts, checked as /metrics' are: no more accepted than drafted."""
    if drafted is not None and accepted is not None and accepted > drafted:
        raise ServerError(f"{where} reported {accepted} draft tokens accepted of {drafted} drafted ({names}): not "
                          "counts of one answer")
    return drafted, accepted


def llama_timings(resp, tokens: int, where: str, path: str, absent=(0, 0)) -> tuple[int | None, int | None]:
    """The draft tokens a llama-server answer (to `path`: its native /completion or its /v1/completions) says it
    drafted and accepted: timings.draft_n and draft_n_accepted (0 for one left out: llama.cpp writes them only
    where it drafted), `absent` for an answer without timings (another engine's); checked: integers in
    [0, MAX_DRAFT_COUNT], no more accepted than drafted nor than the tokens returned."""
    timings = resp.get("timings") if isinstance(resp, dict) else None
    if not isinstance(timings, dict):
        return absent
    n, a = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    for name, v in (("draft_n", n), ("draft_n_accepted", a)):
        if not is_int(v) or not 0 <= v <= MAX_DRAFT_COUNT:
            raise ServerError(f"{where}: the {path} answer's timings.{name} is {show(v)}, not a count of draft tokens "
                              f"(an integer in [0, {MAX_DRAFT_COUNT}])")
    checked(n, a, "timings.draft_n_accepted of timings.draft_n", where)
    if a > tokens:
        raise ServerError(f"{where} reported {a} draft tokens accepted for {tokens} tokens returned "
                          "(timings.draft_n_accepted): not counts of one answer")
    return int(n), int(a)


def sglang_meta(meta: dict, where: str) -> tuple[int | None, int | None]:
    """The draft tokens of an SGLang /generate answer's meta_info: spec_draft_token_num and spec_accept_token_num;
    (0, 0) when it reports no verify pass (spec_verify_ct 0), None when it tells nothing."""
    verify = count(meta.get("spec_verify_ct"), "spec_verify_ct", where)
    drafted = count(meta.get("spec_draft_token_num"), "spec_draft_token_num", where)
    accepted = count(meta.get("spec_accept_token_num"), "spec_accept_token_num", where)
    if verify == 0:
        return 0, 0
    return checked(drafted, accepted, "spec_accept_token_num of spec_draft_token_num", where)


# vLLM's spec-decode counters (vllm/v1/metrics/loggers.py, labels model_name and engine): prometheus_client shows
# a Counter as NAME_total; the bare NAME is taken too, for exporters that write the family name.
METRICS = {"drafted": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens"),
           "accepted": ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens")}
METRICS_BYTES = 8 << 20  # a vLLM /metrics page is tens of KB; far more is not a metrics page
_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def _labels(text: str | None, line: str, where: str) -> dict:
    out, pos = {}, 0
    text = text or ""
    while pos < len(text.rstrip()):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ServerError(f"{where}: /metrics line {show(line)} has labels that cannot be read")
        out[m.group(1)] = re.sub(r"\\(.)", lambda e: {"n": "\n"}.get(e.group(1), e.group(1)), m.group(2))
        pos = m.end()
    return out


def _escaped(value: str) -> str:
    """A label value as Prometheus' text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str, model: str | None, where: str) -> dict | None:
    """{"drafted": n, "accepted": n} summed over the label sets of `model` (a sample without a model_name label
    counts), from Prometheus text. A vLLM page (samples of `vllm:` metrics for the model) without the spec-decode
    counters is a vLLM serving without speculation, which registers no such counters: {"drafted": 0, "accepted":
    0}. None when the page is not vLLM's. Lines of other metrics are only looked at for their name and model; a
    counter line that cannot be read, a value that is not a count, a label set given twice, or one counter
    without the other is ServerError."""
    names = {n: key for key, pair in METRICS.items() for n in pair}
    found: dict = {}  # metric name -> {label set: value}
    mine = None if model is None else f'model_name="{_escaped(model)}"'
    vllm_page = False  # a sample of a vllm: metric for this model (or without a model_name label)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("vllm:") and (mine is None or mine in line or "model_name=" not in line):
            vllm_page = True
        if line.split("{", 1)[0].split()[0] not in names:
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ServerError(f"{where}: /metrics line {show(line)} is not a Prometheus sample")
        name, labels = m.group(1), _labels(m.group(2), line, where)
        try:
            value = float(m.group(3))
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0 and value == int(value)):
            raise ServerError(f"{where}: /metrics gives {name} = {show(m.group(3))}, not a count")
        if model is not None and labels.get("model_name", model) != model:
            continue  # another model served beside it
        key = tuple(sorted(labels.items()))
        seen = found.setdefault(name, {})
        if key in seen:
            raise ServerError(f"{where}: /metrics gives {name} twice for the labels {show(dict(key))}")
        seen[key] = int(value)
    out = {}
    for key, (total, bare) in METRICS.items():
        values = found.get(total, found.get(bare))
        out[key] = None if values is None else sum(values.values())
    if out["drafted"] is None and out["accepted"] is None:
        return {"drafted": 0, "accepted": 0} if vllm_page else None
    if None in out.values():
        raise ServerError(f"{where}: /metrics gives {'drafted' if out['accepted'] is None else 'accepted'} draft "
                          "tokens but not the other count")
    return out


def read_metrics(endpoint) -> dict | None:
    """The spec-decode counters of the server's /metrics (at its root, beside BASE), or None when it has no such
    endpoint or counters. endpoint: a drawing.Endpoint (its url, deadline, model and name)."""
    root = base_url(endpoint.url)
    text = get_text(root + "/metrics", deadline=min(endpoint.deadline, SMALL_REQUEST_S), max_bytes=METRICS_BYTES,
                    server_name=endpoint.name)
    return None if text is None else parse_metrics(text, endpoint.model, endpoint.name)


def metrics_delta(before: dict | None, after: dict | None, where: str) -> dict | None:
    """The draft tokens counted between two readings; None when the first had no counters; ServerError when the
    counters vanished or went back (a restarted server), or more were accepted than drafted."""
    if before is None:
        return None
    if after is None:
        raise ServerError(f"{where}: the /metrics spec-decode counters were there before the run and not after it "
                          "(the server restarted?)")
    d = {k: after[k] - before[k] for k in before}
    if min(d.values()) < 0:
        raise ServerError(f"{where}: the /metrics spec-decode counters went back during the run ({before} before, "
                          f"{after} after: the server restarted?)")
    if d["accepted"] > d["drafted"]:
        raise ServerError(f"{where}: /metrics counted {d['accepted']} accepted draft tokens of {d['drafted']} drafted "
                          "during the run")
    return d


class Tally:
    """A run's draft counts, summed over its answers as they come (from any thread, under the caller's lock); a
    count that one answer left unknown is unknown for the run."""

    def __init__(self):
        self.sums = {"drafted": 0, "accepted": 0}
        self.unknown: set[str] = set()

    def add(self, drafted: int | None, accepted: int | None) -> None:
        for key, v in (("drafted", drafted), ("accepted", accepted)):
            if v is None:
                self.unknown.add(key)
            else:
                self.sums[key] += v

    def known(self) -> tuple[int | None, int | None]:
        """(drafted, accepted) summed over the answers so far, None for a count some answer left unknown."""
        return tuple(None if key in self.unknown else self.sums[key] for key in ("drafted", "accepted"))


def run_counts(known: tuple[int | None, int | None], before: dict | None, after, where: str):
    """(drafted, accepted) of a run: the answers' sums (`known`, a Tally's), else (when they told nothing) the
    server's counters between `before` and `after()` (a reading taken now), else None."""
    if known[0] is None and before is not None:
        delta = metrics_delta(before, after(), where)
        return delta["drafted"], delta["accepted"]
    return known
