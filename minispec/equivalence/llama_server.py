"""llama.cpp's `llama-server` as an engine under test: samples drawn over its HTTP API, as token ids.

`server_samples` returns a SampleSet, which `harness.audit_samples` tests like a samples file:

    with LlamaServer(model="target.gguf", draft="draft.gguf", k=4) as server:   # or ServerClient(url)
        samples = server_samples(target, server.client, prompts, samples=2000, tokens=8, temperature=0.7, top_k=50)
    report = audit_samples(target, samples)

`LlamaServer` starts the server on a free port of 127.0.0.1 and stops it however the block ends
(success, error, Ctrl-C): terminate, then kill, then wait, so no process and no bound port stay
behind. An already running server is audited through `ServerClient(url)` alone.

The flags and fields are those of the llama.cpp sdist tools/llama_cpp.py builds (its
tools/server/README.md, server-schema.cpp, common/arg.cpp and common/sampling.cpp):

- a draft model is `--spec-type draft-simple --model-draft FILE --spec-draft-n-max K
  --spec-draft-n-min 0 --spec-draft-p-min 0`: `--draft-max` was removed, and without `--spec-type`
  the draft model is loaded but never used; the request's `speculative.*` fields are compiled out;
- each /completion request carries the prompt as ids, its own `seed`, `n_predict` = tokens with
  `ignore_eos`, `return_tokens` (the response's `tokens` holds the sampled ids), and a sampler chain
  of exactly `samplers: ["temperature", "top_k", "top_p"]` - minispec's order (top-p on the tempered
  distribution; llama.cpp's default applies temperature last) - with every other stage's setting
  written "off" as well (min-p, typical, top-n-sigma, XTC, DRY, penalties, dynamic temperature,
  mirostat, adaptive-p, grammar, logit bias).

llama.cpp ends a sequence at any end-of-generation token, and `ignore_eos` keeps it going by giving
those tokens a logit bias of -inf: the server then samples the target conditioned on not ending.
Where the target gives an end token real probability within the tested positions, that shows as a
failure of the audit; the report states this caveat in its engine settings.

Every failure raises `ServerError` (an InputError, so the command line prints one line and exits
with status 1); a server running another model than the target raises `ModelMismatchError`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..errors import InputError
from ..sampling import SamplingParams
from .samples import SampleSet, group

ENGINE = "llama.cpp"
BINARY = "llama-server"
# where tools/llama_cpp.py builds it, relative to a source checkout
BUILT = Path(__file__).resolve().parents[2] / "build" / "llama.cpp" / "out" / "bin" / BINARY
SAMPLERS = ["temperature", "top_k", "top_p"]
# every other stage of llama.cpp's sampler chain, set off (server-schema.cpp's field names)
OFF = dict(min_p=0.0, typical_p=1.0, top_n_sigma=-1.0, xtc_probability=0.0, dry_multiplier=0.0, repeat_penalty=1.0,
           repeat_last_n=0, presence_penalty=0.0, frequency_penalty=0.0, dynatemp_range=0.0, mirostat=0,
           adaptive_target=-1.0, grammar="", logit_bias=[], min_keep=0, n_probs=0, backend_sampling=False, stop=[],
           t_max_predict_ms=0, n_indent=0)
MAX_SEED = 2**32 - 2  # llama.cpp's seed is a uint32 and 0xFFFFFFFF means "random"
PROB_TOLERANCE = 1e-2  # how far the server's next-token probabilities may be from the target's (fp32)
PIECES = 32  # token ids whose text the model check compares


class ServerError(InputError):
    """llama-server could not be started or used, or answered something the harness cannot test; one line."""


class ModelMismatchError(ServerError):
    """The server's model is not minispec's --target: the message names what differs."""


def find_binary(binary=None) -> Path:
    """llama-server: `binary` when given, else $LLAMA_SERVER, else tools/llama_cpp.py's build, else on PATH."""
    for cand in (binary, os.environ.get("LLAMA_SERVER"), BUILT if BUILT.is_file() else None, shutil.which(BINARY)):
        if cand:
            path = Path(cand)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ServerError(f"{path} is not an executable llama-server; build it with python tools/llama_cpp.py")
            return path
    raise ServerError(f"{BINARY} not found (no $LLAMA_SERVER, no {BUILT}, none on PATH); build it with "
                      "python tools/llama_cpp.py")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """ServerError if something listens on host:port; SO_REUSEADDR as llama-server's own bind, so a port whose
    closed connections are in TIME_WAIT is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerError(f"port {port} on {host} is busy ({e.strerror}); choose another or leave it "
                              "unset") from None


class ServerClient:
    """JSON over HTTP to a llama-server at `url` (standard library only); every failure is a ServerError.

    `alive` (optional) says whether the server process still runs, so that a crash reads as a crash rather than
    as a refused connection."""

    def __init__(self, url: str, timeout: float = 300.0, alive=None):
        parts = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ServerError(f"--url {url!r} is not an http(s) address such as http://127.0.0.1:8080")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.timeout = timeout
        self.alive = alive

    def request(self, method: str, path: str, body=None, timeout: float | None = None, grace: float = 2.0):
        """The JSON answer; grace: seconds to let a server whose connection broke finish exiting (a crash)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout if timeout is None else timeout)
        where = f"{method} {self.url}{path}"
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            raise ServerError(f"{where} timed out after {conn.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            if self.alive is not None and not self.alive(grace):
                raise ServerError(f"llama-server exited during {where}: {self.alive.why()}") from None
            raise ServerError(f"{where} failed: {e.__class__.__name__}: {e}") from None
        finally:
            conn.close()
        try:
            out = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ServerError(f"{where} answered HTTP {resp.status} with no JSON: {raw[:80]!r}") from None
        if resp.status != 200:
            msg = out.get("error", out) if isinstance(out, dict) else out
            msg = msg.get("message", msg) if isinstance(msg, dict) else msg
            raise ServerError(f"{where} answered HTTP {resp.status}: {str(msg)[:200]}")
        return out

    def get(self, path: str, timeout: float | None = None):
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float | None = None):
        return self.request("POST", path, body, timeout=timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers {"status": "ok"} (a loading server answers 503), or ServerError after `timeout`."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                if self.request("GET", "/health", timeout=5, grace=0.0).get("status") == "ok":
                    return
            except ServerError as e:
                if self.alive is not None and not self.alive():
                    raise ServerError(f"llama-server exited while starting: {self.alive.why()}") from None
                last = str(e)
            if time.monotonic() > deadline:
                raise ServerError(f"llama-server at {self.url} was not healthy within {timeout:g} s ({last})")
            time.sleep(0.2)

    def version(self) -> str | None:
        try:
            props = self.get("/props")
        except ServerError:
            return None
        return props.get("build_info") if isinstance(props, dict) else None


class _Alive:
    """Whether a started process still runs, and why it stopped (its exit status and last log line)."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log

    def __call__(self, grace: float = 0.0) -> bool:
        """Still running; `grace` seconds allow a process whose connection just broke to finish exiting."""
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return True
        return False

    def why(self) -> str:
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        tail = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no output")
        return f"exit status {self.proc.returncode}; last log line: {tail[:200]}"


class LlamaServer:
    """A llama-server process for the length of a `with` block; `client` talks to it.

    model / draft: GGUF files (draft None: plain sampling); k: the maximum draft length; parallel: slots (concurrent
    sequences); ctx_size: context per slot; threads: CPU threads (None: llama.cpp's default); port: None picks a free
    one; startup_timeout: seconds to become healthy (loading a model); timeout: seconds per request.
    """

    def __init__(self, model, draft=None, k: int = 4, parallel: int = 4, ctx_size: int = 512,
                 threads: int | None = None, port: int | None = None, binary=None, host: str = "127.0.0.1",
                 startup_timeout: float = 300.0, timeout: float = 300.0, extra_args=()):
        self.binary = find_binary(binary)
        for what, path in (("model", model), ("draft model", draft)):
            if path is not None and not Path(path).is_file():
                raise ServerError(f"the server's {what} {path} is not a file")
        self.model, self.draft, self.k, self.parallel = str(model), draft and str(draft), k, parallel
        self.host, self.port = host, port
        self.ctx_size, self.threads, self.extra_args = ctx_size, threads, list(extra_args)
        self.startup_timeout, self.timeout = startup_timeout, timeout
        self.proc: subprocess.Popen | None = None
        self.client: ServerClient | None = None
        self._logdir = None

    def args(self) -> list[str]:
        a = [str(self.binary), "--host", self.host, "--port", str(self.port), "--model", self.model,
             "--parallel", str(self.parallel), "--ctx-size", str(self.ctx_size * self.parallel), "--seed", "0",
             "--no-ui"]
        if self.threads is not None:
            a += ["--threads", str(self.threads)]
        if self.draft is not None:
            a += ["--spec-type", "draft-simple", "--model-draft", self.draft, "--spec-draft-n-max", str(self.k),
                  "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
        return a + self.extra_args

    @property
    def settings(self) -> dict:
        """What the report states about the server."""
        s = {"server_model": self.model, "server_draft": self.draft, "parallel": self.parallel}
        if self.draft is not None:
            s.update(spec_type="draft-simple", spec_draft_n_max=self.k, spec_draft_n_min=0, spec_draft_p_min=0.0)
        return s

    def __enter__(self) -> LlamaServer:
        if self.port is None:
            self.port = free_port(self.host)
        else:
            check_port_free(self.host, self.port)
        self._logdir = tempfile.TemporaryDirectory(prefix="minispec-llama-server-")
        log = Path(self._logdir.name) / "server.log"
        try:
            with open(log, "wb") as f:
                # a process group of its own: Ctrl-C reaches us, and we stop it; told to end if we die first
                self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                             start_new_session=True, preexec_fn=_end_with_parent(os.getpid()))
        except OSError as e:
            self._logdir.cleanup()
            raise ServerError(f"cannot start {self.binary}: {e.strerror or e}") from None
        alive = _Alive(self.proc, log)
        self.client = ServerClient(f"http://{self.host}:{self.port}", self.timeout, alive)
        try:
            self.client.wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the process (then kill it if it lingers) and reap it; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None


def _end_with_parent(parent: int):
    """A preexec_fn that has Linux send the child SIGTERM when the process that started it dies (however it
    dies: a kill -9 runs no cleanup of ours); elsewhere nothing (stop() still ends it on every exit we run)."""
    def arrange() -> None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)
    return arrange if sys.platform.startswith("linux") else None


def context_size(prompts: list[list[int]], tokens: int, k: int = 0) -> int:
    """The context one slot needs: the longest prompt, the new tokens and a round of k drafted ones."""
    return max(len(p) for p in prompts) + tokens + k + 1


def request_body(prompt: list[int], tokens: int, params: SamplingParams, seed: int) -> dict:
    """One /completion request: exactly the stated settings, every other sampler stage off, eos ignored."""
    return dict(prompt=list(prompt), n_predict=tokens, seed=seed, temperature=params.temperature,
                top_k=params.top_k or 0, top_p=1.0 if params.top_p is None else params.top_p, samplers=SAMPLERS,
                ignore_eos=True, return_tokens=True, stream=False, cache_prompt=True, **OFF)


def parse_tokens(resp, tokens: int, vocab_size: int) -> list[int]:
    """The sampled ids of a /completion response, checked: exactly `tokens` integers in the vocabulary."""
    ids = resp.get("tokens") if isinstance(resp, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ServerError(f"llama-server's /completion response has no list of token ids in \"tokens\" "
                          f"(got {str(ids)[:60]}); is it a llama.cpp server that supports return_tokens?")
    if len(ids) != tokens:
        raise ServerError(f"llama-server returned {len(ids)} tokens, expected {tokens} (n_predict with ignore_eos; "
                          f"stop_type {resp.get('stop_type')!r})")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ServerError(f"llama-server returned token id {bad}, outside the target's vocabulary [0, {vocab_size})")
    return ids


def _draw(client: ServerClient, prompts, counts, tokens: int, params: SamplingParams, seed: int, vocab_size: int,
          workers: int, bar=None) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Every sample, sample g (prompt-major) seeded seed + g, `workers` requests in flight. Returns the (prompt, ids)
    pairs and the draft tokens the server reports it drafted and accepted (its responses' timings)."""
    jobs = [(p, seed + g) for g, p in enumerate(p for p, n in zip(prompts, counts) for _ in range(n))]
    out: list = [None] * len(jobs)
    drafts = {"drafted": 0, "accepted": 0}
    lock = threading.Lock()

    def one(i):
        p, s = jobs[i]
        resp = client.post("/completion", request_body(p, tokens, params, s))
        out[i] = (p, parse_tokens(resp, tokens, vocab_size))
        timings = resp.get("timings")
        with lock:
            if isinstance(timings, dict):
                drafts["drafted"] += int(timings.get("draft_n", 0))
                drafts["accepted"] += int(timings.get("draft_n_accepted", 0))
            if bar is not None:
                bar.update(1)

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(one, i) for i in range(len(jobs))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if bar is not None:
            bar.close()
    return out, drafts


def _model_meta(client: ServerClient) -> dict:
    models = client.get("/v1/models")
    try:
        return dict(models["data"][0]["meta"])
    except (KeyError, IndexError, TypeError):
        raise ServerError("llama-server's /v1/models has no data[0].meta (vocabulary size, parameters)") from None


def _n_params(target) -> int:
    return sum(p.numel() for p in {id(p): p for p in target.parameters()}.values())


def check_same_model(client: ServerClient, target, prompt: list[int]) -> dict:
    """The server's model must be the target: vocabulary size, width, parameter count, the text of PIECES token
    ids (when the target has a tokenizer) and the next-token probabilities after `prompt`; ModelMismatchError
    naming the first difference. Returns what was compared, for the report."""
    cfg = target.config
    meta = _model_meta(client)
    info = {"n_vocab": meta.get("n_vocab"), "n_embd": meta.get("n_embd"), "n_params": meta.get("n_params")}
    vocab = {cfg.vocab_size, getattr(cfg, "sampled_vocab_size", None) or cfg.vocab_size}
    if meta.get("n_vocab") not in vocab:
        raise ModelMismatchError(f"the server's model has a vocabulary of {meta.get('n_vocab')} tokens, the target "
                                 f"{cfg.vocab_size}: not the same model")
    if meta.get("n_embd") != cfg.dim:
        raise ModelMismatchError(f"the server's model has width {meta.get('n_embd')}, the target {cfg.dim}: "
                                 "not the same model")
    n = _n_params(target)
    tied = cfg.vocab_size * cfg.dim  # a tied head is one tensor here and may count twice there
    if meta.get("n_params") not in (n, n + tied):
        raise ModelMismatchError(f"the server's model has {meta.get('n_params')} parameters, the target {n}: "
                                 "not the same model")
    tok = getattr(target, "tokenizer", None)
    if tok is not None:
        step = max(1, tok.vocab_size // PIECES)
        ids = list(range(0, tok.vocab_size, step))[:PIECES]
        differ = []
        for i in ids:
            theirs = client.post("/detokenize", {"tokens": [i]})
            theirs = theirs.get("content") if isinstance(theirs, dict) else None
            # stripped: a SentencePiece decoder drops the leading space of a text's first piece, llama.cpp keeps it
            if not isinstance(theirs, str) or theirs.strip() != tok.decode([i]).strip():
                differ.append((i, theirs))
        info["pieces_compared"], info["pieces_differing"] = len(ids), len(differ)
        if len(differ) * 2 > len(ids):
            i, theirs = differ[0]
            raise ModelMismatchError(f"the server's tokenizer differs from the target's: {len(differ)} of {len(ids)} "
                                     f"token ids read differently (id {i}: {theirs!r} there, {tok.decode([i])!r} "
                                     "here)")
    top = min(20, cfg.vocab_size)
    body = dict(request_body(prompt, 1, SamplingParams(1.0, None, None), 0), n_probs=top, post_sampling_probs=False)
    resp = client.post("/completion", body)
    try:
        top_logprobs = resp["completion_probabilities"][0]["top_logprobs"]
        theirs = {int(t["id"]): math.exp(float(t["logprob"])) for t in top_logprobs}
    except (KeyError, IndexError, TypeError, ValueError):
        raise ServerError("llama-server's /completion with n_probs returned no completion_probabilities[0]"
                          ".top_logprobs") from None
    with torch.inference_mode():
        logits = target(torch.tensor([prompt], device=target.device))[0, -1].float().cpu()
    ours = logits.softmax(-1)
    diff = max(abs(p - float(ours[i])) for i, p in theirs.items()) if theirs else math.inf
    info["prob_difference"] = diff
    if not diff <= PROB_TOLERANCE:
        raise ModelMismatchError(f"the server's next-token probabilities after the first prompt differ from the "
                                 f"target's by up to {diff:.3g} (> {PROB_TOLERANCE}): not the same weights, or not "
                                 "computed in F32 (serve the target as an F32 GGUF: llama-quantize ... F32)")
    return info


def server_samples(target, client: ServerClient, prompts: list[list[int]], samples: int, tokens: int,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int = 0, workers: int = 4,
                   model_check: bool = True, settings: dict | None = None, progress: bool = False) -> SampleSet:
    """`samples` samples of `tokens` tokens after each prompt from the llama-server behind `client`, as the
    SampleSet audit_samples tests (engine "llama.cpp", its build as engine_version, `settings` added to the
    settings line, and "speculation": the draft tokens drafted and accepted, when the server drafted any). The
    model is checked first unless model_check is False. Raises ServerError."""
    params = SamplingParams(temperature, top_k, top_p)
    last = seed + samples * len(prompts) - 1
    if not 0 <= seed or last > MAX_SEED:
        raise ServerError(f"llama.cpp's seeds are 32-bit: seed + samples - 1 = {last} exceeds {MAX_SEED}")
    head = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "new_tokens": tokens,
            "engine": ENGINE, "engine_version": client.version(), "seed": seed, "url": client.url,
            "samplers": SAMPLERS, "ignore_eos": "end-of-generation tokens masked (logit bias -inf)",
            **(settings or {})}
    head["model_check"] = check_same_model(client, target, prompts[0]) if model_check else "skipped"
    bar = None
    if progress:
        import sys

        from tqdm import tqdm
        bar = tqdm(total=samples * len(prompts), desc=ENGINE, unit="sample", file=sys.stderr, dynamic_ncols=True)
    pairs, drafts = _draw(client, prompts, [samples] * len(prompts), tokens, params, seed, target.config.vocab_size,
                          workers, bar)
    if drafts["drafted"]:
        head["speculation"] = {**drafts, "acceptance_rate": drafts["accepted"] / drafts["drafted"]}
    return group(head, pairs, f"{ENGINE} server {client.url}")
