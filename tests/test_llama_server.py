"""llama-server as an engine under test (minispec.equivalence.llama_server).

The request/response mapping and every failure (malformed response, wrong token count, timeout, binary missing,
port busy, a server that crashes mid-run) run against a fake server in this process or a fake `llama-server`
script; the real llama-server (tools/llama_cpp.py builds it) samples a tiny GGUF written here, and those tests skip
until it is built.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from minispec import Transformer
from minispec.equivalence import audit_samples, llama_server
from minispec.sampling import SamplingParams

from tiny_files import TINY, add_metadata, finish_gguf, gpt2_vocab

BUILT, OFF, SAMPLERS = llama_server.BUILT, llama_server.OFF, llama_server.SAMPLERS
LlamaServer, ServerClient, ServerError = llama_server.LlamaServer, llama_server.ServerClient, llama_server.ServerError
ModelMismatchError, find_binary, parse_tokens = (llama_server.ModelMismatchError, llama_server.find_binary,
                                                 llama_server.parse_tokens)
request_body, server_samples = llama_server.request_body, llama_server.server_samples

EOS = 2  # the tiny vocabulary's </s>


def one_line(e) -> str:
    s = str(e.value)
    assert "\n" not in s and s
    return s


# ---- the request and its parsing

def test_request_states_every_sampler_stage():
    body = request_body([1, 3, 4], 8, SamplingParams(0.7, 50, None), seed=12)
    assert body["prompt"] == [1, 3, 4] and body["n_predict"] == 8 and body["seed"] == 12
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 50, 1.0)
    assert body["samplers"] == SAMPLERS == ["temperature", "top_k", "top_p"]
    assert body["ignore_eos"] is True and body["return_tokens"] is True and body["stream"] is False
    for key, off in OFF.items():
        assert body[key] == off
    assert body["mirostat"] == 0 and body["dry_multiplier"] == 0.0
    assert body["logit_bias"] == [] and body["grammar"] == ""
    assert request_body([1], 2, SamplingParams(1.0, None, 0.9), 0)["top_k"] == 0  # llama.cpp's "off"


@pytest.mark.parametrize("resp, match", [
    ({"content": "abc"}, "no list of token ids"),
    ({"tokens": [1, "2", 3]}, "no list of token ids"),
    ({"tokens": [1, 2]}, "returned 2 tokens, expected 3"),
    ({"tokens": [1, 2, 99]}, "outside the target's vocabulary"),
    ([1, 2, 3], "no list of token ids"),
])
def test_parse_tokens_refuses(resp, match):
    with pytest.raises(ServerError, match=match) as e:
        parse_tokens(resp, 3, 16)
    one_line(e)


# ---- a fake server in this process

class _Fake(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *a):
        pass

    def _send(self, code, payload: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except BrokenPipeError:  # the client under test gave up (the timeout case)
            pass

    def do_GET(self):
        if self.path == "/health":
            self._send(200, b'{"status": "ok"}')
        elif self.path == "/props":
            self._send(200, b'{"build_info": "b0-fake"}')
        else:
            self._send(404, b'{"error": {"message": "no"}}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = type(self).mode
        if mode == "malformed":
            self._send(200, b"<html>oops</html>")
        elif mode == "short":
            self._send(200, json.dumps({"tokens": [3] * (body["n_predict"] - 1), "stop_type": "eos"}).encode())
        elif mode == "slow":
            time.sleep(2.0)
            self._send(200, json.dumps({"tokens": [3] * body["n_predict"]}).encode())
        elif mode == "error":
            self._send(500, b'{"error": {"code": 500, "message": "the model exploded"}}')
        else:
            self._send(200, json.dumps({"tokens": [3 + body["seed"] % 5] * body["n_predict"]}).encode())


@pytest.fixture
def fake():
    handler = type("Handler", (_Fake,), {"mode": "ok"})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield handler, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _target():
    """A tiny random target: the fake servers' samples are only checked against its vocabulary."""
    from minispec import ModelConfig
    return Transformer(ModelConfig(**TINY))


def test_fake_server_samples_map_to_a_sample_set(fake):
    handler, url = fake
    client = ServerClient(url, deadline=10)
    s = server_samples(_target(), client, [[1, 3], [1, 4]], samples=6, tokens=3, temperature=0.7, top_k=None,
                       top_p=None, seed=5, model_check=False, workers=3)
    assert s.prompts == [[1, 3], [1, 4]] and s.counts == [6, 6]
    assert s.tokens == [[3 + (5 + g) % 5] * 3 for g in range(12)]  # sample g seeded seed + g, in order
    assert s.settings["engine"] == "llama.cpp" and s.settings["engine_version"] == "b0-fake"
    assert s.settings["model_check"] == "skipped" and s.settings["new_tokens"] == 3


@pytest.mark.parametrize("mode, match", [("malformed", "no JSON"), ("short", "returned 2 tokens, expected 3"),
                                         ("slow", "timed out"), ("error", "HTTP 500: the model exploded")])
def test_fake_server_failures_are_one_line(fake, mode, match):
    handler, url = fake
    handler.mode = mode
    with pytest.raises(ServerError, match=match) as e:
        server_samples(_target(), ServerClient(url, deadline=0.5), [[1, 3]], samples=4, tokens=3, temperature=1.0,
                       top_k=None, top_p=None, model_check=False, workers=2)
    one_line(e)


def test_unreachable_url_and_bad_url():
    port = _closed_port()
    with pytest.raises(ServerError, match="failed") as e:
        ServerClient(f"http://127.0.0.1:{port}", deadline=2).get("/health")
    one_line(e)
    with pytest.raises(ServerError, match="not an http"):
        ServerClient("ftp://x")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a fake llama-server executable: the process handling without the real build

FAKE_BINARY = """\
#!{python}
import http.server, json, os, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(3)
n = [0]
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, payload):
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
    def do_GET(self):
        self._send(b'{{"status": "ok"}}' if self.path == "/health" else b'{{"build_info": "fake"}}')
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n[0] += 1
        if mode == "crash" and n[0] > 3:
            print("error: segmentation fault (fake)", flush=True)
            os._exit(139)
        self._send(json.dumps({{"tokens": [3] * body["n_predict"]}}).encode())
with open(os.environ["FAKE_LLAMA_ARGS"], "w") as f:
    json.dump(sys.argv[1:], f)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def make_fake_binary(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """The fake llama-server, a "model" for it, and the file its arguments will be written to (when it starts)."""
    path = tmp_path / "llama-server"
    path.write_text(FAKE_BINARY.format(python=sys.executable))
    path.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.json"))
    return path, model, tmp_path / "args.json"


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    return make_fake_binary(tmp_path, monkeypatch)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int) -> bool:
    """Nothing listens on the port (SO_REUSEADDR: the closed connections' TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_server_flags_and_stop(fake_binary):
    binary, model, args = fake_binary
    with LlamaServer(model, draft=model, k=6, parallel=3, binary=binary, startup_timeout=30) as server:
        pid, port = server.proc.pid, server.port
        s = server_samples(_target(), server.client, [[1]], samples=4, tokens=2, temperature=1.0, top_k=None,
                           top_p=None, model_check=False, settings=server.settings)
    assert s.tokens == [[3, 3]] * 4 and s.settings["spec_draft_n_max"] == 6
    a = json.loads(args.read_text())
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--parallel") + 1] == "3"
    assert a[a.index("--spec-type") + 1] == "draft-simple" and a[a.index("--model-draft") + 1] == str(model)
    assert a[a.index("--spec-draft-n-max") + 1] == "6" and a[a.index("--spec-draft-n-min") + 1] == "0"
    assert _gone(pid) and _port_free(port) and server.proc is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("mode", ["ok", "stubborn"])
def test_server_ends_when_the_process_that_started_it_is_killed(fake_binary, monkeypatch, mode):
    """kill -9 of the auditing process runs none of its cleanup: the server still goes (PR_SET_PDEATHSIG), even
    one that ignores SIGTERM ("stubborn": the signal is SIGKILL)."""
    import signal
    import subprocess
    binary, model, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    pid = None
    code = (f"import sys, time\nfrom minispec.equivalence.llama_server import LlamaServer\n"
            f"s = LlamaServer({str(model)!r}, binary={str(binary)!r}, startup_timeout=30).__enter__()\n"
            f"print(s.proc.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        for _ in range(100):  # the signal is delivered at once; the process exits in its own time
            if _gone(pid) or _zombie(pid):
                break
            time.sleep(0.05)
        assert _gone(pid) or _zombie(pid)
    finally:
        parent.kill()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)  # no stray server, even when the test fails


def _zombie(pid: int) -> bool:
    """Exited but not yet reaped (its parent died: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def test_server_stopped_after_an_exception_mid_run(fake_binary):
    binary, model, _ = fake_binary
    with pytest.raises(KeyboardInterrupt):
        with LlamaServer(model, binary=binary, startup_timeout=30) as server:
            pid, port = server.proc.pid, server.port
            server.client.post("/completion", request_body([1], 2, SamplingParams(1.0, None, None), 0))
            raise KeyboardInterrupt
    assert _gone(pid) and _port_free(port)


def test_server_crashing_mid_run(fake_binary, monkeypatch):
    binary, model, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    with pytest.raises(ServerError, match="llama-server exited during POST .*exit status 139.*segmentation") as e:
        with LlamaServer(model, binary=binary, startup_timeout=30) as server:
            pid = server.proc.pid
            server_samples(_target(), server.client, [[1]], samples=20, tokens=2, temperature=1.0, top_k=None,
                           top_p=None, model_check=False, workers=1)
    one_line(e)
    assert _gone(pid)


def test_server_failing_to_start(fake_binary, monkeypatch):
    binary, model, _ = fake_binary
    monkeypatch.setenv("FAKE_LLAMA_MODE", "exit")
    with pytest.raises(ServerError, match="exited while starting: exit status 3; .*failed to load model") as e:
        with LlamaServer(model, binary=binary, startup_timeout=30):
            pass
    one_line(e)


def test_port_busy(fake_binary):
    binary, model, _ = fake_binary
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is busy") as e:
            with LlamaServer(model, binary=binary, port=port):
                pass
    one_line(e)


def test_binary_missing(tmp_path, monkeypatch):
    with pytest.raises(ServerError, match="not an executable llama-server") as e:
        find_binary(tmp_path / "nope")
    one_line(e)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(ServerError, match="build it with python tools/llama_cpp.py"):
        LlamaServer(tmp_path / "model.gguf")


def test_model_file_missing(fake_binary, tmp_path):
    binary, _, _ = fake_binary
    with pytest.raises(ServerError, match="model .* is not a file"):
        LlamaServer(tmp_path / "absent.gguf", binary=binary)


# ---- the real llama-server on a tiny GGUF

needs_server = pytest.mark.skipif(not BUILT.is_file(), reason=f"llama-server is not built ({BUILT}): run "
                                                                "python tools/llama_cpp.py")


def tiny_llama_gguf(path: Path, seed: int) -> Path:
    """A random tiny llama GGUF (tiny_files' gpt2-style vocabulary) whose eos is never likely: llama.cpp masks
    end-of-generation tokens under ignore_eos, so the target must give them no real probability for the samples to
    follow it. Every embedding carries a constant in dimension 0 that no layer writes to, and the head reads it
    only in eos's row, with a large negative weight."""
    import gguf

    rng = np.random.default_rng(seed)
    v, d, f, hd = TINY["vocab_size"], TINY["dim"], TINY["ffn_dim"], TINY["dim"] // TINY["n_heads"]
    shapes = {"token_embd.weight": (v, d), "output.weight": (v, d),
              "blk.0.attn_q.weight": (TINY["n_heads"] * hd, d), "blk.0.attn_k.weight": (TINY["n_kv_heads"] * hd, d),
              "blk.0.attn_v.weight": (TINY["n_kv_heads"] * hd, d),
              "blk.0.attn_output.weight": (d, TINY["n_heads"] * hd),
              "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d), "blk.0.ffn_down.weight": (d, f)}
    w = {name: rng.normal(0, 0.5, shape).astype(np.float32) for name, shape in shapes.items()}
    w["token_embd.weight"][:, 0] = 4.0
    w["blk.0.attn_output.weight"][0] = 0.0
    w["blk.0.ffn_down.weight"][0] = 0.0
    w["output.weight"][:, 0] = 0.0
    w["output.weight"][EOS] = 0.0
    w["output.weight"][EOS, 0] = -40.0
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w[name] = np.ones(d, np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    keys = {"block_count": TINY["n_layers"], "context_length": TINY["max_seq_len"], "embedding_length": d,
            "feed_forward_length": f, "attention.head_count": TINY["n_heads"],
            "attention.head_count_kv": TINY["n_kv_heads"], "rope.freq_base": 10000.0,
            "attention.layer_norm_rms_epsilon": 1e-5}
    add_metadata(writer, {**{f"llama.{k}": x for k, x in keys.items()}, **gpt2_vocab()})
    return finish_gguf(writer, w, path)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from convert_gguf import convert

    root = tmp_path_factory.mktemp("llama-server")
    out = {}
    for name, seed in (("target", 0), ("other", 1)):
        gguf_path = tiny_llama_gguf(root / f"{name}.gguf", seed)
        convert(gguf_path, root / name, progress=False)
        out[name] = (gguf_path, Transformer.from_pretrained(root / name))
    return out


@needs_server
def test_real_server_plain_sampling_passes(tiny_pair):
    gguf_path, target = tiny_pair["target"]
    prompt = [1, 3, 4]
    with LlamaServer(gguf_path, parallel=2, ctx_size=64, threads=1) as server:
        pid, port = server.proc.pid, server.port
        s = server_samples(target, server.client, [prompt], samples=400, tokens=4, temperature=0.8, top_k=None,
                           top_p=0.9, seed=0, settings=server.settings, workers=2)
    assert _gone(pid) and _port_free(port)
    info = s.settings["model_check"]
    assert info["n_vocab"] == TINY["vocab_size"] and info["prob_difference"] < 1e-3
    assert s.settings["engine_version"]
    assert s.settings["speculation"]["drafted"] == 0  # a plain server: its answers' counts say it drafted nothing
    report = audit_samples(target, s, power_runs=0)
    assert report.impossible == 0
    assert report.passed and report.calibrated, report.format()
    assert "no tokens were drafted" in report.verdict and not any("drafted no tokens" in n for n in report.notes)
    # the test has teeth here: the same server's samples at another temperature than the stated one fail
    with LlamaServer(gguf_path, parallel=2, ctx_size=64, threads=1) as server:
        hot = server_samples(target, server.client, [prompt], samples=400, tokens=4, temperature=1.4, top_k=None,
                             top_p=0.9, seed=0, model_check=False, workers=2)
    hot.settings["temperature"] = 0.8
    assert not audit_samples(target, hot, power_runs=0, reference=False).passed


@needs_server
def test_real_server_with_a_draft_passes(tiny_pair):
    """llama-server's draft-simple speculation at T > 0: the flags reach it (it drafts) and its samples pass."""
    gguf_path, target = tiny_pair["target"]
    draft_gguf, _ = tiny_pair["other"]
    with LlamaServer(gguf_path, draft=draft_gguf, k=3, parallel=2, ctx_size=64, threads=1) as server:
        s = server_samples(target, server.client, [[1, 3, 4]], samples=400, tokens=6, temperature=0.8, top_k=8,
                           top_p=None, seed=0, settings=server.settings, workers=2)
    spec = s.settings["speculation"]
    assert spec["drafted"] > 0 and 0 < spec["accepted"] <= spec["drafted"]
    assert s.settings["spec_draft_n_max"] == 3
    report = audit_samples(target, s, power_runs=0)
    assert report.passed and report.calibrated, report.format()


@needs_server
def test_real_server_with_another_model_is_refused(tiny_pair):
    other_gguf, _ = tiny_pair["other"]
    _, target = tiny_pair["target"]
    with LlamaServer(other_gguf, parallel=1, ctx_size=64, threads=1) as server:
        pid = server.proc.pid
        with pytest.raises(ModelMismatchError, match="next-token probabilities .* not the same weights") as e:
            server_samples(target, server.client, [[1, 3, 4]], samples=10, tokens=2, temperature=1.0, top_k=None,
                           top_p=None)
        one_line(e)
    assert _gone(pid)


@needs_server
def test_real_server_gone_after_an_exception_mid_run(tiny_pair):
    gguf_path, target = tiny_pair["target"]
    with pytest.raises(RuntimeError, match="mid-run"):
        with LlamaServer(gguf_path, parallel=1, ctx_size=64, threads=1) as server:
            pid, port = server.proc.pid, server.port
            server_samples(target, server.client, [[1, 3]], samples=2, tokens=2, temperature=1.0, top_k=None,
                           top_p=None, model_check=False)
            raise RuntimeError("mid-run")
    assert _gone(pid) and _port_free(port)


def test_tiny_gguf_eos_is_negligible(tiny_pair):
    """The premise of the plain-sampling test: the target gives eos (masked by llama.cpp) no real probability."""
    import torch

    _, target = tiny_pair["target"]
    with torch.inference_mode():
        p = target(torch.tensor([[1, 3, 4, 5, 6, 7, 8]]))[0].float().softmax(-1)
    assert float(p[:, EOS].max()) < 1e-6
    assert float(p.max(-1).values.max()) < 0.8  # still a spread-out distribution


# ---- the command line: python -m minispec equivalence --engine llama.cpp

def _cli(target_dir, *argv) -> int:
    from helpers import equivalence_cli
    return equivalence_cli(["--target", str(target_dir), "--engine", "llama.cpp", *map(str, argv)])


@pytest.mark.parametrize("argv, match", [
    ((), "needs --server-model FILE.gguf"),
    (("--server-model", "{gguf}", "--url", "http://127.0.0.1:1"), "not both"),
    (("--url", "http://127.0.0.1:1", "--server-draft", "{gguf}"), "runs with its own settings"),
    (("--server-model", "{missing}"), "is not a file"),
    (("--server-model", "{gguf}", "--draft", "prompt-lookup"), "--draft do(es) not apply"),
    (("--server-model", "{gguf}", "--k", "auto"), "takes a number for --k"),
])
def test_cli_server_options_are_checked_before_anything_starts(tmp_path, capsys, argv, match):
    from tiny_files import tiny_checkpoint
    tiny_checkpoint(tmp_path / "t")
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"GGUF")
    argv = [a.format(gguf=gguf_path, missing=tmp_path / "nope.gguf") for a in argv]
    assert _cli(tmp_path / "t", "--prompt", "abcde", *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_cli_server_options_need_the_engine(tmp_path, capsys):
    from helpers import equivalence_cli
    from tiny_files import tiny_checkpoint
    tiny_checkpoint(tmp_path / "t")
    assert equivalence_cli(["--target", str(tmp_path / "t"), "--draft", "prompt-lookup", "--prompt", "abcde",
                            "--url", "http://127.0.0.1:1"]) == 2
    assert "go(es) with --engine llama.cpp" in capsys.readouterr().err


@needs_server
def test_cli_real_server_passes_and_refuses_another_model(tiny_pair, tmp_path, capsys):
    """The command end to end: the target's own GGUF passes; the other tiny model serving is refused by the model
    check (exit 1, one line), and with the check off its samples fail the test (the negative control)."""
    gguf_path, target = tiny_pair["target"]
    other_gguf, _ = tiny_pair["other"]
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    common = ("--prompt", "abcde", "--samples", 300, "--tokens", 3, "--temperature", 0.8, "--top-k", 0,
              "--power-runs", 0)
    assert _cli(target_dir, "--server-model", gguf_path, *common, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["settings"]["engine"] == "llama.cpp"
    assert _cli(target_dir, "--server-model", other_gguf, *common) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "not the same weights" in err[-1]
    assert _cli(target_dir, "--server-model", other_gguf, *common, "--no-model-check", "--no-reference") == 1
    assert "FAILED" in capsys.readouterr().out
