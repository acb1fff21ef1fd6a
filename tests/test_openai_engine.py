"""Deployed engines by protocol (minispec.equivalence.openai) and the two-sample audit (two_sample.compare), against
local stub servers written from the documented response shapes:

- vLLM's /v1/completions (`logprobs.tokens` as "token_id:ID" with return_tokens_as_token_ids, `usage`) and
  /v1/models; llama.cpp's /v1/completions (`logprobs.content[].id`, `timings.draft_n`); SGLang's /generate
  (`output_ids`, `meta_info.finish_reason`, `completion_tokens`, `spec_verify_ct`); llama-server's native
  /completion (`tokens`, `timings`, `completion_probabilities` with n_probs), /props and /v1/models' `meta`.

The stubs sample with minispec on the tiny pair, honouring the request's settings and seed (or, as negative
controls, breaking them): exact samples pass both audits (with the target: the PIT; without: two-sample against a
plain stub), and a broken sampler, a server that ignores the seed and one that silently changes a sampler setting
fail; a malformed, short, slow, failing (HTTP 500) answer or one without token ids is a one-line ServerError.
Every run uses fixed seeds, so every verdict here is deterministic.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minispec.equivalence import audit_samples
from minispec.equivalence.drawing import ModelMismatchError, draw
from minispec.equivalence.http import ServerError
from minispec.equivalence.openai import Endpoint, check_same_model
from minispec.equivalence.two_sample import compare
from minispec.sampling import SamplingParams

from helpers import tiny_pair

PROMPTS = [[1, 5, 2, 7, 3]]
PARAMS = SamplingParams(0.7, 8, None)
T = 3
N = 300
FAST = dict(power_runs=0)


class Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that hung up on purpose (a deadline, a stopped run) is no failure of the stub


class Stub:
    """A local server in one engine's shape ("vllm", "llama.cpp", "sglang", or "llama-server": llama.cpp's native
    /completion) sampling the tiny pair; `how` breaks
    it: a control sampler's name, "ignores-seed", "top-k-2" (another top-k than asked), "malformed", "short",
    "slow", "500", "no-ids", "plain" (no draft: reports 0 drafted).

    `metrics`: what GET /metrics serves: None (HTTP 404), "vllm" (vLLM's Prometheus text: the spec-decode
    counters of what was drafted so far, split over two engines, beside another model's and other metrics),
    "reset" (those counters back at 0 after the first sample, as a restarted server), or a str or bytes served
    as is.
    `requests` counts the sampling requests answered."""

    def __init__(self, shape: str, how: str = "exact", metrics: str | None = None):
        self.shape, self.how, self.metrics = shape, how, metrics
        self.target, self.draft = tiny_pair()
        self.lock = threading.Lock()  # the tiny model is not shared between threads
        self.requests = self.drafted = self.accepted = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    cfg = stub.target.config
                    meta = {"n_vocab": cfg.vocab_size, "n_embd": cfg.dim, "n_params": stub.target.weight_count()}
                    self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "meta": meta}]})
                elif self.path == "/props":
                    self._send(200, {"build_info": "b0-stub"})
                elif self.path == "/metrics" and stub.metrics is not None:
                    text = stub.prometheus()
                    self._send(200, text if isinstance(text, bytes) else text.encode())
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, out = stub.answer(self.path, body)
                self._send(code, out)

            def _send(self, code, out):
                raw = out if isinstance(out, bytes) else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{port}" + ("" if shape in ("sglang", "llama-server") else "/v1")

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def prometheus(self) -> str:
        """GET /metrics in vLLM's shape (prometheus_client's text: a Counter NAME shown as NAME_total)."""
        if self.metrics not in ("vllm", "reset"):
            return self.metrics
        with self.lock:
            d, a = (0, 0) if self.metrics == "reset" and self.requests > 1 else (self.drafted, self.accepted)
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge",
                 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
                 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0']
        for name, total in (("draft", d), ("accepted", a)):
            lines += [f"# HELP vllm:spec_decode_num_{name}_tokens_total Number of {name} tokens.",
                      f"# TYPE vllm:spec_decode_num_{name}_tokens_total counter",
                      f'vllm:spec_decode_num_{name}_tokens_total{{engine="0",model_name="tiny"}} {float(total // 2)}',
                      f'vllm:spec_decode_num_{name}_tokens_total{{engine="1",model_name="tiny"}} '
                      f"{float(total - total // 2)}",
                      f'vllm:spec_decode_num_{name}_tokens_created{{engine="0",model_name="tiny"}} 1.7e+09',
                      f'vllm:spec_decode_num_{name}_tokens_total{{engine="0",model_name="other"}} 9999.0']
        return "\n".join(lines) + "\n"

    def _sample(self, prompt, n, temperature, top_k, top_p, seed):
        top_k = None if top_k is None or top_k <= 0 else top_k
        top_p = None if top_p is None or top_p >= 1 else top_p
        if self.how == "top-k-2":
            top_k = 2
        if self.how == "ignores-seed" or seed is None:
            seed = 0 if self.how == "ignores-seed" else int(time.monotonic_ns() % 2**31)
        kw = dict(max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_tokens=[])
        with self.lock:
            self.requests += 1
            if self.how == "plain":
                return self.target.generate(prompt, **kw), 0, 0
            r = self.target.speculate(self.draft, prompt, k=2, sampler=self.how if self.how in SAMPLERS else "exact",
                                      **kw)
            self.drafted += r.stats.drafted
            self.accepted += r.stats.accepted
        return r.tokens, r.stats.drafted, r.stats.accepted

    def top(self, prompt, n):
        """The model's n most likely next tokens after prompt, at temperature 1: (id, logprob) pairs."""
        import torch
        with self.lock, torch.inference_mode():
            lp = self.target(torch.tensor([prompt]))[0, -1].float().log_softmax(-1)
        v, i = lp.topk(n)
        return list(zip(i.tolist(), v.tolist()))

    def answer(self, path, body):
        if self.how == "other-model":  # another model's weights serve: its probabilities differ
            self.target = tiny_pair()[1]
            self.how = "exact"
        if body.get("top_logprobs_num") or (body.get("logprobs") or 0) > 1 or (
                self.shape == "llama-server" and body.get("n_probs")):
            prompt = body.get("input_ids") or body["prompt"]
            top = self.top(prompt, 20)
            if self.shape == "llama-server":
                return 200, {"completion_probabilities": [{"top_logprobs": [{"id": i, "logprob": v} for i, v in top]}]}
            if self.shape == "sglang":
                return 200, {"output_ids": [top[0][0]], "meta_info": {"output_top_logprobs": [
                    [[v, i, "x"] for i, v in top]], "finish_reason": {"type": "length"}}}
            lp = ({"tokens": [f"token_id:{top[0][0]}"], "top_logprobs": [{f"token_id:{i}": v for i, v in top}]}
                  if self.shape == "vllm" else
                  {"content": [{"id": top[0][0], "logprob": top[0][1], "top_logprobs": [
                      {"id": i, "token": "x", "logprob": v} for i, v in top]}]})
            return 200, {"model": "tiny", "choices": [{"index": 0, "logprobs": lp, "finish_reason": "length"}]}
        if self.how == "500":
            return 500, {"error": {"message": "CUDA out of memory", "code": 500}}
        if self.how == "slow":
            time.sleep(3)
        if self.how == "malformed":
            return 200, b'{"choices": [{"text": "x"'
        if self.shape == "llama-server":
            ids, d, a = self._sample(body["prompt"], body["n_predict"], body["temperature"], body["top_k"],
                                     body["top_p"], body.get("seed"))
            return 200, {"tokens": ids, "stop_type": "limit", "timings": {"draft_n": d, "draft_n_accepted": a}}
        if self.shape == "sglang":
            sp = body["sampling_params"]
            ids, d, a = self._sample(body["input_ids"], sp["max_new_tokens"], sp["temperature"], sp["top_k"],
                                     sp["top_p"], sp.get("sampling_seed"))
        else:
            ids, d, a = self._sample(body["prompt"], body["max_tokens"], body["temperature"], body["top_k"],
                                     body["top_p"], body.get("seed"))
        if self.how == "short":
            ids = ids[:-1]
        if self.shape == "sglang":
            out = {"text": "", "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": len(ids)},
                                             "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
                                             "spec_verify_ct": 0 if d == 0 else 2, "spec_draft_token_num": d,
                                             "spec_accept_token_num": a},
                   "output_ids": None if self.how == "no-ids" else ids}
            return 200, out
        if self.shape == "vllm":
            lp = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-1.0] * len(ids),
                  "top_logprobs": None, "text_offset": list(range(len(ids)))}
        else:  # llama.cpp
            lp = {"content": [{"id": t, "token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}
                              for t in ids]}
        choice = {"index": 0, "text": "", "logprobs": None if self.how == "no-ids" else lp, "finish_reason": "length"}
        out = {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice],
               "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                         "total_tokens": len(ids) + len(body["prompt"])}}
        if self.shape == "llama.cpp":
            out["timings"] = {"draft_n": d, "draft_n_accepted": a, "predicted_n": len(ids)}
        return 200, out


from minispec.speculative import SAMPLERS  # noqa: E402  (registered by minispec's import)


@pytest.fixture
def stubs():
    made = []

    def make(shape, how="exact", metrics=None):
        s = Stub(shape, how, metrics)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def run(stub: Stub, n: int = N, seed: int = 0, concurrency: int = 4, **kw):
    kind = "sglang" if stub.shape == "sglang" else "openai"
    return draw(Endpoint(stub.url, kind, deadline=kw.pop("deadline", 30.0)), PROMPTS, [n], T, PARAMS, seed,
                stub.target.config.vocab_size, concurrency=concurrency, **kw)


@pytest.fixture(scope="module")
def reference():
    """N plain samples from a vLLM-shaped stub without a draft: the two-sample audit's reference arm."""
    stub = Stub("vllm", "plain")
    try:
        yield run(stub, seed=50_000).samples
    finally:
        stub.close()


def test_exact_samples_pass_both_audits(stubs, reference):
    stub = stubs("llama.cpp")
    drawn = run(stub)
    assert len(drawn.samples.tokens) == N and drawn.samples.settings["engine"] == "openai"
    assert drawn.drafted > 0 and 0 < drawn.accepted <= drawn.drafted  # llama.cpp's timings, summed
    r = audit_samples(stub.target, drawn.samples, **FAST)
    assert r.passed and r.calibrated, r.format()
    two = compare(drawn.samples, reference, drafted=drawn.drafted, accepted=drawn.accepted, **FAST)
    assert two.passed, two.format()
    d = two.to_dict()
    assert d["mode"] == "two-sample" and d["drafted"] == drawn.drafted and len(d["two_sample"]["rows"]) == T + 1


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_other_shapes_are_read_as_ids(stubs, shape):
    stub = stubs(shape)
    drawn = run(stub, n=100)
    if shape == "vllm":
        assert drawn.drafted is None  # vLLM's completions say nothing of drafting
    else:
        assert 0 < drawn.accepted <= drawn.drafted  # SGLang's meta_info counts, summed
    assert drawn.samples.settings["engine"] == ("sglang" if shape == "sglang" else "openai")
    assert audit_samples(stub.target, drawn.samples, reference=False, **FAST).passed


@pytest.mark.parametrize("how", ["argmax", "ignores-seed", "top-k-2"])
def test_broken_servers_fail_both_audits(stubs, reference, how):
    # a control sampler served, a server ignoring the seed (every sample alike), one using top-k 2 when 8 was asked
    stub = stubs("vllm", how)
    drawn = run(stub)
    assert not audit_samples(stub.target, drawn.samples, reference=False, **FAST).passed
    two = compare(drawn.samples, reference, **FAST)
    assert not two.passed, two.format()


def test_a_server_that_drafts_nothing_is_named(stubs):
    drawn = run(stubs("llama.cpp", "plain"), n=40)
    ref = run(stubs("llama.cpp", "plain"), n=40, seed=9_000)
    two = compare(drawn.samples, ref.samples, drafted=drawn.drafted, accepted=drawn.accepted, **FAST)
    assert drawn.drafted == 0 and "drafted no tokens" in two.verdict and "drafted no tokens" in two.format()


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
@pytest.mark.parametrize("how,match", [
    ("malformed", "JSON"),
    ("short", "sent 2 token ids, 3 were asked for"),
    ("500", "HTTP 500"),
    ("no-ids", "token ids"),
])
def test_bad_answers_are_one_line_errors(stubs, shape, how, match):
    with pytest.raises(ServerError, match=match) as e:
        run(stubs(shape, how), n=12)
    assert "\n" not in str(e.value)


def test_a_slow_server_hits_the_deadline_and_stops_the_rest(stubs):
    t0 = time.perf_counter()
    with pytest.raises(ServerError) as e:
        run(stubs("vllm", "slow"), n=40, deadline=0.5)
    assert "\n" not in str(e.value) and time.perf_counter() - t0 < 10


def test_mixed_seeds_and_concurrency(stubs):
    stub = stubs("sglang")
    drawn = run(stub, concurrency=8, mixed_seeds=True)
    assert drawn.samples.settings["mixed_seeds"] and drawn.samples.settings["concurrency"] == 8
    assert audit_samples(stub.target, drawn.samples, reference=False, **FAST).passed
    # seeded samples repeat with their seed; the unseeded ones are fresh
    again = run(stub, concurrency=1, mixed_seeds=True)
    assert [t for i, t in enumerate(drawn.samples.tokens) if i % 2 == 0] == \
           [t for i, t in enumerate(again.samples.tokens) if i % 2 == 0]


@pytest.mark.parametrize("shape", ["vllm", "llama.cpp", "sglang"])
def test_the_model_check(stubs, shape):
    stub = stubs(shape)
    kind = "sglang" if shape == "sglang" else "openai"
    info = check_same_model(Endpoint(stub.url, kind), stub.target, PROMPTS[0])
    assert info["tokens_compared"] == 20 and info["prob_difference"] < 1e-5
    other = stubs(shape, "other-model")
    with pytest.raises(ModelMismatchError, match="next-token probabilities after the first prompt differ"):
        check_same_model(Endpoint(other.url, kind), stub.target, PROMPTS[0])


def test_the_model_is_the_first_listed_unless_named(stubs):
    stub = stubs("vllm")
    assert Endpoint(stub.url).model == "tiny"
    with pytest.raises(ServerError, match="answered as model 'tiny', 'other' was asked for"):
        draw(Endpoint(stub.url, model="other"), PROMPTS, [2], T, PARAMS, 0, 32)


def test_llama_servers_native_completion_is_a_kind_of_endpoint(stubs):
    """kind "llama.cpp": llama_server's request body and checks through the one Drawing; server_samples draws the
    same samples for the same seed, and the model check goes through llama_server's."""
    from minispec.equivalence import llama_server

    stub = stubs("llama-server")
    endpoint = llama_server.Endpoint(stub.url, deadline=30.0)
    drawn = draw(endpoint, PROMPTS, [100], T, PARAMS, 7, stub.target.config.vocab_size, concurrency=4)
    assert drawn.samples.settings["engine"] == "llama.cpp" and 0 < drawn.accepted <= drawn.drafted
    assert drawn.samples.settings["speculation"]["acceptance_rate"] == drawn.accepted / drawn.drafted
    assert audit_samples(stub.target, drawn.samples, reference=False, **FAST).passed
    same = llama_server.server_samples(stub.target, llama_server.ServerClient(stub.url, deadline=30.0), PROMPTS,
                                       samples=100, tokens=T, temperature=PARAMS.temperature, top_k=PARAMS.top_k,
                                       top_p=None, seed=7, workers=2)
    assert same.tokens == drawn.samples.tokens and same.settings["engine_version"] == "b0-stub"
    assert same.settings["model_check"]["prob_difference"] < 1e-5
    assert endpoint.check_model(stub.target, PROMPTS[0])["n_vocab"] == stub.target.config.vocab_size
    with pytest.raises(llama_server.ModelMismatchError, match="next-token probabilities after the first prompt differ"):
        llama_server.Endpoint(stubs("llama-server", "other-model").url).check_model(stub.target, PROMPTS[0])


def test_a_drawing_builds_nothing_per_sample_up_front():
    """A hundred million samples asked: making the Drawing costs no memory and sends nothing (no server listens)."""
    import tracemalloc

    from minispec.equivalence.drawing import Drawing
    from minispec.equivalence.llama_server import Endpoint as LlamaEndpoint

    tracemalloc.start()
    try:
        for endpoint in (Endpoint("http://127.0.0.1:9/v1", model="tiny"), LlamaEndpoint("http://127.0.0.1:9")):
            d = Drawing(endpoint, PROMPTS, [10**8], T, PARAMS, 0, 32, concurrency=4)
            assert d.total == 10**8 and d.pairs == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def completion(lp: dict, timings: dict | None = None) -> dict:
    """An OpenAI /completions answer of 3 tokens with these logprobs (and llama.cpp's timings when given)."""
    out = {"model": "tiny", "choices": [{"index": 0, "logprobs": lp, "finish_reason": "length"}],
           "usage": {"completion_tokens": 3}}
    return out if timings is None else {**out, "timings": timings}


def test_more_accepted_than_drafted_in_one_answer_is_refused():
    from minispec.equivalence.openai import parse_completion, parse_sglang

    lp = {"tokens": ["token_id:1", "token_id:2", "token_id:3"]}
    assert parse_completion(completion(lp, {"draft_n": 4, "draft_n_accepted": 2}), 3, 32, "tiny", "srv") == \
        ([1, 2, 3], 4, 2)
    with pytest.raises(ServerError, match=r"^srv reported 4 draft tokens accepted of 2 drafted \(timings\."):
        parse_completion(completion(lp, {"draft_n": 2, "draft_n_accepted": 4}), 3, 32, "tiny", "srv")
    meta = {"finish_reason": {"type": "length"}, "completion_tokens": 3, "spec_verify_ct": 1,
            "spec_draft_token_num": 1, "spec_accept_token_num": 50}
    with pytest.raises(ServerError, match=r"^srv reported 50 draft tokens accepted of 1 drafted \(spec_accept"):
        parse_sglang({"output_ids": [1, 2, 3], "meta_info": meta}, 3, 32, "srv")
    assert parse_sglang({"output_ids": [1, 2, 3], "meta_info": {**meta, "spec_accept_token_num": 1}}, 3, 32,
                        "srv") == ([1, 2, 3], 1, 1)


@pytest.mark.parametrize("token", ["token_id:\u0663", "token_id:\u00b2", "token_id:\uff13", "token_id:3\u0663"])
def test_token_ids_are_ascii_digits_only(token):
    # Arabic-Indic three, superscript two, fullwidth three: str.isdigit() and int() take them all
    from minispec.equivalence.http import ascii_digits
    from minispec.equivalence.openai import parse_completion

    with pytest.raises(ServerError, match=r"logprobs\.tokens entry .*not \"token_id:ID\"") as e:
        parse_completion(completion({"tokens": ["token_id:1", token, "token_id:3"]}), 3, 32, "tiny", "srv")
    assert "\n" not in str(e.value)
    assert ascii_digits("123") and not ascii_digits(token.partition(":")[2]) and not ascii_digits("")


@pytest.mark.parametrize("engine, extra, bound", [
    ("openai", ["--url", "http://127.0.0.1:1/v1", "--reference-url", "http://127.0.0.1:2/v1"], 2**32 - 2),
    ("llama.cpp", ["--url", "http://127.0.0.1:1", "--reference-url", "http://127.0.0.1:2"], 2**32 - 2),
    ("minispec", ["--target", "{target}", "--draft", "prompt-lookup"], 2**63 - 1),
])
def test_the_seed_is_checked_against_the_engines_bound(tmp_path, capsys, engine, extra, bound):
    """--seed is refused (OptionError: one line, exit status 2) above the largest seed the engine takes, before
    any model loads or server starts; the bound itself passes the option checks."""
    from minispec.cli import build_parser
    from minispec.equivalence.audit import OptionError, check_options

    from tiny_files import tiny_checkpoint

    tiny_checkpoint(tmp_path / "t")
    argv = ["equivalence", "--engine", engine, *[a.format(target=tmp_path / "t") for a in extra], "--prompt-ids", "1"]
    check_options(build_parser().parse_args([*argv, "--seed", str(bound)]))
    with pytest.raises(OptionError) as e:
        check_options(build_parser().parse_args([*argv, "--seed", str(bound + 1)]))
    assert str(e.value) == f"--seed {bound + 1} is more than {bound}, the largest seed --engine {engine} takes"
    from helpers import equivalence_cli
    assert equivalence_cli([*argv[1:], "--seed", str(bound + 1)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {e.value}"
