"""Servers and files that are hostile, broken or stuck, met by the llama-server engine and the samples files.

Local stub servers on 127.0.0.1 (an endless, huge or trickling body, JSON nested too deeply, numbers that are not
finite or make no sense, a server that never answers) each end in one line and a non-zero status, within a
bounded time and memory, with no process left behind; Ctrl-C ends an audit within seconds with one line. The
same-model check counts a kept (packed) target's weights. Every stub stops on its own after a while, so that a
client without these bounds fails its test instead of hanging the suite or filling memory.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
import torch
from test_llama_server import BUILT, _gone, make_fake_binary

from minispec import Transformer
from minispec.equivalence import audit_samples, llama_server, read_samples
from minispec.equivalence.http import MAX_BYTES, Cancel, ServerError, base_url, get_json, get_text

import llama_cpp
from helpers import ROOT, equivalence_cli, kept_int4, peaked_model
from tiny_files import TINY, tiny_checkpoint, tiny_tokenizer_dir

ServerClient, server_samples = llama_server.ServerClient, llama_server.server_samples
STUB_LIMIT_S = 8.0  # a stub's slow or stuck answer gives up after this long (bounds an unbounded client)
ENDLESS_BYTES = 64 << 20  # how much an "endless" body writes before it gives up (bounds an unbounded client)


# ---------------------------------------------------------------------------
# the stub server

class _Stub(http.server.BaseHTTPRequestHandler):
    """Answers by `routes[path](handler, body)`; `stop` ends the slow and stuck answers at teardown."""
    routes: dict = {}
    stop: threading.Event
    seen: list

    def log_message(self, *a):
        pass

    def _handle(self, body):
        type(self).seen.append(self.path)
        route = type(self).routes.get(self.path) or type(self).routes.get("*")
        try:
            route(self, body)
        except (BrokenPipeError, ConnectionResetError):  # the client under test gave up: what it should do
            pass

    def do_GET(self):
        self._handle(None)

    def do_POST(self):
        self._handle(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def send_json(self, payload, code: int = 200):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stub():
    """(set_routes, url, handler class): a threaded stub on a free port of 127.0.0.1."""
    handler = type("Handler", (_Stub,), {"routes": {}, "stop": threading.Event(), "seen": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()

    def set_routes(**routes):
        handler.routes = {("*" if k == "any" else "/" + k.replace("__", "/")): v for k, v in routes.items()}
    yield set_routes, f"http://127.0.0.1:{srv.server_address[1]}", handler
    handler.stop.set()
    srv.shutdown()
    srv.server_close()


def answer(payload, code: int = 200):
    return lambda h, body: h.send_json(payload, code)


def tokens_answer(timings=None):
    """A /completion answer: n_predict copies of token 3, with `timings` when given."""
    def route(h, body):
        out = {"tokens": [3] * body["n_predict"]}
        if timings is not None:
            out["timings"] = timings
        h.send_json(out)
    return route


def props(build_info="b0-stub"):
    return answer({"build_info": build_info})


def endless(h, body):
    h.protocol_version = "HTTP/1.0"  # no length: the body runs until the connection closes
    h.send_response(200)
    h.end_headers()
    chunk, sent = b"[" + b"1," * 32767, 0
    while sent < ENDLESS_BYTES and not h.stop.is_set():
        h.wfile.write(chunk)
        sent += len(chunk)


def huge(h, body):
    h.send_response(200)
    h.send_header("Content-Length", str(10 << 30))
    h.end_headers()
    h.wfile.write(b"[" * 1024)


def trickle(h, body):
    """A valid answer, a byte every 0.2 s: every read gets something, the whole never comes in time."""
    data = json.dumps({"tokens": [3] * body["n_predict"], "pad": " " * 200}).encode()
    h.send_response(200)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    start = time.monotonic()
    for i in range(len(data)):
        h.wfile.write(data[i:i + 1])
        h.wfile.flush()
        if time.monotonic() - start < STUB_LIMIT_S:
            h.stop.wait(0.2)


def trickled_headers(h, body):
    h.wfile.write(b"HTTP/1.1 200 OK\r\n")
    start = time.monotonic()
    while time.monotonic() - start < STUB_LIMIT_S and not h.stop.is_set():
        h.wfile.write(b"X")
        h.wfile.flush()
        h.stop.wait(0.2)


def never(h, body):
    """Accepts the request and sleeps."""
    h.stop.wait(STUB_LIMIT_S * 8)


def _tiny_target():
    from minispec import ModelConfig
    return Transformer(ModelConfig(**TINY))


def draw(url, timeout=1.5, samples=4, **kw):
    return server_samples(_tiny_target(), ServerClient(url, deadline=timeout, max_bytes=1 << 20), [[1, 3]],
                          samples=samples, tokens=3, temperature=1.0, top_k=None, top_p=None,
                          model_check=kw.pop("model_check", False), workers=kw.pop("workers", 2), **kw)


def one_line(e) -> str:
    s = str(e.value)
    assert "\n" not in s and s
    return s


# ---------------------------------------------------------------------------
# 3. bounded answers: size, and a deadline for the whole answer

@pytest.mark.parametrize("route, match, seconds", [
    (endless, r"llama-server at http://127\.0\.0\.1:\d+: POST /completion answered more than 1048576 bytes, the "
              r"limit on an answer's size", 4.0),
    (huge, r"answered 10737418240 bytes, over the 1048576-byte limit", 2.0),
    (trickle, r"POST /completion timed out: no complete answer within 1\.5 s \(the deadline for a whole answer\)",
     4.0),
    (trickled_headers, r"timed out: no complete answer within 1\.5 s", 4.0),
    (never, r"timed out: no complete answer within 1\.5 s", 4.0),
])
def test_an_answer_is_bounded_in_size_and_time(stub, route, match, seconds):
    set_routes, url, _ = stub
    set_routes(props=props(), completion=route)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match=match) as e:
            draw(url)
        elapsed = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_line(e)
    assert elapsed < seconds, elapsed
    assert peak < 16 * (1 << 20), peak  # the 1 MiB cap, not the body
    assert "--dtype" not in str(e.value)


def test_get_json_is_the_reusable_piece(stub):
    """get_json alone: the server's name and the limits in each message; a Cancel ends a stuck request at once
    from another thread."""
    set_routes, url, _ = stub
    set_routes(ok=answer({"x": [1, 2.5]}), never=never, bad=answer({"error": {"message": "no\nway"}}, 503))
    assert get_json(f"{url}/ok", {"q": 1}, deadline=5, server_name="srv") == {"x": [1, 2.5]}
    with pytest.raises(ServerError, match=r"^srv: GET /bad answered HTTP 503: no way$"):
        get_json(f"{url}/bad", deadline=5, server_name="srv")
    cancel = Cancel()
    threading.Timer(0.5, cancel).start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="srv: GET /never was stopped"):
        get_json(f"{url}/never", deadline=30, server_name="srv", cancel=cancel)
    assert time.monotonic() - t0 < 3
    with pytest.raises(ServerError, match="deadline must be a positive, finite"):
        get_json(f"{url}/ok", deadline=float("inf"), server_name="srv")
    assert MAX_BYTES >= 1 << 20


# ---------------------------------------------------------------------------
# 4. no tracebacks from server data

NESTED = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize("completion, match", [
    (answer(NESTED), "with JSON nested too deeply to read"),
    (answer(b'{"tokens": [3, 3, 3], "timings": {"draft_n": Infinity}}'), "a number it cannot take: Infinity"),
    (answer(b'{"tokens": [3, 3, 3], "timings": {"draft_n": 1e999}}'),
     "a number it cannot take: the number '1e999' is not finite"),
    (answer(b'{"tokens": [3, 3, NaN]}'), "a number it cannot take: NaN"),
    (answer(b'{"tokens": [3, 3, ' + b"9" * 5000 + b"]}"), "a number it cannot take"),
    (tokens_answer({"draft_n": -500, "draft_n_accepted": 900}), r"timings\.draft_n is -500, not a count"),
    (tokens_answer({"draft_n": 4.5}), r"timings\.draft_n is 4\.5, not a count"),
    (tokens_answer({"draft_n": 2, "draft_n_accepted": 3}), "3 draft tokens accepted of 2 drafted"),
    (tokens_answer({"draft_n": 10**30}), r"timings\.draft_n is 1000000000000000000000000000000, not a count"),
    (tokens_answer({"draft_n": "many"}), r"timings\.draft_n is 'many', not a count"),
])
def test_server_numbers_and_shapes_are_checked(stub, completion, match):
    set_routes, url, _ = stub
    set_routes(props=props(), completion=completion)
    with pytest.raises(ServerError, match=match) as e:
        draw(url)
    assert one_line(e).startswith("llama-server at http://127.0.0.1:")


def test_honest_timings_are_counted(stub):
    """The control: counts that make sense give the acceptance they imply."""
    set_routes, url, _ = stub
    set_routes(props=props(), completion=tokens_answer({"draft_n": 4, "draft_n_accepted": 3}))
    spec = draw(url).settings["speculation"]
    assert spec == {"drafted": 16, "accepted": 12, "acceptance_rate": 0.75}


@pytest.mark.parametrize("info", [{"commit": "abc"}, 12, ["b1"]])
def test_a_build_info_that_is_no_string_is_the_servers_fault(stub, info):
    set_routes, url, _ = stub
    set_routes(props=props(info), completion=tokens_answer())
    with pytest.raises(ServerError, match=r"llama-server at http://127\.0\.0\.1:\d+: /props gives build_info .*, "
                                          "not a string naming its build") as e:
        draw(url)
    assert "samples file" not in one_line(e)


# ---------------------------------------------------------------------------
# 6. the same-model check counts a kept target's weights (and checks the probabilities it is sent)

def _kept_target(tmp_path):
    float_model = peaked_model(0, 32, dim=64)
    kept = kept_int4(float_model, tmp_path / "kept")
    return float_model, kept


def _model_routes(model, prompt, n_params=None, logprob=None):
    """What llama-server would answer for `model`: its sizes and its next-token log-probabilities."""
    cfg = model.config
    with torch.inference_mode():
        p = model(torch.tensor([prompt]))[0, -1].float().softmax(-1)
    top = torch.topk(p, 20)
    logprobs = [{"id": int(i), "logprob": float(v.log()) if logprob is None else logprob}
                for v, i in zip(top.values, top.indices)]
    meta = {"n_vocab": cfg.vocab_size, "n_embd": cfg.dim,
            "n_params": model.weight_count() if n_params is None else n_params}
    return dict(props=props(), v1__models=answer({"data": [{"meta": meta}]}),
                completion=answer({"completion_probabilities": [{"top_logprobs": logprobs}]}))


def test_a_kept_target_counts_what_it_holds(tmp_path):
    float_model, kept = _kept_target(tmp_path)
    n = sum(p.numel() for p in float_model.parameters())
    assert kept.weight_count() == n == float_model.weight_count()
    assert sum(p.numel() for p in kept.parameters()) < n / 10  # what parameters() alone would have counted
    int4 = peaked_model(0, 32, dim=64).to_int4()
    assert int4.weight_count() == n


def test_a_kept_target_passes_the_model_check_of_its_own_model(stub, tmp_path):
    set_routes, url, _ = stub
    float_model, kept = _kept_target(tmp_path)
    prompt = [1, 3, 4]
    # the server computes the same quantized weights (its probabilities are the kept model's) and counts every
    # weight, as llama.cpp's n_params does
    set_routes(**_model_routes(kept, prompt, n_params=sum(p.numel() for p in float_model.parameters())))
    info = llama_server.check_same_model(ServerClient(url, deadline=10), kept, prompt)
    assert info["n_params"] == float_model.weight_count() and info["prob_difference"] < 1e-2
    # the control: a server reporting another size is still refused
    set_routes(**_model_routes(kept, prompt, n_params=float_model.weight_count() - 1))
    with pytest.raises(llama_server.ModelMismatchError, match="parameters, the target"):
        llama_server.check_same_model(ServerClient(url, deadline=10), kept, prompt)


@pytest.mark.parametrize("logprob, n_params, match", [
    (1e308, None, "gives token .* the log-probability 1e\\+308, not a finite number <= 0"),
    (None, "lots", "/v1/models gives n_params 'lots', not a count"),
])
def test_model_check_answers_are_checked(stub, tmp_path, logprob, n_params, match):
    set_routes, url, _ = stub
    float_model, kept = _kept_target(tmp_path)
    set_routes(**_model_routes(kept, [1, 3, 4], n_params=n_params, logprob=logprob))
    with pytest.raises(ServerError, match=match) as e:
        llama_server.check_same_model(ServerClient(url, deadline=10), kept, [1, 3, 4])
    one_line(e)


# ---------------------------------------------------------------------------
# 5. a stuck server cannot keep the audit alive; Ctrl-C ends it with one line

@pytest.fixture
def target_dir(tmp_path):
    tiny_checkpoint(tmp_path / "target")
    tiny_tokenizer_dir(tmp_path / "target")
    return tmp_path / "target"


def _cli_process(target_dir, url, *argv):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "minispec", "equivalence", "--target", str(target_dir), "--engine",
                             "llama.cpp", "--url", url, "--prompt", "ab cd", "--samples", "10", "--tokens", "3",
                             "--power-runs", "0", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that Python turns it into KeyboardInterrupt even
    when the tests run under a parent that ignores it (a background job of a shell without job control, nohup
    scripts): an ignored SIGINT is inherited, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(handler, path, proc, seconds=60.0):
    end = time.monotonic() + seconds
    while path not in handler.seen:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"no request for {path} within {seconds} s"
        time.sleep(0.05)


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def test_a_failed_request_ends_the_process_though_others_are_stuck(stub, target_dir):
    """One request fails, the other workers' requests never answer: the process exits at once with the failure
    (non-daemon pool threads kept it alive for the whole request timeout)."""
    set_routes, url, handler = stub
    calls = []

    def first_fails(h, body):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)  # the other workers are waiting by then
            h.send_json({"error": {"message": "the model exploded"}}, 500)
        else:
            never(h, body)
    set_routes(props=props(), completion=first_fails)
    proc = _cli_process(target_dir, url, "--no-model-check")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert _lines(err) == [_lines(err)[-1]] and "HTTP 500: the model exploded" in err, err


@pytest.mark.parametrize("stuck, argv", [("/completion", ["--no-model-check"]), ("/v1/models", [])])
def test_ctrl_c_ends_an_audit_within_seconds_with_one_line(stub, target_dir, stuck, argv):
    set_routes, url, handler = stub
    set_routes(props=props(), v1__models=never, completion=never)
    proc = _cli_process(target_dir, url, *argv)
    try:
        _wait_for(handler, stuck, proc)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=20)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130 and elapsed < 5, (elapsed, err)
    assert _lines(err) == ["interrupted"], err


# ---------------------------------------------------------------------------
# the weak list: the engine's arguments, checked first

@pytest.mark.parametrize("kw, match", [(dict(port=0), "port must be an integer >= 1 and <= 65535, got 0"),
                                       (dict(port=70000), "port must be .*, got 70000"),
                                       (dict(k=10**6), "k must be an integer >= 1 and <= 64"),
                                       (dict(deadline=float("nan")), "deadline must be a positive, finite")])
def test_server_settings_are_checked_before_anything_starts(tmp_path, kw, match):
    with pytest.raises(ServerError, match=match) as e:
        llama_server.LlamaServer(tmp_path / "m.gguf", binary=tmp_path / "absent", **kw)
    one_line(e)


@pytest.mark.parametrize("url, match", [("http://127.0.0.1:70000", "not a usable address"),
                                        ("http://[::1", "not a usable address"),
                                        ("http://127.0.0.1:0", "has port 0"),
                                        ("ftp://127.0.0.1:80", "not an http"),
                                        ("http://127.0.0.1:8080/v1?key=x", "has a query (?...)"),
                                        ("http://127.0.0.1:8080/v1#top", "has a fragment (#...)")])
def test_a_bad_url_exits_2_before_the_target_loads(target_dir, capsys, monkeypatch, url, match):
    from minispec import cli

    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    assert equivalence_cli(["--target", str(target_dir), "--engine", "llama.cpp", "--url", url, "--prompt", "ab"]) == 2
    err = _lines(capsys.readouterr().err)
    assert match in err[-1], err


def test_urls_are_normalised():
    assert base_url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert base_url("http://[::1]:9/x") == "http://[::1]:9"
    assert base_url("https://example.org") == "https://example.org"


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    return make_fake_binary(tmp_path, monkeypatch)


def test_a_draft_that_drafts_nothing_is_noted(fake_binary):
    """The fake server reports no drafted tokens although it was started with a draft: the verdict says so."""
    binary, model, _ = fake_binary
    with llama_server.LlamaServer(model, draft=model, k=3, binary=binary, startup_timeout=30) as server:
        s = server_samples(_tiny_target(), server.client, [[1, 3]], samples=20, tokens=2, temperature=1.0,
                           top_k=None, top_p=None, model_check=False, settings=server.settings)
    assert s.settings["speculation"] == {"drafted": 0, "accepted": 0, "acceptance_rate": None}
    report = audit_samples(_tiny_target(), s, power_runs=0, reference=False)
    assert any("drafted no tokens" in n for n in report.notes), report.notes
    # the control: a plain server (no draft) gets no such note; its verdict names it as drafting nothing
    with llama_server.LlamaServer(model, binary=binary, startup_timeout=30) as server:
        s = server_samples(_tiny_target(), server.client, [[1, 3]], samples=20, tokens=2, temperature=1.0,
                           top_k=None, top_p=None, model_check=False, settings=server.settings)
    assert s.settings["speculation"]["drafted"] == 0
    report = audit_samples(_tiny_target(), s, power_runs=0, reference=False)
    assert not any("drafted no tokens" in n for n in report.notes) and "no tokens were drafted" in report.verdict


def test_many_samples_are_not_built_up_front(stub):
    """A million samples asked, the first request fails: the error comes at once, without a job list."""
    set_routes, url, _ = stub
    set_routes(props=props(), completion=answer({"error": {"message": "busy"}}, 503))
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match="HTTP 503: busy"):
            draw(url, samples=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20 and time.monotonic() - t0 < 5, peak


def _cli_server(target_dir, binary, model, *argv) -> int:
    os.environ["LLAMA_SERVER"] = str(binary)
    try:
        return equivalence_cli(["--target", str(target_dir), "--engine", "llama.cpp", "--server-model", str(model),
                                "--prompt", "ab cd", "--power-runs", "0", *map(str, argv)])
    finally:
        del os.environ["LLAMA_SERVER"]


@pytest.mark.parametrize("argv, match", [(("--tokens", 100), "exceeds the target's max_seq_len=64"),
                                         (("--k", 10**6), "--k 1000000 is more than 64")])
def test_window_and_k_are_checked_before_the_server_starts(fake_binary, target_dir, capsys, argv, match):
    binary, model, args = fake_binary
    assert _cli_server(target_dir, binary, model, *argv) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and match in err[0], err
    assert not args.exists()  # the fake server never started


# ---------------------------------------------------------------------------
# files that are not regular files, and files that never end

def test_a_fifo_samples_file_is_refused_without_waiting(target_dir, tmp_path, capsys):
    fifo = tmp_path / "s.jsonl"
    os.mkfifo(fifo)

    def unblock():  # what ends an old reader's wait: a writer that writes nothing
        end = time.monotonic() + STUB_LIMIT_S
        while time.monotonic() < end:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                time.sleep(0.1)
                continue
            time.sleep(0.1)
    threading.Thread(target=unblock, daemon=True).start()
    t0 = time.monotonic()
    assert equivalence_cli(["--target", str(target_dir), "--samples-file", str(fifo)]) == 2
    err = _lines(capsys.readouterr().err)
    assert err[-1].startswith("python -m minispec equivalence: error: argument --samples-file: samples file ")
    assert "is not a regular file" in err[-1] and time.monotonic() - t0 < 3, err


def test_a_device_as_samples_file_is_refused(tmp_path):
    with pytest.raises(Exception, match="is not a regular file"):
        read_samples("/dev/zero", 16, 64, 10)
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)


def test_a_line_longer_than_any_sample_is_refused(tmp_path):
    path = tmp_path / "s.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"temperature": 1.0, "top_k": null, "top_p": null, "new_tokens": 2, "engine": "x", '
                b'"engine_version": null}\n{"prompt": [' + b"1, " * (2 << 20) + b'1], "tokens": [1, 2]}\n')
    with pytest.raises(Exception, match=r"line 2 is longer than \d+ bytes, more than any sample") as e:
        read_samples(path, 16, 64, 1)
    one_line(e)


def test_save_samples_into_a_fifo_is_refused(target_dir, tmp_path, capsys):
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    assert equivalence_cli(["--target", str(target_dir), "--draft", "prompt-lookup", "--prompt", "ab",
                            "--save-samples", str(fifo)]) == 2
    assert "is not a regular file" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# tools/llama_cpp.py speculative-samples against fake llama.cpp programs

FAKE_COMPLETION = """#!{python}
import sys
sys.stderr.write("number of tokens in prompt = 3\\n     1 -> '<s>'\\n     8 -> 'ab'\\n     9 -> 'cd'\\n")
"""
FAKE_SPECULATIVE = """#!{python}
import os, sys
if "--version" in sys.argv:
    print("version: 0 (fake)")
    sys.exit(0)
if os.environ.get("FAKE_SPEC_MODE") == "fail":
    sys.stderr.write("load_tensors: loading model\\nllama_model_load: error loading model: tensor 'output.weight' is "
                     "corrupt\\nmain: exiting\\nllama_perf_context_print: total time = 1 ms\\n")
    sys.exit(1)
n = int(sys.argv[sys.argv.index("-n") + 1])
sys.stderr.write("the sampled target token (4, 'b') did not match, or we ran out of drafted tokens\\n" * n)
sys.stderr.write("n_predict = %d\\n" % n)
"""


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("llama-completion", FAKE_COMPLETION), ("llama-speculative", FAKE_SPECULATIVE)):
        (d / name).write_text(text.format(python=sys.executable))
        (d / name).chmod(0o755)
    monkeypatch.setattr(llama_cpp, "log_flush_env", lambda bin_path=None: dict(os.environ))
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    return d


def _spec(fake_bin, out, samples=3, **kw):
    root = fake_bin.parent
    args = dict(tokens=2, temperature=0.7, top_k=0, top_p=1.0, k=2, seed=0, threads=1, progress=False)
    return llama_cpp.speculative_samples(root / "t.gguf", root / "t.gguf", "<s>ab cd", out, samples,
                                         bin_path=fake_bin, **{**args, **kw})


SPECULATIVE_LOG = """set_abort_callback: call
done_getting_tensors: tensor 'token_embd.weight' (f32) (and 11 others) cannot be used with preferred buffer type \
CPU_REPACK, using CPU instead
main: draft model vocab must closely match target model to use speculation but target vocab size 16 does not match \
draft vocab size 151936 - difference 151920, max allowed 128
~llama_context:        CPU compute buffer size is   9.3794 MiB, matches expectation of   9.3794 MiB
"""
SERVER_LOG = """0.00.015.600 I build: 0
0.00.015.627 E gguf_init_from_reader: this GGUF file is version 1802401130 but this software only supports up to \
version 3
0.00.015.627 E gguf_init_from_reader: failed to read header
0.00.015.646 I srv    operator(): operator(): cleaning up before exit...
0.00.016.719 E srv  llama_server: exiting due to model loading error
"""


@pytest.mark.parametrize("log, cause", [
    (SPECULATIVE_LOG, "main: draft model vocab must closely match"),  # llama-speculative's -lv 5 log, no levels
    (SERVER_LOG, "gguf_init_from_reader: this GGUF file is version"),  # llama-server's, levels shown: the first E
    ("", "(no output)"),  # a crash before its log was flushed
])
def test_the_cause_of_a_failure_is_read_from_the_log(log, cause):
    """Real logs of llama.cpp's programs failing (a draft of another vocabulary, a file that is no GGUF)."""
    assert llama_server.log_cause(log).startswith(cause)


def test_a_failed_first_sample_shows_the_cause_and_leaves_no_file(fake_bin, tmp_path, monkeypatch):
    out = tmp_path / "s.jsonl"
    monkeypatch.setenv("FAKE_SPEC_MODE", "fail")
    with pytest.raises(llama_cpp.DriverError, match="error loading model: tensor 'output.weight' is corrupt") as e:
        _spec(fake_bin, out)
    one_line(e)
    assert not out.exists()
    monkeypatch.delenv("FAKE_SPEC_MODE")
    assert _spec(fake_bin, out) == 3  # the control: the same run draws when the program works
    assert len(read_samples(out, 16, 64, 1).tokens) == 3


def test_a_resume_does_not_count_corrupt_lines(fake_bin, tmp_path):
    out = tmp_path / "s.jsonl"
    _spec(fake_bin, out, samples=2)
    with open(out, "a") as f:
        f.write('{"prompt": [1, 8, 9], "tokens": "oops"}\n')
    with pytest.raises(llama_cpp.DriverError, match="line 4 is not a sample of this run"):
        _spec(fake_bin, out, samples=5)
    assert len(out.read_text().splitlines()) == 4  # left as it was


def test_a_fifo_out_is_refused(fake_bin, tmp_path):
    fifo = tmp_path / "s.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that an old writer's open does not block
    try:
        with pytest.raises(llama_cpp.DriverError, match="is not a regular file"):
            _spec(fake_bin, fifo)
    finally:
        os.close(reader)


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_non_finite_temperature_is_refused(tmp_path, capsys, value):
    out = tmp_path / "s.jsonl"
    argv = ["speculative-samples", "--target", "t.gguf", "--draft", "d.gguf", "--prompt", "x", "--out", str(out),
            "--temperature", value]
    assert llama_cpp.main(argv) == 2
    err = capsys.readouterr().err
    assert "--temperature must be a finite number >= 0" in err and err.count("\n") == 1
    assert not out.exists()


# ---------------------------------------------------------------------------
# the real llama-server: a kept target against its own GGUF

needs_server = pytest.mark.skipif(not BUILT.is_file(), reason=f"llama-server is not built ({BUILT}): run "
                                                                "python tools/llama_cpp.py")


@needs_server
def test_real_server_accepts_a_kept_target_of_its_own_gguf(tmp_path):
    from test_quantized import quantized_gguf

    import convert_gguf

    gguf_path = quantized_gguf(tmp_path / "tiny.gguf")
    convert_gguf.convert(gguf_path, tmp_path / "kept", keep_quant=True, progress=False)
    kept = Transformer.from_pretrained(tmp_path / "kept")
    assert sum(p.numel() for p in kept.parameters()) < kept.weight_count()  # packed: parameters() misses them
    with llama_server.LlamaServer(gguf_path, parallel=1, ctx_size=64, threads=1) as server:
        pid = server.proc.pid
        info = llama_server.check_same_model(server.client, kept, [1, 8, 9])
        s = server_samples(kept, server.client, [[1, 8, 9]], samples=10, tokens=2, temperature=1.0, top_k=None,
                           top_p=None, model_check=False)
    assert info["n_params"] in (kept.weight_count(),) and info["prob_difference"] < llama_server.PROB_TOLERANCE
    assert s.counts == [10] and _gone(pid)


def redirect(location):
    def route(h, body):
        h.send_response(302)
        if location is not None:
            h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return route


def test_a_redirect_is_named_with_where_it_points(stub):
    set_routes, url, _ = stub
    set_routes(moved=redirect("https://elsewhere.example/v1/completions"), gone=redirect(None))
    with pytest.raises(ServerError, match=r"^srv: POST /moved answered HTTP 302, a redirect to "
                                          r"'https://elsewhere\.example/v1/completions'; redirects are not followed"):
        get_json(f"{url}/moved", {"q": 1}, deadline=5, server_name="srv")
    with pytest.raises(ServerError, match=r"^srv: GET /gone answered HTTP 302, a redirect to nowhere \(no Location"):
        get_json(f"{url}/gone", deadline=5, server_name="srv")
    with pytest.raises(ServerError, match="a redirect to 'https://elsewhere"):
        get_text(f"{url}/moved", deadline=5, server_name="srv")
