"""tools/vllm_cpu.py without a real vLLM: a fake install (a `python` that serves /health as vLLM's server would, or
fails as it can) checks the arguments, the exit statuses, the one-line errors and that no server process is left
after an audit, a failed start or Ctrl-C. The corrected expand is checked against the Triton kernel's definition.
The real engine is audited by `make audit-vllm` (docs/equivalence.md, "Auditing vLLM")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import vllm_cpu

TOOL = Path(vllm_cpu.__file__)

# the fake vLLM: `python -m vllm.entrypoints.openai.api_server --port P ...`; it starts a child in its process group
# (vLLM's engine core) and writes both pids and its arguments, then serves /health (mode "ok"), never becomes ready
# ("slow"), exits with a traceback ("crash"), or serves /health but hangs every other request ("hang"); "stubborn"
# ignores SIGTERM, as does its child
FAKE_PYTHON = """\
#!{python}
import http.server, json, os, signal, subprocess, sys, time
if sys.argv[1:3] == ["-W", "ignore"]:
    print("float32 -> WRONG", flush=True); sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_VLLM_MODE", "ok")
out = os.environ["FAKE_VLLM_OUT"]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
                          " if %r == 'stubborn' else None; time.sleep(600)" % mode])
try:  # a second server (the two-sample reference) writes beside the first
    os.close(os.open(out + ".first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
except FileExistsError:
    out = out + ".2"
with open(out + ".part", "w") as f:
    json.dump({{"pid": os.getpid(), "child": child.pid, "argv": sys.argv[1:], "pythonpath":
               os.environ.get("PYTHONPATH", ""), "kv": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}}, f)
os.replace(out + ".part", out)
if mode == "crash":
    print("INFO loading", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("ValueError: The draft model's vocabulary does not match (fake)", flush=True)
    print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
    child.kill(); sys.exit(1)
if mode == "errlog":  # as a vLLM whose engine core failed on a request
    print("Traceback (most recent call last):", flush=True)
    print("IndexError: index 188801552 is out of bounds for dimension 1 with size 49152 (fake)", flush=True)
if os.environ.get("PYTHONPATH", "").endswith("vllm_expand_fix") and mode != "nomark":
    print("minispec: vllm.utils.cpu_triton_utils._expand_kernel_impl replaced (fake)", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        if mode == "hang" and self.path != "/health":
            open(out + ".asked", "w").write(self.path)
        if mode == "slow" or (mode == "hang" and self.path != "/health"):
            time.sleep(600)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake install under tmp_path (its export cache holding the target's and the draft's exports), a target and a
    draft "checkpoint", and the file the fake server writes its pids and arguments to."""
    home = tmp_path / "vllm"
    bin_ = home / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (bin_ / "python").chmod(0o755)
    (home / "venv" / ".minispec-installed").write_text("fake\n")
    ckpts = []
    for name in ("target", "draft"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        hf = home / "hf" / f"{name}-{vllm_cpu._fingerprint(d)}"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
        ckpts.append(d)
    monkeypatch.setattr(vllm_cpu, "HOME", home)
    monkeypatch.setattr(vllm_cpu, "STOP_S", 3.0)
    monkeypatch.setenv("MINISPEC_VLLM_DIR", str(home))
    monkeypatch.setenv("FAKE_VLLM_OUT", str(tmp_path / "fake.json"))
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    return ckpts[0], ckpts[1], tmp_path / "fake.json"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie awaiting its parent's wait is gone as a process
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


def _pids(out: Path) -> tuple[int, int]:
    info = json.loads(out.read_text())
    return info["pid"], info["child"]


def _audit_exits_with(monkeypatch, status: int):
    monkeypatch.setattr(vllm_cpu, "audit_command",
                        lambda target, url, ref, rest: [sys.executable, "-c", f"raise SystemExit({status})"])


@pytest.mark.parametrize("status", [0, 1, 2])
def test_audit_exits_with_the_auditors_status_and_leaves_no_process(fake, monkeypatch, status):
    target, draft, out = fake
    _audit_exits_with(monkeypatch, status)
    assert vllm_cpu.main(["audit", "--target", str(target), "--draft", str(draft), "--", "--samples", "20"]) == status
    pid, child = _pids(out)
    assert _gone(pid) and _gone(child)


def test_server_command_and_environment(fake, monkeypatch):
    target, draft, out = fake
    seen = {}

    def command(target_, url, ref, rest):
        seen.update(url=url, ref=ref, rest=rest, cmd=vllm_cpu.__dict__["audit_command"])
        return [sys.executable, "-c", "pass"]
    monkeypatch.setattr(vllm_cpu, "audit_command", command)
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "3", "--k", "5", "--fix-expand", "--",
                          "--samples", "20", "--tokens", "4"]) == 0
    info = json.loads(out.read_text())
    argv = info["argv"]
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--dtype", "float32"), ("--max-model-len", "512"), ("--host", "127.0.0.1")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert info["pythonpath"].split(os.pathsep)[0].endswith("vllm_expand_fix") and info["kv"] == "1"
    assert seen["url"].endswith("/v1") and seen["ref"] is None and seen["rest"] == ["--samples", "20", "--tokens", "4"]


def test_audit_command_gives_the_auditor_the_server():
    cmd = vllm_cpu.audit_command(Path("/t"), "http://127.0.0.1:1/v1", None, ["--samples", "20"])
    assert cmd[1:] == ["-m", "minispec", "equivalence", "--engine", "openai", "--url", "http://127.0.0.1:1/v1",
                       "--target", "/t", "--samples", "20"]
    cmd = vllm_cpu.audit_command(Path("/t"), "http://a/v1", "http://b/v1", ["--prompt-ids", "1,2"])
    assert "--target" not in cmd and cmd[cmd.index("--reference-url") + 1] == "http://b/v1"


def test_two_sample_starts_a_reference_without_speculation(fake, monkeypatch, tmp_path):
    target, draft, out = fake
    seen = {}

    def command(target_, url, ref, rest):
        seen.update(url=url, ref=ref)
        return [sys.executable, "-c", "pass"]
    monkeypatch.setattr(vllm_cpu, "audit_command", command)
    starts = []
    real_command = vllm_cpu.VllmServer.command
    monkeypatch.setattr(vllm_cpu.VllmServer, "command", lambda self: starts.append(self.spec) or real_command(self))
    assert vllm_cpu.main(["audit", "--target", str(target), "--draft", str(draft), "--two-sample", "--",
                          "--prompt-ids", "1,2,3"]) == 0
    assert starts[0]["method"] == "draft_model" and starts[1] is None
    assert seen["ref"] and seen["ref"] != seen["url"]


@pytest.mark.parametrize("args, match", [
    (["--ngram", "3"], "--target"),
    (["--target", "T"], "one of the arguments --draft --ngram is required"),
    (["--target", "T", "--draft", "D", "--ngram", "3"], "not allowed with"),
    (["--target", "T", "--ngram", "0"], "--ngram must be >= 1"),
    (["--target", "T", "--ngram", "2", "--k", "0"], "--k must be"),
    (["--target", "T", "--ngram", "2", "--", "--url", "http://x/v1"], "--url is the tool's to give"),
    (["--target", "T", "--ngram", "2", "--", "--target=x"], "--target is the tool's to give"),
    (["--target", "T", "--ngram", "2", "--two-sample", "--", "--samples", "20"], "--prompt-ids"),
    (["--target", "MISSING", "--ngram", "2"], "not a minispec checkpoint"),
])
def test_bad_arguments_exit_2_in_one_line(fake, capsys, args, match):
    target, draft, out = fake
    args = [str(target) if a == "T" else str(draft) if a == "D" else a for a in args]
    assert vllm_cpu.main(["audit", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not out.exists()  # nothing started


def test_not_installed_is_one_line(fake, capsys, tmp_path, monkeypatch):
    target, _, _ = fake
    monkeypatch.setattr(vllm_cpu, "HOME", tmp_path / "nowhere")
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm_cpu.py install" in err[0]


def test_failed_start_says_why_in_one_line(fake, monkeypatch, capsys):
    target, draft, out = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    _audit_exits_with(monkeypatch, 0)
    assert vllm_cpu.main(["audit", "--target", str(target), "--draft", str(draft)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exited while starting" in err[0]
    assert "ValueError: The draft model's vocabulary does not match (fake)" in err[0]
    pid, child = _pids(out)
    assert _gone(pid) and _gone(child)


def test_start_timeout_stops_a_stubborn_server(fake, monkeypatch, capsys):
    target, _, out = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "stubborn")

    def wait_ready(self):
        _wait_for(out)  # the server and its child run, both ignoring SIGTERM
        raise vllm_cpu.ToolError("not ready (test)")
    monkeypatch.setattr(vllm_cpu.VllmServer, "wait_ready", wait_ready)
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "2"]) == 1
    assert "not ready (test)" in capsys.readouterr().err
    pid, child = _pids(out)
    assert _gone(pid) and _gone(child)  # SIGTERM ignored by both: the group was killed


def test_startup_timeout(fake, monkeypatch, capsys):
    target, _, out = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "slow")
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "2", "--startup-timeout", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not ready within 2 s" in err[0]
    assert all(_gone(p) for p in _pids(out))


def test_fix_not_applied_is_refused(fake, monkeypatch, capsys):
    target, _, out = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "nomark")
    _audit_exits_with(monkeypatch, 0)
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "2", "--fix-expand"]) == 1
    assert "without the corrected expand" in capsys.readouterr().err
    assert all(_gone(p) for p in _pids(out))


def _wait_for(path: Path, seconds: float = 30.0, *others: Path) -> None:
    """Until `path` (or any of `others`) exists and is not empty."""
    deadline = time.monotonic() + seconds
    while not any(p.exists() and p.stat().st_size for p in (path, *others)):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("mode, when", [("slow", "while the server starts"), ("hang", "during the audit")])
def test_ctrl_c_leaves_no_process(fake, tmp_path, mode, when):
    """Ctrl-C at a terminal: SIGINT to the tool's whole process group (the tool and the auditor it runs)."""
    target, _, out = fake
    env = {**os.environ, "FAKE_VLLM_MODE": mode}
    # the auditor is the real one (without the weights: the fake target has none): against the "hang" servers it
    # waits on /v1/models until interrupted
    tool = subprocess.Popen([sys.executable, str(TOOL), "audit", "--target", str(target), "--ngram", "2",
                             "--two-sample", "--", "--prompt-ids", "1,2,3", "--samples", "20"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(out)
        if mode == "hang":  # the auditor running, waiting on an answer of either server (the first to start
            # need not be the one it asks first)
            _wait_for(Path(f"{out}.asked"), 120, Path(f"{out}.2.asked"))
        time.sleep(0.5)
        os.killpg(tool.pid, signal.SIGINT)
        _, err = tool.communicate(timeout=60)
        assert tool.returncode in (1, 130), err
        assert "Traceback" not in err, err
        pids = [*_pids(out), *(_pids(Path(f"{out}.2")) if mode == "hang" else ())]
        assert len(pids) == (4 if mode == "hang" else 2) and all(_gone(p) for p in pids), when
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
        for f in (out, Path(f"{out}.2")):
            for p in _pids(f) if f.exists() else ():
                if not _gone(p):
                    os.kill(p, signal.SIGKILL)


def test_sigterm_to_the_tool_stops_the_server(fake, tmp_path):
    target, _, out = fake
    tool = subprocess.Popen([sys.executable, str(TOOL), "serve", "--target", str(target), "--ngram", "2"],
                            env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert tool.stdout.readline().strip().endswith("/v1")
        tool.terminate()
        tool.communicate(timeout=60)
        assert tool.returncode == 130
        assert all(_gone(p) for p in _pids(out))
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)


def test_log_cause_takes_the_root_exception():
    log = ("INFO 12-07 starting\nERROR 12-07 EngineCore failed to start.\nTraceback (most recent call last):\n"
           "  File \"x.py\", line 1\nValueError: num_speculative_tokens must be > 0\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert vllm_cpu.log_cause(log) == "ValueError: num_speculative_tokens must be > 0"
    assert vllm_cpu.log_cause("ERROR something broke\n") == "ERROR something broke"
    # vLLM's prefixed lines (a worker's error, then the engine's and the API server's generic ones)
    served = ("(Worker pid=7) ERROR 12-07 22:51:37 [multiproc_executor.py:1063] Traceback (most recent call last):\n"
              "(Worker pid=7) ERROR 12-07 22:51:37 [multiproc_executor.py:1063] RuntimeError: index -597725616 is "
              "out of bounds for dimension 1 with size 49152\n"
              "(EngineCore pid=6) ERROR 12-07 22:51:37 [core.py:1512] EngineCore encountered a fatal error.\n"
              "(APIServer pid=5) ERROR 12-07 22:51:37 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
              "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")
    assert vllm_cpu.log_cause(served) == ("RuntimeError: index -597725616 is out of bounds for dimension 1 with size "
                                          "49152")
    assert vllm_cpu.log_cause("") == "(no output)"


# ---- the corrected expand, against the Triton kernel's definition (rejection_sampler.expand_kernel)

def _load_fix():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_vllm_expand_fix", vllm_cpu.FIX_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    meta = list(sys.meta_path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.meta_path[:] = meta  # the import hook stays out of this process
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.float64])
def test_corrected_expand_writes_the_callers_buffer(dtype):
    fix = _load_fix()
    x = torch.tensor([0.8, 0.0, 1.3, 50.0]).to(dtype)
    cu = torch.tensor([3, 3, 7, 8], dtype=torch.int32)  # the second request has no tokens
    out = torch.full((8,), -1, dtype=dtype)
    fix.expand(out, x, cu, -5, 7)  # -5 in no request
    want = torch.tensor([0.8] * 3 + [1.3] * 4 + [50.0]).to(dtype)
    assert torch.equal(out, want)
    out = torch.full((8,), -1, dtype=dtype)
    fix.expand(out, x, cu, -5, 0, MAX_NUM_TOKENS=2)  # at most MAX_NUM_TOKENS a request, as the kernel's mask
    assert out.tolist() == torch.tensor([0.8, 0.8, -1, 1.3, 1.3, -1, -1, 50.0]).to(dtype).tolist()
    out = torch.zeros(1, dtype=dtype)
    fix.expand(out, torch.tensor([0]).to(dtype), torch.tensor([1], dtype=torch.int32), 0, 9)  # replace_from -> to
    assert out.tolist() == [9]


def test_expand_op_command_reports_the_probe(fake, capsys):
    assert vllm_cpu.main(["expand-op"]) == 1
    assert "WRONG" in capsys.readouterr().out


def test_throughput_arguments(fake, capsys):
    target, _, out = fake
    for extra in (["--samples", "0"], ["--concurrency", "1,0"]):
        assert vllm_cpu.main(["throughput", "--target", str(target), "--ngram", "2", "--prompt", "x", *extra]) == 2
    assert vllm_cpu.main(["throughput", "--target", str(target), "--ngram", "2"]) == 2  # --prompt is required
    assert vllm_cpu.main(["throughput", "--target", str(target), "--ngram", "2", "--prompt", "x", "--", "y"]) == 2
    assert "Traceback" not in capsys.readouterr().err and not out.exists()


def test_a_failed_audit_shows_the_servers_error(fake, monkeypatch, capsys):
    target, _, out = fake
    monkeypatch.setenv("FAKE_VLLM_MODE", "errlog")
    _audit_exits_with(monkeypatch, 1)
    assert vllm_cpu.main(["audit", "--target", str(target), "--ngram", "2"]) == 1
    err = capsys.readouterr().err
    assert "log: IndexError: index 188801552 is out of bounds" in err
    assert all(_gone(p) for p in _pids(out))
