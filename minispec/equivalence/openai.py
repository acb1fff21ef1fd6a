"""Deployed engines reached by protocol: an OpenAI-compatible completions endpoint (vLLM, llama.cpp, SGLang, ...)
or SGLang's native /generate, each an `Endpoint` a drawing.Drawing draws from.

    endpoint = Endpoint("http://10.0.0.5:8000/v1", kind="openai")            # vLLM, llama.cpp, SGLang, ...
    drawn = draw(endpoint, prompts, counts=[500], tokens=8, params=SamplingParams(0.7, 50, None), seed=0,
                 vocab_size=49152, concurrency=4)                             # drawing.draw
    drawn.samples            # a SampleSet, for harness.audit_samples (with the target) or two_sample.compare

`kind="openai"` POSTs `BASE/completions` (BASE ends in /v1; the model named by `model`, default the first of
`BASE/models`); `kind="sglang"` POSTs `BASE/generate` with `input_ids` and `sampling_params` (llama-server's
native /completion is llama_server.Endpoint). Every request:

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
Drafting is read where the engine reports it (minispec.equivalence.drafts): llama.cpp's per-request
`timings.draft_n` / `draft_n_accepted`, SGLang's `meta_info.spec_draft_token_num` / `spec_accept_token_num`, and
for kind "openai" when the answers tell nothing (vLLM) the server's Prometheus `/metrics` spec-decode counters
read before and after the run (vLLM's `vllm:spec_decode_num_draft_tokens_total` / `..._accepted_tokens_total`);
None where it tells nothing.
"""

from __future__ import annotations

import math

from ..errors import is_int, show
from ..sampling import SamplingParams
from .drafts import count, llama_timings, read_metrics, sglang_meta
from .drawing import PROB_TOLERANCE, ModelMismatchError, prob_difference
from .drawing import Endpoint as EndpointBase
from .http import REQUEST_S, Cancel, ServerError, ascii_digits, base_url, check_seconds, get_json
from .llama_server import OFF, SAMPLERS

KINDS = ("openai", "sglang")  # the command line's --engine names for these
# llama.cpp's stages, off, minus what the OpenAI body states in its own words (logit_bias, stop, n_probs)
LLAMA_OFF = {k: v for k, v in OFF.items() if k not in ("logit_bias", "stop", "n_probs")}


class Endpoint(EndpointBase):
    """One server under test by protocol. kind "openai": `url` is BASE (ending in /v1) of /completions and /models;
    kind "sglang": `url` is the server's root, /generate. deadline: seconds per request, the whole answer."""

    def __init__(self, url: str, kind: str = "openai", model: str | None = None, deadline: float = REQUEST_S,
                 cancel: Cancel | None = None):
        if kind not in KINDS:
            raise ServerError(f"kind must be one of {', '.join(KINDS)}; got {show(kind)}")
        root = base_url(url)
        path = url.strip().split(root.split("://", 1)[1], 1)[-1].rstrip("/") if "://" in url else ""
        url = root + path
        super().__init__(url, f"{'SGLang' if kind == 'sglang' else 'the OpenAI-compatible server'} at {url}",
                         check_seconds(deadline, "the request deadline"), cancel)
        self.kind, self.model = kind, model
        if kind == "openai" and model is None:
            self.model = self.models()[0]

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
        if self.kind == "sglang":
            return parse_sglang(self._get("/generate", self.body(prompt, tokens, params, seed)), tokens, vocab_size,
                                self.name)
        return parse_completion(self._get("/completions", self.body(prompt, tokens, params, seed)), tokens,
                                vocab_size, self.model, self.name)

    def counters(self) -> dict | None:
        """vLLM's /metrics spec-decode counters (kind "openai"; SGLang reports drafts in its answers)."""
        return read_metrics(self) if self.kind == "openai" else None

    def check_model(self, target, prompt: list[int]) -> dict:
        return check_same_model(self, target, prompt)


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
    within PROB_TOLERANCE, else ModelMismatchError naming the difference. Returns what was compared."""
    theirs = top_probs(endpoint, prompt, target.config.vocab_size)
    diff = prob_difference(theirs, target, prompt)
    if not diff <= PROB_TOLERANCE:
        raise ModelMismatchError(f"{endpoint.name}: its next-token probabilities after the first prompt differ from "
                                 f"the target's by up to {diff:.3g} (> {PROB_TOLERANCE}): not the --target model, or "
                                 "not in its precision (--no-model-check skips this)")
    return {"tokens_compared": len(theirs), "prob_difference": diff}


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
    n = count(usage.get("completion_tokens") if isinstance(usage, dict) else None, "completion_tokens", where)
    if n is not None and n != tokens:
        raise ServerError(f"{where} reported {n} completion tokens, {tokens} were asked for")
    # llama.cpp's per-request timings; vLLM's answers hold none (its /metrics counters tell)
    return ids, *llama_timings(resp, tokens, where, "/completions", absent=(None, None))


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
    n = count(meta.get("completion_tokens"), "completion_tokens", where)
    if n is not None and n != tokens:
        raise ServerError(f"{where} reported {n} completion tokens, {tokens} were asked for")
    return ids, *sglang_meta(meta, where)
