"""Drafting proven active on vLLM (its Prometheus /metrics spec-decode counters, read before and after the run) and
early-stop looks on server audits (a Drawing scored as it is drawn: --engine openai, sglang and llama.cpp), against
the local stub servers of test_openai_engine. Fixed seeds: every verdict here is deterministic."""

from __future__ import annotations

import json

import pytest
from test_openai_engine import PARAMS, PROMPTS, Stub, T

from minispec.equivalence import audit_samples, read_samples
from minispec.equivalence.drafts import metrics_delta, parse_metrics
from minispec.equivalence.drawing import Drawing
from minispec.equivalence.http import ServerError
from minispec.equivalence.openai import Endpoint, parse_completion
from minispec.equivalence.two_sample import audit, compare

from helpers import equivalence_cli as main

FAST = dict(power_runs=0)
VLLM = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 80.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7186e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="other"} 5000.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 1.5e2
vllm:spec_decode_num_accepted_tokens_total{engine="1", model_name="m"} 0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} NaN
this line belongs to no metric we read {{{
"""


@pytest.fixture
def stubs():
    made = []

    def make(shape, how="exact", metrics=None):
        made.append(Stub(shape, how, metrics))
        return made[-1]
    yield make
    for s in made:
        s.close()


def drawing(stub: Stub, n: int, seed: int = 0, concurrency: int = 4) -> Drawing:
    kind = "sglang" if stub.shape == "sglang" else "openai"
    return Drawing(Endpoint(stub.url, kind, deadline=60.0), PROMPTS, [n], T, PARAMS, seed,
                   stub.target.config.vocab_size, concurrency=concurrency)


def test_parse_metrics_sums_the_models_counters_and_reads_nothing_else():
    assert parse_metrics(VLLM, "m", "srv") == {"drafted": 200, "accepted": 150}
    # no model named: every label set counts; a family name without _total (some exporters) is read too
    assert parse_metrics(VLLM, None, "srv")["drafted"] == 5200
    bare = "vllm:spec_decode_num_draft_tokens 7\nvllm:spec_decode_num_accepted_tokens 3 1718600000000\n"
    assert parse_metrics(bare, "m", "srv") == {"drafted": 7, "accepted": 3}
    # a vLLM page without the counters: vLLM registers them only when it speculates, so it drafted nothing
    assert parse_metrics("# no counters\nvllm:num_requests_running 1.0\n", "m", "srv") == {"drafted": 0,
                                                                                           "accepted": 0}
    assert parse_metrics('vllm:num_requests_running{model_name="m"} 1.0\n', "m", "srv") == {"drafted": 0,
                                                                                           "accepted": 0}
    assert parse_metrics('vllm:num_requests_running{model_name="other"} 1.0\n', "m", "srv") is None
    assert parse_metrics("# HELP vllm:num_requests_running x\n", "m", "srv") is None
    assert parse_metrics("<html>not found</html>", "m", "srv") is None


@pytest.mark.parametrize("text, match", [
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m"} abc', "not a count"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m"} -3', "not a count"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m"} 2.5', "not a count"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m"} NaN', "not a count"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m"} +Inf', "not a count"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name="m} 3', "not a Prometheus sample|labels"),
    ('vllm:spec_decode_num_draft_tokens_total{model_name=m} 3', "labels"),
    ("vllm:spec_decode_num_draft_tokens_total", "not a Prometheus sample"),
    ('vllm:spec_decode_num_draft_tokens_total{a="1"} 3\nvllm:spec_decode_num_draft_tokens_total{a="1"} 3\n'
     'vllm:spec_decode_num_accepted_tokens_total 1', "twice"),
    ("vllm:spec_decode_num_draft_tokens_total 3", "not the other count"),
])
def test_unreadable_counters_are_one_line_errors(text, match):
    with pytest.raises(ServerError, match=match) as e:
        parse_metrics(text, "m", "srv")
    assert "\n" not in str(e.value)


def test_metrics_delta():
    a, b = {"drafted": 10, "accepted": 4}, {"drafted": 30, "accepted": 9}
    assert metrics_delta(a, b, "srv") == {"drafted": 20, "accepted": 5}
    assert metrics_delta(None, b, "srv") is None
    for after, match in ((a | {"drafted": 9}, "went back"), ({"drafted": 11, "accepted": 6}, "accepted draft"),
                         (None, "not after")):
        with pytest.raises(ServerError, match=match) as e:
            metrics_delta(a, after, "srv")
        assert "\n" not in str(e.value)


def test_vllm_counters_prove_drafting(stubs):
    stub = stubs("vllm", metrics="vllm")
    stub.drafted, stub.accepted = 1000, 400  # traffic before the run is not counted
    d = drawing(stub, 200)
    r = audit_samples(stub.target, d, reference=False, batch_size=100, **FAST)
    assert r.passed and d.drafted == stub.drafted - 1000 > 0 and 0 < d.accepted == stub.accepted - 400
    out = r.to_dict()
    assert (out["drafted"], out["accepted"]) == (d.drafted, d.accepted)
    assert f"the engine reported {d.drafted} draft tokens, {d.accepted} accepted" in out["verdict"]
    assert "verdict: PASSED" in r.format() and "draft tokens" in r.format()


def test_a_server_that_drafts_nothing_says_so_in_the_verdict(stubs):
    stub = stubs("vllm", "plain", metrics="vllm")  # the counters are there, and stay at 0
    r = audit_samples(stub.target, drawing(stub, 60), reference=False, **FAST)
    assert r.to_dict()["drafted"] == 0 and "no tokens were drafted" in r.verdict
    assert any("drafted no tokens" in n for n in r.notes)
    d, ref = drawing(stub, 40).run(), drawing(stubs("vllm", "plain"), 40, seed=9_000).run()
    two = compare(d.samples, ref.samples, drafted=d.drafted, accepted=d.accepted, **FAST)
    assert d.drafted == 0 and "drafted no tokens" in two.verdict


@pytest.mark.parametrize("shape, metrics", [("vllm", None), ("vllm", "# HELP vllm:num_requests_running x\n"),
                                            ("sglang", "vllm")])
def test_no_counters_is_null(stubs, shape, metrics):
    # no /metrics (404), a /metrics with no vLLM sample (only a comment), and SGLang (its own counts)
    stub = stubs(shape, "exact", metrics)
    d = drawing(stub, 20).run()
    assert (d.drafted is None) == (shape == "vllm")


def test_a_vllm_without_speculation_is_named_as_drafting_nothing(stubs):
    """vLLM serving without a speculative config has a /metrics page but no spec-decode counters."""
    stub = stubs("vllm", "plain", 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n')
    r = audit_samples(stub.target, drawing(stub, 40), reference=False, **FAST)
    assert r.to_dict()["drafted"] == 0 and "no tokens were drafted" in r.verdict


def test_llama_cpp_timings_without_draft_n_drafted_nothing():
    """llama-server writes timings.draft_n only for a request that drafted (tools/server/server-common.cpp)."""
    resp = {"choices": [{"logprobs": {"content": [{"id": 3}, {"id": 4}]}, "finish_reason": "length"}],
            "timings": {"predicted_n": 2}}
    assert parse_completion(resp, 2, 10, None, "srv") == ([3, 4], 0, 0)
    del resp["timings"]
    assert parse_completion(resp, 2, 10, None, "srv") == ([3, 4], None, None)  # tells nothing


@pytest.mark.parametrize("metrics, match", [
    ('vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 12abc\n', "not a count"),
    ("reset", "went back"),
    (b"\xff\xfe vllm", "not UTF-8"),
])
def test_bad_counters_are_one_line_errors(stubs, metrics, match):
    stub = stubs("vllm", "exact", metrics)
    stub.drafted, stub.accepted = 50, 20  # "reset": these before the run, 0 after
    with pytest.raises(ServerError, match=match) as e:
        drawing(stub, 20).run()
    assert "\n" not in str(e.value)


def test_the_cli_reports_vllm_counters(stubs, tmp_path, capsys):
    stub = stubs("vllm", metrics="vllm")
    stub.target.save_pretrained(tmp_path / "t")
    assert main(["--target", str(tmp_path / "t"), "--engine", "openai", "--url", stub.url, "--samples", "100",
                 "--tokens", str(T), "--temperature", "0.7", "--top-k", "8", "--power-runs", "0", "--prompt-ids",
                 "1,5,2,7,3", "--concurrency", "4", "--no-reference", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drafted"] == stub.drafted > 0 and report["accepted"] == stub.accepted
    assert "the engine reported" in report["verdict"]


# --- early-stop looks on server audits ---------------------------------------------------------------------------

def test_a_broken_server_stops_at_the_first_look(stubs):
    stub = stubs("vllm", "argmax")
    r = audit_samples(stub.target, drawing(stub, 1000), reference=False, batch_size=100, **FAST)
    q = r.sequential
    assert not r.passed and q["stopped_early"] and q["looks_taken"] == 1 and q["samples_tested"] == 100
    assert q["interim_looks"] == 9 and stub.requests < 300  # the chunk scored, the next drawn meanwhile, no more
    assert "stopped early" in r.format() and len(r.samples.tokens) == 100


def test_a_correct_server_takes_every_look_and_passes(stubs):
    stub = stubs("llama.cpp")
    d = drawing(stub, 300)
    r = audit_samples(stub.target, d, reference=False, batch_size=100, **FAST)
    q = r.sequential
    assert r.passed and not q["stopped_early"] and q["looks_taken"] == 2 and q["samples_tested"] == 300
    assert stub.requests == 300 and r.to_dict()["drafted"] == d.drafted > 0  # llama.cpp's timings, summed
    assert r.speed["speculative_samples_per_s"] > 0


def test_the_two_sample_audit_stops_a_broken_server_early_and_not_a_correct_one(stubs):
    plain = stubs("vllm", "plain")
    broken = stubs("vllm", "argmax")
    r = audit(drawing(broken, 1000), drawing(plain, 1000, seed=50_000), batch_size=100, **FAST)
    q = r.sequential
    assert not r.passed and q["stopped_early"] and q["looks_taken"] == 1 and q["interim_looks"] == 9
    assert broken.requests < 300 and "stopped early" in r.format() and r.to_dict()["sequential"] == q
    exact = stubs("llama.cpp")
    d = drawing(exact, 300)
    r = audit(d, drawing(plain, 300, seed=60_000), batch_size=100, **FAST)
    q = r.sequential
    assert r.passed and not q["stopped_early"] and q["looks_taken"] == 2 and q["samples_tested"] == 300
    assert r.drafted == d.drafted > 0 and exact.requests == 300


# --- llama.cpp's native engine (--engine llama.cpp --url): its /completion drawn as the audit scores it too -------

LLAMA = ("--engine", "llama.cpp", "--tokens", str(T), "--temperature", "0.7", "--top-k", "8", "--power-runs", "0",
         "--prompt-ids", "1,5,2,7,3", "--batch-size", "100", "--no-reference", "--json")


def test_a_broken_llama_server_stops_at_the_first_look(stubs, tmp_path, capsys):
    stub = stubs("llama-server", "argmax")
    stub.target.save_pretrained(tmp_path / "t")
    saved = tmp_path / "tested.jsonl"
    assert main(["--target", str(tmp_path / "t"), "--url", stub.url, "--samples", "1000", *LLAMA,
                 "--save-samples", str(saved)]) == 1
    report = json.loads(capsys.readouterr().out)
    q = report["sequential"]
    assert not report["passed"] and q["stopped_early"] and q["looks_taken"] == 1 and q["samples_tested"] == 100
    assert q["interim_looks"] == 9 and stub.requests < 300  # the chunk scored, the next drawn meanwhile, no more
    assert report["settings"]["engine"] == "llama.cpp" and report["settings"]["engine_version"] == "b0-stub"
    cfg = stub.target.config
    tested = read_samples(saved, cfg.vocab_size, cfg.max_seq_len, 10)
    assert len(tested.tokens) == 100 and tested.settings["engine"] == "llama.cpp"


def test_an_exact_llama_server_takes_every_look_and_passes(stubs, tmp_path, capsys):
    stub = stubs("llama-server")
    stub.target.save_pretrained(tmp_path / "t")
    assert main(["--target", str(tmp_path / "t"), "--url", stub.url, "--samples", "300", *LLAMA]) == 0
    report = json.loads(capsys.readouterr().out)
    q = report["sequential"]
    assert report["passed"] and not q["stopped_early"] and q["looks_taken"] == 2 and q["samples_tested"] == 300
    assert stub.requests == 300 and report["drafted"] == stub.drafted > 0 and report["accepted"] == stub.accepted
    extra = report["settings"]["engine_settings"]
    assert extra["model_check"]["prob_difference"] < 1e-2  # checked before any sampling, through /completion
    assert extra["speculation"]["acceptance_rate"] == stub.accepted / stub.drafted
    assert extra["samplers"] == ["temperature", "top_k", "top_p"] and "logit bias -inf" in extra["ignore_eos"]
