"""The command line's server audits by protocol: `--engine openai|sglang --url`, with the target (the PIT) and
without it (the two-sample test against reference samples drawn with speculation off), `--concurrency`,
`--mixed-seeds`; against the stub servers of test_openai_engine and, when it is built, llama.cpp's real
llama-server through its /v1/completions (the tiny GGUFs of test_llama_server)."""

from __future__ import annotations

import json

import pytest
from test_llama_server import _gone, needs_server, tiny_pair  # noqa: F401  (tiny_pair: a module fixture)
from test_openai_engine import Stub

from minispec.equivalence.llama_server import LlamaServer

from helpers import equivalence_cli as main


@pytest.fixture
def stubs():
    made = []

    def make(shape, how="exact"):
        made.append(Stub(shape, how))
        return made[-1]
    yield make
    for s in made:
        s.close()


COMMON = ("--samples", "300", "--tokens", "3", "--temperature", "0.7", "--top-k", "8", "--power-runs", "0",
          "--prompt-ids", "1,5,2,7,3")


def test_two_sample_without_a_target_passes_exact_and_fails_a_control(stubs, capsys):
    plain = stubs("sglang", "plain")
    assert main(["--engine", "sglang", "--url", stubs("sglang").url, "--reference-url", plain.url, *COMMON,
                 "--concurrency", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the SGLang stub reports its draft tokens (meta_info spec_draft_token_num)
    assert report["mode"] == "two-sample" and report["passed"] and report["drafted"] > 0
    # 300 samples in batches of 256: one early look, at 256 samples of each run, which passed
    assert report["sequential"]["interim_looks"] == report["sequential"]["looks_taken"] == 1
    assert main(["--engine", "sglang", "--url", stubs("sglang", "argmax").url, "--reference-url", plain.url,
                 *COMMON]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAILED" in out and "two-sample" in out


def test_with_a_target_the_pit_audits_the_server(stubs, tmp_path, capsys):
    stub = stubs("llama.cpp", "exact")
    stub.target.save_pretrained(tmp_path / "t")
    assert main(["--target", str(tmp_path / "t"), "--engine", "openai", "--url", stub.url, *COMMON,
                 "--mixed-seeds", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "pit" and report["passed"] and report["drafted"] > 0 and report["accepted"] > 0
    bad = stubs("llama.cpp", "top-k-2")
    assert main(["--target", str(tmp_path / "t"), "--engine", "openai", "--url", bad.url, *COMMON,
                 "--no-reference"]) == 1


@pytest.mark.parametrize("argv, match", [
    (("--engine", "openai", "--url", "http://127.0.0.1:1/v1", "--prompt-ids", "1,2"), "--reference-url"),
    (("--engine", "openai", "--reference-url", "http://127.0.0.1:1", "--prompt-ids", "1,2"), "needs --url"),
    (("--engine", "openai", "--url", "http://127.0.0.1:1/v1", "--reference-url", "http://127.0.0.1:2/v1",
      "--prompt", "abc"), "--prompt-ids"),
    (("--engine", "openai", "--url", "http://127.0.0.1:1/v1", "--reference-url", "http://127.0.0.1:2/v1",
      "--prompt-ids", "1,x"), "comma-separated"),
    (("--engine", "minispec", "--prompt-ids", "1,2"), "needs --target"),
    (("--engine", "sglang", "--url", "http://127.0.0.1:1", "--model", "m", "--reference-url",
      "http://127.0.0.1:2", "--prompt-ids", "1"), "--model goes with --engine openai"),
    (("--engine", "openai", "--url", "http://127.0.0.1:1/v1", "--reference-url", "http://127.0.0.1:2/v1",
      "--prompt-ids", "1", "--sampler", "argmax"), "--sampler do(es) not apply"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, match):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_an_unreachable_server_is_one_line(capsys):
    assert main(["--engine", "openai", "--url", "http://127.0.0.1:9/v1", "--reference-url", "http://127.0.0.1:9/v1",
                 *COMMON]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


@needs_server
def test_real_llama_server_through_v1_completions(tiny_pair, tmp_path, capsys):  # noqa: F811
    """llama-server's own /v1/completions with its draft (4 slots, 4 requests in flight): the PIT with the target
    passes and the server reports drafted tokens; without the target, the two-sample test against a plain
    llama-server started beside it passes; the other tiny model serving fails the two-sample test and, with the
    target, is refused by the model check."""
    gguf_path, target = tiny_pair["target"]
    other_gguf, _ = tiny_pair["other"]
    target.save_pretrained(tmp_path / "t")
    common = ("--samples", "300", "--tokens", "4", "--temperature", "0.8", "--top-k", "8", "--power-runs", "0",
              "--prompt-ids", "1,3,4", "--concurrency", "4")
    with LlamaServer(gguf_path, draft=other_gguf, k=3, parallel=4, ctx_size=64, threads=1) as server:
        assert main(["--target", str(tmp_path / "t"), "--engine", "openai", "--url", server.client.url + "/v1",
                     *common, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["passed"] and report["calibrated"] and report["drafted"] > 0, report["verdict"]
        pid = server.proc.pid
    assert _gone(pid)
    assert main(["--engine", "llama.cpp", "--server-model", str(gguf_path), "--server-draft", str(other_gguf),
                 "--k", "3", "--server-threads", "1", *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "two-sample" and report["passed"] and report["drafted"] > 0
    with LlamaServer(other_gguf, parallel=4, ctx_size=64, threads=1) as wrong, \
            LlamaServer(gguf_path, parallel=4, ctx_size=64, threads=1) as plain:
        assert main(["--engine", "openai", "--url", wrong.client.url + "/v1", "--reference-url",
                     plain.client.url + "/v1", *common]) == 1
        assert "verdict: FAILED" in capsys.readouterr().out
        # with the target, the model check refuses the other model before any sampling
        assert main(["--target", str(tmp_path / "t"), "--engine", "openai", "--url", wrong.client.url + "/v1",
                     *common]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "next-token probabilities after the first prompt differ" in err[0], err


def test_the_request_timeout_is_an_option(stubs, capsys):
    from minispec.cli import build_parser
    from minispec.equivalence.http import REQUEST_S

    assert build_parser().parse_args(["equivalence"]).request_timeout == REQUEST_S == 300.0
    for bad in ("0", "-1", "inf", "nan", "abc"):
        assert main(["--request-timeout", bad]) == 2
        assert "argument --request-timeout" in capsys.readouterr().err
    slow, plain = stubs("vllm", "slow"), stubs("vllm", "plain")  # the slow one answers after 3 s
    assert main(["--engine", "openai", "--url", slow.url, "--reference-url", plain.url, *COMMON,
                 "--request-timeout", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "timed out: no complete answer within 0.5 s" in err[-1], err
