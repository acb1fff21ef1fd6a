"""Deployed engines reached by protocol: an OpenAI-compatible completions endpoint, SGLang's native /generate, or
llama-server's native /completion.

    endpoint = Endpoint("http://10.0.0.5:8000/v1", kind="openai")            # vLLM, llama.cpp, SGLang, ...
    drawn = draw(endpoint, prompts, counts=[500], tokens=8, params=SamplingParams(0.7, 50, None), seed=0,
                 vocab_size=49152, concurrency=4)
    drawn.samples            # a SampleSet, for harness.audit_samples (with the target) or two_sample.compare

`kind="openai"` POSTs `BASE/completions` (BASE ends in /v1; the model named by `model`, default the first of
`BASE/models`); `kind="sglang"` POSTs `BASE/generate` with `input_ids` and `sampling_params`; `kind="llama.cpp"`
POSTs the server's `/completion` through a llama_server.ServerClient (`client`), with the body of
llama_server.request_body, the ids of its `tokens` and the draft counts of its `timings`. Every request:

- the prompt as token ids, never text, and its own seed (sample g: seed + g; with `mixed_seeds` every other
  sample goes unseeded, as a batch mixing seeded and unseeded requests does);
- every sampler stage written out, whatever the server's defaults: the stated temperature, top-k and top-p;
  min-p 0; repetition, presence and frequency penalties neutral; no logit bias; no stop strings; end tokens
  ignored and exactly `tokens` new ones asked for (vLLM's `min_tokens`, SGLang's `min_new_tokens`). The fields
  of every engine the body may reach go in one body (an engine ignores another's fields): vLLM's and SGLang's
  OpenAI fields, and llama.cpp's own chain (`samplers`, its `OFF` stages) as llama_server writes them;
- the sampled ids read back as ids: vLLM's `logprobs.tokens` as "token_id:ID" (`return_tokens_as_token_ids`
  with `logprobs` 1), llama.cpp's `logprobs.content[i].id` (its `n_probs`), SGLang's `output_ids`.

What the server answers is checked: the model it names, exactly `tokens` ids in the target's vocabulary, its
reported completion token count, a finish reason of length. Anything else is a one-line ServerError.
Drafting is read where the engine reports it: llama.cpp's per-request `timings.draft_n` / `draft_n_accepted`,
SGLang's `meta_info.spec_draft_token_num` / `spec_accept_token_num`, and for kind "openai" when the answers tell
nothing (vLLM) the server's Prometheus `/metrics` spec-decode counters read before and after the run (vLLM's
`vllm:spec_decode_num_draft_tokens_total` / `..._accepted_tokens_total`); None where it tells nothing.

`Drawing` draws as it is read (`chunks`), so an audit whose early-stop look fails ends the sampling there;
`draw` draws everything at once; `server_drawing` / `server_samples` do the same for a llama-server (its
build read and its model checked first). Its requests run in daemon threads that a failure, a stopped reader or Ctrl-C
ends at once (`http.Cancel`), so a server that never answers cannot keep the process alive.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import check_int, is_int, show
from ..sampling import SamplingParams
from .http import REQUEST_S, Cancel, ServerError, ascii_digits, base_url, check_seconds, get_json, get_text
from .llama_server import CONCURRENCY as LLAMA_CPP_CONCURRENCY
from .llama_server import ENGINE as LLAMA_CPP
from .llama_server import OFF, PROB_TOLERANCE, SAMPLERS, ServerClient, draft_counts, parse_tokens, request_body
from .llama_server import check_same_model as llama_check_same_model
from .samples import SampleSet, group

KINDS = ("openai", "sglang")  # the command line's --engine names for these; llama.cpp has its own (llama_server)
MAX_SEED = 2**32 - 2  # the smallest seed range of the engines (llama.cpp's uint32, 0xFFFFFFFF meaning random)
# llama.cpp's stages, off, minus what the OpenAI body states in its own words (logit_bias, stop, n_probs)
LLAMA_OFF = {k: v for k, v in OFF.items() if k not in ("logit_bias", "stop", "n_probs")}


@dataclass
class Drawn:
    """What `draw` brings back: the samples, and the draft tokens the engine reported (None: it tells nothing)."""
    samples: SampleSet
    drafted: int | None = None
    accepted: int | None = None
    requests: int = 0
    notes: list = field(default_factory=list)


class Endpoint:
    """One server under test. kind "openai": `url` is BASE (ending in /v1) of /completions and /models; kind
    "sglang": `url` is the server's root, /generate; kind "llama.cpp": `url` is the root of a llama-server, whose
    /completion is reached through `client` (a llama_server.ServerClient, made from url and deadline when None:
    give the one of a started LlamaServer, so that a crash reads as one). deadline: seconds per request, the whole
    answer."""

    def __init__(self, url: str, kind: str = "openai", model: str | None = None, deadline: float = REQUEST_S,
                 cancel: Cancel | None = None, client: ServerClient | None = None):
        if kind not in (*KINDS, LLAMA_CPP):
            raise ServerError(f"kind must be one of {', '.join((*KINDS, LLAMA_CPP))}; got {show(kind)}")
        self.cancel = cancel or Cancel()
        self.kind, self.model, self.client = kind, model, client
        if kind == LLAMA_CPP:
            self.client = client or ServerClient(url, timeout=deadline)
            self.url, self.deadline, self.name = self.client.url, self.client.timeout, self.client.name
            return
        root = base_url(url)
        path = url.strip().split(root.split("://", 1)[1], 1)[-1].rstrip("/") if "://" in url else ""
        self.url = root + path
        self.deadline = check_seconds(deadline, "the request deadline")
        self.name = f"{'SGLang' if kind == 'sglang' else 'the OpenAI-compatible server'} at {self.url}"
        if kind == "openai" and model is None:
            self.model = self.models()[0]

    @property
    def stated(self) -> dict:
        """What a drawing's settings line states about this endpoint's requests."""
        if self.kind == LLAMA_CPP:
            return {"samplers": SAMPLERS, "ignore_eos": "end-of-generation tokens masked (logit bias -inf)"}
        return {"model": self.model}

    def _get(self, path: str, payload=None):
        return get_json(self.url + path, payload, deadline=self.deadline, server_name=self.name, cancel=self.cancel)

    def models(self) -> list[str]:
        """The ids of BASE/models (an OpenAI list: {"data": [{"id": ...}, ...]})."""
        out = self._get("/models")
        data = out.get("data") if isinstance(out, dict) else None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if not ids or not all(isinstance(i, str) and i for i in ids):
            raise ServerError(f"{self.name}: /models lists no model ids (an OpenAI list {{\"data\": [{{\"id\": "
                              "...}]}}); name the model with --model NAME")
        return ids

    def body(self, prompt: list[int], tokens: int, params: SamplingParams, seed: int | None) -> dict:
        """One request: exactly the stated settings, every other sampler stage off, end tokens ignored."""
        if self.kind == LLAMA_CPP:
            body = request_body(prompt, tokens, params, 0 if seed is None else seed)
            if seed is None:
                del body["seed"]  # unseeded (mixed_seeds): the server picks one
            return body
        top_k = -1 if params.top_k is None else params.top_k  # off for vLLM, SGLang and llama.cpp (k <= 0) alike
        top_p = 1.0 if params.top_p is None else params.top_p
        if self.kind == "sglang":
            sp = dict(temperature=params.temperature, top_k=top_k, top_p=top_p, min_p=0.0, repetition_penalty=1.0,
                      presence_penalty=0.0, frequency_penalty=0.0, max_new_tokens=tokens, min_new_tokens=tokens,
                      ignore_eos=True, stop=[], stop_token_ids=[], n=1, skip_special_tokens=False,
                      no_stop_trim=True)
            if seed is not None:
                sp["sampling_seed"] = seed
            return {"input_ids": list(prompt), "sampling_params": sp, "stream": False, "return_logprob": False}
        out = {**LLAMA_OFF, **dict(
            model=self.model, prompt=list(prompt), max_tokens=tokens, n=1, stream=False, echo=False,
            temperature=params.temperature, top_k=top_k, top_p=top_p, min_p=0.0, repetition_penalty=1.0,
            presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, stop=[], ignore_eos=True, min_tokens=tokens,
            skip_special_tokens=False, logprobs=1, return_tokens_as_token_ids=True, n_probs=1, samplers=SAMPLERS,
            n_predict=tokens)}
        if seed is not None:
            out["seed"] = seed
        return out

    def sample(self, prompt: list[int], tokens: int, params: SamplingParams, seed: int | None,
               vocab_size: int) -> tuple[list[int], int | None, int | None]:
        """One sample: its ids, and the draft tokens drafted and accepted the engine reported (or None)."""
        if self.kind == LLAMA_CPP:
            resp = self.client.post("/completion", self.body(prompt, tokens, params, seed), cancel=self.cancel)
            return (parse_tokens(resp, tokens, vocab_size), *draft_counts(resp, tokens, self.name))
        if self.kind == "sglang":
            return parse_sglang(self._get("/generate", self.body(prompt, tokens, params, seed)), tokens, vocab_size,
                                self.name)
        return parse_completion(self._get("/completions", self.body(prompt, tokens, params, seed)), tokens,
                                vocab_size, self.model, self.name)


TOP = 20  # next-token probabilities the model check compares


def top_probs(endpoint: Endpoint, prompt: list[int], vocab_size: int) -> dict[int, float]:
    """The server's TOP most likely next tokens after `prompt` with their probabilities, at temperature 1 with no
    filter: vLLM's top_logprobs keyed "token_id:ID", llama.cpp's logprobs.content[0].top_logprobs (its n_probs),
    SGLang's meta_info.output_top_logprobs ([logprob, id, text] entries)."""
    params = SamplingParams(1.0, None, None)
    body = endpoint.body(prompt, 1, params, 0)
    where = endpoint.name
    if endpoint.kind == "sglang":
        body.update(return_logprob=True, top_logprobs_num=TOP)
        meta = endpoint._get("/generate", body).get("meta_info", {})
        rows = meta.get("output_top_logprobs") if isinstance(meta, dict) else None
        entries = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], list) else None
        pairs = [(e[1], e[0]) for e in entries if isinstance(e, list) and len(e) >= 2] if entries else []
    else:
        body.update(logprobs=TOP, n_probs=TOP)
        resp = endpoint._get("/completions", body)
        choice = resp.get("choices", [{}])[0] if isinstance(resp.get("choices"), list) and resp["choices"] else {}
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        pairs = []
        if isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list) and lp["top_logprobs"]:
            first = lp["top_logprobs"][0]  # vLLM: {"token_id:ID": logprob}
            if isinstance(first, dict):
                pairs = [(k.partition(":")[2], v) for k, v in first.items() if isinstance(k, str)]
        elif isinstance(lp, dict) and isinstance(lp.get("content"), list) and lp["content"]:
            first = lp["content"][0].get("top_logprobs") if isinstance(lp["content"][0], dict) else None
            pairs = [(e.get("id"), e.get("logprob")) for e in first if isinstance(e, dict)] if isinstance(
                first, list) else []
    out = {}
    for tok, logprob in pairs:
        tok = int(tok) if isinstance(tok, str) and ascii_digits(tok) else tok
        if not is_int(tok) or not 0 <= tok < vocab_size or isinstance(logprob, bool) or \
                not isinstance(logprob, (int, float)) or not logprob <= 0:
            raise ServerError(f"{where} sent a next-token probability entry ({show(tok)}, {show(logprob)}) that is "
                              "not a token id in the target's vocabulary with a log-probability")
        out[int(tok)] = math.exp(logprob)
    if not out:
        raise ServerError(f"{where} sent no next-token probabilities (top logprobs) for the model check; "
                          "--no-model-check skips it")
    return out


def check_same_model(endpoint: Endpoint, target, prompt: list[int]) -> dict:
    """The server's next-token probabilities after `prompt` against the target's (temperature 1, unfiltered):
    within PROB_TOLERANCE, else ModelMismatch naming the difference. Returns what was compared. A llama.cpp
    endpoint gets llama_server.check_same_model (sizes, token texts and probabilities through its native API)."""
    if endpoint.kind == LLAMA_CPP:
        return llama_check_same_model(endpoint.client, target, prompt)
    theirs = top_probs(endpoint, prompt, target.config.vocab_size)
    with torch.inference_mode():
        ours = target(torch.tensor([prompt], device=target.device))[0, -1].float().softmax(-1).cpu()
    diff = max(abs(p - float(ours[i])) for i, p in theirs.items())
    if not diff <= PROB_TOLERANCE:
        raise ModelMismatch(f"{endpoint.name}: its next-token probabilities after the first prompt differ from the "
                            f"target's by up to {diff:.3g} (> {PROB_TOLERANCE}): not the --target model, or not in "
                            "its precision (--no-model-check skips this)")
    return {"tokens_compared": len(theirs), "prob_difference": diff}


class ModelMismatch(ServerError):
    """The server's model is not the --target: one line naming what differs."""


def _count(v, what: str, where: str) -> int | None:
    """A count the server reported: a non-negative integer, None when absent, else ServerError."""
    if v is None:
        return None
    if not is_int(v) or v < 0:
        raise ServerError(f"{where} reported {what} = {show(v)}, not a count")
    return int(v)


def _drafts(drafted: int | None, accepted: int | None, names: str, where: str) -> tuple[int | None, int | None]:
    """One answer's draft counts, checked as /metrics' are: no more accepted than drafted."""
    if drafted is not None and accepted is not None and accepted > drafted:
        raise ServerError(f"{where} reported {accepted} draft tokens accepted of {drafted} drafted ({names}): not "
                          "counts of one answer")
    return drafted, accepted


def _check_ids(ids, tokens: int, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise ServerError(f"{where} sent no list of token ids")
    if len(ids) != tokens:
        raise ServerError(f"{where} sent {len(ids)} token ids, {tokens} were asked for with end tokens ignored")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ServerError(f"{where} sent token id {show(bad)}, outside the target's vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def _token_ids_from_logprobs(lp, where: str):
    """vLLM: logprobs.tokens as "token_id:ID"; llama.cpp: logprobs.content[i].id. None when neither is there."""
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("tokens"), list):
        out = []
        for t in lp["tokens"]:
            head, _, tail = t.partition(":") if isinstance(t, str) else ("", "", "")
            if head != "token_id" or not ascii_digits(tail):
                raise ServerError(f"{where} sent logprobs.tokens entry {show(t)}, not \"token_id:ID\" (ask vLLM "
                                  "with return_tokens_as_token_ids)")
            out.append(int(tail))
        return out
    if isinstance(lp.get("content"), list):
        return [c.get("id") if isinstance(c, dict) else None for c in lp["content"]]
    return None


def parse_completion(resp, tokens: int, vocab_size: int, model: str | None, where: str):
    """An OpenAI /completions answer -> (ids, drafted, accepted), checked."""
    choice = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choice, list) or len(choice) != 1 or not isinstance(choice[0], dict):
        raise ServerError(f"{where}: the /completions answer has no single choice in \"choices\"")
    choice = choice[0]
    if model is not None and resp.get("model") not in (None, model):
        raise ServerError(f"{where} answered as model {show(resp.get('model'))}, {show(model)} was asked for")
    ids = _token_ids_from_logprobs(choice.get("logprobs"), where)
    if ids is None:
        raise ServerError(f"{where}: the answer holds no sampled token ids (vLLM's logprobs.tokens with "
                          "return_tokens_as_token_ids, or llama.cpp's logprobs.content[].id)")
    ids = _check_ids(ids, tokens, vocab_size, where)
    if choice.get("finish_reason") not in (None, "length"):
        raise ServerError(f"{where} stopped for {show(choice.get('finish_reason'))}: end tokens are ignored and "
                          f"{tokens} tokens asked for, so only \"length\" is expected")
    usage = resp.get("usage")
    n = _count(usage.get("completion_tokens") if isinstance(usage, dict) else None, "completion_tokens", where)
    if n is not None and n != tokens:
        raise ServerError(f"{where} reported {n} completion tokens, {tokens} were asked for")
    timings = resp.get("timings")
    drafted = accepted = None
    if isinstance(timings, dict):  # llama.cpp's per-request timings: draft_n only where it drafted (server-common.cpp)
        drafted = _count(timings.get("draft_n", 0), "timings.draft_n", where)
        accepted = _count(timings.get("draft_n_accepted", 0), "timings.draft_n_accepted", where)
    return ids, *_drafts(drafted, accepted, "timings.draft_n_accepted of timings.draft_n", where)


def parse_sglang(resp, tokens: int, vocab_size: int, where: str):
    """An SGLang /generate answer -> (ids, drafted, accepted), checked: meta_info's spec_draft_token_num and
    spec_accept_token_num; (0, 0) when it reports no verify pass (spec_verify_ct 0), None when it tells nothing."""
    if not isinstance(resp, dict) or not isinstance(resp.get("meta_info"), dict):
        raise ServerError(f"{where}: the /generate answer has no meta_info object")
    meta = resp["meta_info"]
    ids = _check_ids(resp.get("output_ids"), tokens, vocab_size, where)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in (None, "length"):
        raise ServerError(f"{where} stopped for {show(finish)}: end tokens are ignored and {tokens} tokens asked "
                          "for, so only \"length\" is expected")
    n = _count(meta.get("completion_tokens"), "completion_tokens", where)
    if n is not None and n != tokens:
        raise ServerError(f"{where} reported {n} completion tokens, {tokens} were asked for")
    verify = _count(meta.get("spec_verify_ct"), "spec_verify_ct", where)
    drafted = _count(meta.get("spec_draft_token_num"), "spec_draft_token_num", where)
    accepted = _count(meta.get("spec_accept_token_num"), "spec_accept_token_num", where)
    if verify == 0:
        return ids, 0, 0
    return ids, *_drafts(drafted, accepted, "spec_accept_token_num of spec_draft_token_num", where)


def check_seed_range(seed: int, n: int) -> None:
    last = seed + n - 1
    if seed < 0 or last > MAX_SEED:
        raise ServerError(f"the seeds seed .. seed + samples - 1 must lie in [0, {MAX_SEED}] (llama.cpp's seeds are "
                          f"32-bit); the last is {last}")


# vLLM's spec-decode counters (vllm/v1/metrics/loggers.py, labels model_name and engine): prometheus_client shows
# a Counter as NAME_total; the bare NAME is taken too, for exporters that write the family name.
METRICS = {"drafted": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens"),
           "accepted": ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens")}
METRICS_BYTES = 8 << 20  # a vLLM /metrics page is tens of KB; far more is not a metrics page
METRICS_DEADLINE = 30.0
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


def read_metrics(endpoint: Endpoint) -> dict | None:
    """The spec-decode counters of the server's /metrics (at its root, beside BASE), or None when it has no such
    endpoint or counters."""
    root = base_url(endpoint.url)
    text = get_text(root + "/metrics", deadline=min(endpoint.deadline, METRICS_DEADLINE), max_bytes=METRICS_BYTES,
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


class Drawing:
    """counts[j] samples after prompts[j] (sample g prompt-major, seeded seed + g; unseeded for odd g with
    mixed_seeds), `concurrency` requests in flight, drawn as `chunks` is read: stopping reading stops the
    sampling (the requests in flight ended at once). `settings` is the SampleSet's settings line (engine "openai",
    "sglang" or "llama.cpp", the settings written out, extra `settings` added); once the drawing ends, `drafted`
    and `accepted` are the draft tokens the engine reported (None: it tells nothing), also in
    settings["speculation"] with their acceptance rate (llama.cpp's answers always carry counts, so there a zero is
    stated only for a server started with a draft, settings["server_draft"]). `run()` draws every sample at once.
    The first failure stops the rest and is raised. Nothing is built per sample up front: a job is made as a
    request thread takes it."""

    def __init__(self, endpoint: Endpoint, prompts: list[list[int]], counts: list[int], tokens: int,
                 params: SamplingParams, seed: int, vocab_size: int, concurrency: int = 1, mixed_seeds: bool = False,
                 settings: dict | None = None, bar=None):
        if not is_int(concurrency) or concurrency < 1:
            raise ServerError(f"concurrency must be an integer >= 1, got {show(concurrency)}")
        self.prompts, self.counts = [list(p) for p in prompts], list(counts)
        self.total = sum(self.counts)
        check_seed_range(seed, self.total)
        self.endpoint, self.tokens, self.params, self.vocab_size = endpoint, tokens, params, vocab_size
        self.seed, self.concurrency, self.mixed_seeds, self.bar = seed, concurrency, mixed_seeds, bar
        self.settings = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "new_tokens": tokens, "engine": endpoint.kind, "engine_version": None, "url": endpoint.url,
                         **endpoint.stated, "seed": seed, "mixed_seeds": mixed_seeds, "concurrency": concurrency,
                         **(settings or {})}
        self.pairs: list = []  # (prompt, ids) drawn so far, in order
        self.drafted = self.accepted = None
        self.started = False

    def _bounds(self, size: int | None):
        """(prompt index, first sample, end) of each chunk, made as they are reached."""
        g = 0
        for j, n in enumerate(self.counts):
            b = size or max(n, 1)
            for s in range(0, n, b):
                yield j, g + s, g + min(n, s + b)
            g += n

    def chunks(self, size: int | None = None):
        """(prompt, [ids, ...]) for up to `size` consecutive samples of one prompt at a time (all of a prompt's
        when None), in order; the next chunk is drawn while this one is read."""
        if self.started:
            raise ServerError("a Drawing is drawn once")
        self.started = True
        before = read_metrics(self.endpoint) if self.endpoint.kind == "openai" else None
        ends = list(itertools.accumulate(self.counts))
        cond = threading.Condition()
        out: dict[int, list[int]] = {}  # drawn and not yet read, by sample index
        state = {"next": 0, "horizon": 0, "stop": False}  # the next job; jobs below horizon may be drawn
        failures: list[BaseException] = []
        drafts = {"drafted": 0, "accepted": 0, "unknown_drafted": 0, "unknown_accepted": 0}

        def work() -> None:
            try:
                while True:
                    with cond:
                        while not state["stop"] and state["horizon"] <= state["next"] < self.total:
                            cond.wait()
                        if state["stop"] or state["next"] >= self.total:
                            return
                        g = state["next"]
                        state["next"] += 1
                    ids, d, a = self.endpoint.sample(self.prompts[bisect.bisect_right(ends, g)], self.tokens,
                                                     self.params, None if self.mixed_seeds and g % 2 else self.seed + g,
                                                     self.vocab_size)
                    with cond:
                        out[g] = ids
                        for key, v in (("drafted", d), ("accepted", a)):
                            if v is None:
                                drafts[f"unknown_{key}"] += 1
                            else:
                                drafts[key] += v
                        if self.bar is not None:
                            self.bar.update(1)
                        cond.notify_all()
            except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
                with cond:
                    failures.append(e)
                    state["stop"] = True
                    cond.notify_all()
                self.endpoint.cancel()

        # daemon threads: a request stuck on a server that never answers cannot hold the process at its exit
        threads = [threading.Thread(target=work, name=f"{self.endpoint.kind}-request-{i}", daemon=True)
                   for i in range(min(self.concurrency, self.total))]
        try:
            for t in threads:
                t.start()
            bounds = self._bounds(size)
            here = next(bounds, None)
            while here is not None:
                ahead = next(bounds, None)
                j, lo, hi = here
                with cond:  # the next chunk is drawn meanwhile
                    state["horizon"] = (ahead or here)[2]
                    cond.notify_all()
                chunk: list = []
                with cond:
                    while len(chunk) < hi - lo:
                        if lo + len(chunk) in out:
                            chunk.append(out.pop(lo + len(chunk)))
                        elif failures:
                            raise failures[0]
                        else:
                            cond.wait(0.25)  # short waits: Ctrl-C reaches the main thread between them
                self.pairs += [(self.prompts[j], t) for t in chunk]
                yield self.prompts[j], chunk
                here = ahead
        except GeneratorExit:  # the reader stopped (an early-stop look failed): so does the sampling
            self.endpoint.cancel()
        except BaseException:
            self.endpoint.cancel()  # every request still in flight ends now: no thread outlives the run for long
            raise
        finally:
            with cond:
                state["stop"] = True
                cond.notify_all()
            stop = time.monotonic() + 2.0
            for t in threads:
                t.join(max(0.0, stop - time.monotonic()))
            if self.bar is not None:
                self.bar.close()
        with cond:  # stopped early: the requests that finished (some drawn ahead, never read) are what counted
            known = lambda key: None if drafts[f"unknown_{key}"] else drafts[key]  # noqa: E731
            self.drafted, self.accepted = known("drafted"), known("accepted")
        if self.drafted is None and before is not None:
            delta = metrics_delta(before, read_metrics(self.endpoint), self.endpoint.name)
            self.drafted, self.accepted = delta["drafted"], delta["accepted"]
        # every engine's count, zero included: a server that drafted nothing is named as such in the verdict
        if self.drafted is not None:
            self.settings["speculation"] = {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate":
                                            self.accepted / self.drafted if self.drafted else None}

    def run(self) -> Drawn:
        """Every sample, drawn now."""
        for _ in self.chunks():
            pass
        return Drawn(group(self.settings, self.pairs, self.endpoint.name), self.drafted, self.accepted, self.total)


def draw(endpoint: Endpoint, prompts: list[list[int]], counts: list[int], tokens: int, params: SamplingParams,
         seed: int, vocab_size: int, concurrency: int = 1, mixed_seeds: bool = False, settings: dict | None = None,
         bar=None) -> Drawn:
    """Every sample of a Drawing (see there), drawn at once: the SampleSet and the draft counts the engine
    reported."""
    return Drawing(endpoint, prompts, counts, tokens, params, seed, vocab_size, concurrency, mixed_seeds, settings,
                   bar).run()


def server_drawing(target, client: ServerClient, prompts: list[list[int]], samples: int, tokens: int,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int = 0,
                   workers: int = LLAMA_CPP_CONCURRENCY, model_check: bool = True, settings: dict | None = None,
                   progress: bool = False):
    """`samples` samples of `tokens` tokens after each prompt from the llama-server behind `client`, as a Drawing
    (kind "llama.cpp") that draws them as it is read: `audit_samples(target, drawing)`
    scores them chunk by chunk with the early-stop looks, so a clearly broken server stops being sampled at the
    first look that fails. Its settings line: engine "llama.cpp", the server's build as engine_version, `settings`
    added, the model check, and once drawn "speculation" (the draft tokens drafted and accepted, when the server
    drafted any or was started with a draft, `settings["server_draft"]`). The arguments are checked and the
    model is checked (unless model_check is False) here, before any sampling. Raises ServerError."""
    params = SamplingParams(temperature, top_k, top_p)
    check_int("samples", samples, 1, error=ServerError)
    check_int("tokens", tokens, 1, error=ServerError)
    check_int("workers", workers, 1, error=ServerError)
    check_int("seed", seed, 0, error=ServerError)
    check_seed_range(seed, samples * len(prompts))  # before the model check, so a run that cannot finish starts nothing
    head = {"engine_version": client.version(), **(settings or {})}
    head["model_check"] = llama_check_same_model(client, target, prompts[0]) if model_check else "skipped"
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=samples * len(prompts), desc=LLAMA_CPP, unit="sample", file=sys.stderr, dynamic_ncols=True)
    return Drawing(Endpoint(client.url, LLAMA_CPP, client=client), prompts, [samples] * len(prompts), tokens, params,
                   seed, target.config.vocab_size, concurrency=workers, settings=head, bar=bar)


def server_samples(target, client: ServerClient, prompts: list[list[int]], samples: int, tokens: int,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int = 0,
                   workers: int = LLAMA_CPP_CONCURRENCY, model_check: bool = True, settings: dict | None = None,
                   progress: bool = False) -> SampleSet:
    """Every sample of `server_drawing` (the same arguments), drawn now: the SampleSet audit_samples tests like a
    samples file. Raises ServerError."""
    return server_drawing(target, client, prompts, samples, tokens, temperature, top_k, top_p, seed, workers,
                          model_check, settings, progress).run().samples
