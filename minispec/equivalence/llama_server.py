"""llama.cpp's `llama-server` as an engine under test: samples drawn over its native HTTP API, as token ids.

This module holds the engine whole: its process, its requests and answers, the same-model check, and its
`Endpoint` (the native /completion, a drawing.Endpoint) with `server_drawing` (a drawing.Drawing of it that
`harness.audit_samples` draws as it scores, with the early-stop looks) and `server_samples` (every sample at once):

    with LlamaServer(model="target.gguf", draft="draft.gguf", k=4) as server:   # or ServerClient(url)
        drawing = server_drawing(target, server.client, prompts, samples=2000, tokens=8,
                                 temperature=0.7, top_k=50)
        report = audit_samples(target, drawing)   # inside the block: the server draws as the audit reads

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

Every request goes through minispec.equivalence.http (a deadline for the whole answer, a cap on its size, JSON
with finite numbers only), and every number an answer holds is checked before it is used. Every failure raises
`ServerError` (an InputError, so the command line prints one line and exits with status 1); a server running
another model than the target raises `drawing.ModelMismatchError`. The requests run in the Drawing's daemon
threads, which a failure, an early stop or Ctrl-C ends at once (`http.Cancel`), so a stuck server cannot keep the
process alive.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import check_int, is_int, is_number, show
from ..sampling import SamplingParams
from .drafts import llama_timings
from .drawing import PROB_TOLERANCE, Drawing, ModelMismatchError, check_seed_range, prob_difference
from .drawing import Endpoint as EndpointBase
from .http import (
    MAX_BYTES,
    REQUEST_S,
    SMALL_REQUEST_S,
    Cancel,
    ServerError,
    ServerUnreachable,
    base_url,
    check_seconds,
    get_json,
)
from .samples import SampleSet

ENGINE = "llama.cpp"
CONCURRENCY = 4  # requests in flight to a llama-server by default, and the slots (--parallel) one is started with
BINARY = "llama-server"
# where tools/llama_cpp.py builds it, relative to a source checkout
BUILT = Path(__file__).resolve().parents[2] / "build" / "llama.cpp" / "out" / "bin" / BINARY
SAMPLERS = ["temperature", "top_k", "top_p"]
# every other stage of llama.cpp's sampler chain, set off (server-schema.cpp's field names)
OFF = dict(min_p=0.0, typical_p=1.0, top_n_sigma=-1.0, xtc_probability=0.0, dry_multiplier=0.0, repeat_penalty=1.0,
           repeat_last_n=0, presence_penalty=0.0, frequency_penalty=0.0, dynatemp_range=0.0, mirostat=0,
           adaptive_target=-1.0, grammar="", logit_bias=[], min_keep=0, n_probs=0, backend_sampling=False, stop=[],
           t_max_predict_ms=0, n_indent=0)
PIECES = 32  # token ids whose text the model check compares
MAX_K = 64  # the longest draft a server is asked for: each slot's context holds a round of them
STOP_S = 5.0  # how long a stopped server may take to exit on SIGTERM before it is killed


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


def check_port(port) -> int:
    """A TCP port a server can listen on (1..65535), or ServerError."""
    return check_int("port", port, 1, 65535, error=ServerError)


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
    """JSON over HTTP to a llama-server at `url` (minispec.equivalence.http: each answer bounded by `deadline`
    seconds in all and `max_bytes` bytes); every failure is a ServerError naming the server.

    `alive` (optional) says whether the server process still runs, so that a crash reads as a crash rather than
    as a refused connection."""

    def __init__(self, url: str, deadline: float = REQUEST_S, alive=None, max_bytes: int = MAX_BYTES):
        self.url = base_url(url)
        self.deadline = check_seconds(deadline, "the server's request deadline")
        self.max_bytes = check_int("max_bytes", max_bytes, 1, error=ServerError)
        self.alive = alive
        self.name = f"{BINARY} at {self.url}"

    def request(self, method: str, path: str, body=None, deadline: float | None = None, grace: float = 2.0,
                cancel: Cancel | None = None):
        """The JSON answer; grace: seconds to let a server whose connection broke finish exiting (a crash)."""
        try:
            return get_json(f"{self.url}{path}", body, method=method, deadline=deadline or self.deadline,
                            max_bytes=self.max_bytes, server_name=self.name, cancel=cancel)
        except ServerUnreachable:
            if self.alive is not None and not self.alive(grace):
                raise ServerError(f"llama-server exited during {method} {self.url}{path}: {self.alive.why()}") from None
            raise

    def get(self, path: str, deadline: float | None = None):
        return self.request("GET", path, deadline=deadline or min(self.deadline, SMALL_REQUEST_S))

    def post(self, path: str, body, deadline: float | None = None, cancel: Cancel | None = None):
        return self.request("POST", path, body, deadline=deadline, cancel=cancel)

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers {"status": "ok"} (a loading server answers 503), or ServerError after `timeout`."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                answer = self.request("GET", "/health", deadline=5, grace=0.0)
                if isinstance(answer, dict) and answer.get("status") == "ok":
                    return
            except ServerError as e:
                if self.alive is not None and not self.alive():
                    raise ServerError(f"llama-server exited while starting: {self.alive.why()}") from None
                last = str(e)
            if time.monotonic() > deadline:
                raise ServerError(f"llama-server at {self.url} was not healthy within {timeout:g} s ({last})")
            time.sleep(0.2)

    def version(self) -> str | None:
        """The server's build_info (None when it has no /props); ServerError if it names its build with
        something other than a string."""
        try:
            props = self.get("/props")
        except ServerUnreachable:
            raise
        except ServerError:
            return None
        info = props.get("build_info") if isinstance(props, dict) else None
        if info is not None and not isinstance(info, str):
            raise ServerError(f"{self.name}: /props gives build_info {show(info)}, not a string naming its build")
        return None if info is None else " ".join(info.split())[:200]


_LEVELLED_ERROR = re.compile(r"^[\d.]*\s*E\s+(.*)$")  # a line of llama.cpp's log at level E (with its prefix on)
_SAYS_ERROR = re.compile(r"\berror\b|\bfailed\b|GGML_ASSERT|\bmust\b|\bunable\b|\binvalid\b|\bdoes not\b", re.I)


def log_cause(text: str) -> str:
    """The line of a llama.cpp program's log that says why it failed: its first error-level line where the log
    shows levels (the root cause: the rest are its consequences), else the last line that says something went
    wrong (a debug log names the failure near its end, before the teardown's lines), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    levelled = next((m.group(1) for ln in lines if (m := _LEVELLED_ERROR.match(ln))), None)
    said = next((ln for ln in reversed(lines) if _SAYS_ERROR.search(ln)), None)
    return (levelled or said or (lines[-1] if lines else "(no output)"))[:300]


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
        return f"exit status {self.proc.returncode}; its log says: {log_cause(self.log.read_text(errors='replace'))}"


class LlamaServer:
    """A llama-server process for the length of a `with` block; `client` talks to it.

    model / draft: GGUF files (draft None: plain sampling); k: the maximum draft length; parallel: slots (concurrent
    sequences); ctx_size: context per slot; threads: CPU threads (None: llama.cpp's default); port: None picks a free
    one; startup_timeout: seconds to become healthy (loading a model); deadline: seconds per request (its whole
    answer). Every value is checked here, before anything starts.
    """

    def __init__(self, model, draft=None, k: int = 4, parallel: int = CONCURRENCY, ctx_size: int = 512,
                 threads: int | None = None, port: int | None = None, binary=None, host: str = "127.0.0.1",
                 startup_timeout: float = 300.0, deadline: float = REQUEST_S, extra_args=()):
        check_int("k", k, 1, MAX_K, error=ServerError)
        check_int("parallel", parallel, 1, error=ServerError)
        check_int("ctx_size", ctx_size, 1, error=ServerError)
        if threads is not None:
            check_int("threads", threads, 1, error=ServerError)
        if port is not None:
            check_port(port)
        check_seconds(startup_timeout, "startup_timeout")
        check_seconds(deadline, "deadline")
        self.binary = find_binary(binary)
        for what, path in (("model", model), ("draft model", draft)):
            if path is not None and not Path(path).is_file():
                raise ServerError(f"the server's {what} {path} is not a file")
        self.model, self.draft, self.k, self.parallel = str(model), draft and str(draft), k, parallel
        self.host, self.port = host, port
        self.ctx_size, self.threads, self.extra_args = ctx_size, threads, list(extra_args)
        self.startup_timeout, self.deadline = startup_timeout, deadline
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
        self.client = ServerClient(f"http://{self.host}:{self.port}", self.deadline, alive)
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
                    proc.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None


def _end_with_parent(parent: int):
    """A preexec_fn that has Linux send the child SIGKILL when the process that started it dies (however it
    dies: a kill -9 runs no cleanup of ours; SIGKILL, since a server that ignores SIGTERM would outlive us);
    elsewhere nothing (stop() still ends it on every exit we run)."""
    def arrange() -> None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
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
                          f"stop_type {show(resp.get('stop_type'))})")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ServerError(f"llama-server returned token id {bad}, outside the target's vocabulary [0, {vocab_size})")
    return ids


def _model_meta(client: ServerClient) -> dict:
    models = client.get("/v1/models")
    try:
        return dict(models["data"][0]["meta"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ServerError(f"{client.name}: /v1/models has no data[0].meta (vocabulary size, parameters)") from None


def _top_probs(resp, client: ServerClient, vocab_size: int) -> dict[int, float]:
    """token id -> probability from a /completion answer's completion_probabilities[0].top_logprobs, checked: ids
    in the vocabulary, log-probabilities finite and at most 0 (up to rounding)."""
    try:
        top = resp["completion_probabilities"][0]["top_logprobs"]
        pairs = [(t["id"], t["logprob"]) for t in top]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{client.name}: /completion with n_probs returned no completion_probabilities[0]"
                          ".top_logprobs") from None
    out = {}
    for i, lp in pairs:
        if not is_int(i) or not 0 <= i < vocab_size:
            raise ServerError(f"{client.name}: /completion's top_logprobs holds token id {show(i)}, not an id in "
                              f"the target's vocabulary [0, {vocab_size})")
        if not is_number(lp) or not -math.inf < lp <= 1e-6:
            raise ServerError(f"{client.name}: /completion's top_logprobs gives token {i} the log-probability "
                              f"{show(lp)}, not a finite number <= 0")
        out[i] = math.exp(min(lp, 0.0))
    return out


def check_same_model(client: ServerClient, target, prompt: list[int]) -> dict:
    """The server's model must be the target: vocabulary size, width, parameter count, the text of PIECES token
    ids (when the target has a tokenizer) and the next-token probabilities after `prompt`; ModelMismatchError
    naming the first difference. Returns what was compared, for the report."""
    cfg = target.config
    meta = _model_meta(client)
    info = {"n_vocab": meta.get("n_vocab"), "n_embd": meta.get("n_embd"), "n_params": meta.get("n_params")}
    for key, v in info.items():
        if not is_int(v) or v < 0:
            raise ServerError(f"{client.name}: /v1/models gives {key} {show(v)}, not a count")
    vocab = {cfg.vocab_size, getattr(cfg, "sampled_vocab_size", None) or cfg.vocab_size}
    if meta.get("n_vocab") not in vocab:
        raise ModelMismatchError(f"the server's model has a vocabulary of {meta.get('n_vocab')} tokens, the target "
                                 f"{cfg.vocab_size}: not the same model")
    if meta.get("n_embd") != cfg.dim:
        raise ModelMismatchError(f"the server's model has width {meta.get('n_embd')}, the target {cfg.dim}: "
                                 "not the same model")
    n = target.weight_count()
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
                                     f"token ids read differently (id {i}: {show(theirs)} there, "
                                     f"{show(tok.decode([i]))} here)")
    top = min(20, cfg.vocab_size)
    body = dict(request_body(prompt, 1, SamplingParams(1.0, None, None), 0), n_probs=top, post_sampling_probs=False)
    theirs = _top_probs(client.post("/completion", body), client, cfg.vocab_size)
    diff = info["prob_difference"] = prob_difference(theirs, target, prompt)
    if not diff <= PROB_TOLERANCE:
        raise ModelMismatchError(f"the server's next-token probabilities after the first prompt differ from the "
                                 f"target's by up to {diff:.3g} (> {PROB_TOLERANCE}): not the same weights, or not "
                                 "computed in F32 (serve the target as an F32 GGUF: llama-quantize ... F32)")
    return info


class Endpoint(EndpointBase):
    """A llama-server's native /completion as a Drawing draws from it, reached through `client` (a ServerClient,
    made from url and deadline when None: give the one of a started LlamaServer, so that a crash reads as one)."""

    kind = ENGINE

    def __init__(self, url: str, deadline: float = REQUEST_S, cancel: Cancel | None = None,
                 client: ServerClient | None = None):
        self.client = client or ServerClient(url, deadline=deadline)
        super().__init__(self.client.url, self.client.name, self.client.deadline, cancel)

    @property
    def stated(self) -> dict:
        return {"samplers": SAMPLERS, "ignore_eos": "end-of-generation tokens masked (logit bias -inf)"}

    def body(self, prompt: list[int], tokens: int, params: SamplingParams, seed: int | None) -> dict:
        """request_body; unseeded (mixed_seeds) when seed is None: the server picks one."""
        body = request_body(prompt, tokens, params, 0 if seed is None else seed)
        if seed is None:
            del body["seed"]
        return body

    def sample(self, prompt: list[int], tokens: int, params: SamplingParams, seed: int | None,
               vocab_size: int) -> tuple[list[int], int | None, int | None]:
        resp = self.client.post("/completion", self.body(prompt, tokens, params, seed), cancel=self.cancel)
        return (parse_tokens(resp, tokens, vocab_size), *llama_timings(resp, tokens, self.name, "/completion"))

    def check_model(self, target, prompt: list[int]) -> dict:
        return check_same_model(self.client, target, prompt)


def server_drawing(target, client: ServerClient, prompts: list[list[int]], samples: int, tokens: int,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int = 0,
                   workers: int = CONCURRENCY, model_check: bool = True, settings: dict | None = None,
                   progress: bool = False) -> Drawing:
    """`samples` samples of `tokens` tokens after each prompt from the llama-server behind `client`, as a Drawing
    of its Endpoint that draws them as it is read: `audit_samples(target, drawing)` scores them chunk by chunk
    with the early-stop looks, so a clearly broken server stops being sampled at the first look that fails. Its
    settings line: engine "llama.cpp", the server's build as engine_version, `settings` added, the model check,
    and once drawn "speculation" (the draft tokens drafted and accepted). The arguments are checked and the
    model is checked (unless model_check is False) here, before any sampling. Raises ServerError."""
    params = SamplingParams(temperature, top_k, top_p)
    check_int("samples", samples, 1, error=ServerError)
    check_int("tokens", tokens, 1, error=ServerError)
    check_int("workers", workers, 1, error=ServerError)
    check_int("seed", seed, 0, error=ServerError)
    check_seed_range(seed, samples * len(prompts))  # before the model check, so a run that cannot finish starts nothing
    head = {"engine_version": client.version(), **(settings or {})}
    head["model_check"] = check_same_model(client, target, prompts[0]) if model_check else "skipped"
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=samples * len(prompts), desc=ENGINE, unit="sample", file=sys.stderr, dynamic_ncols=True)
    return Drawing(Endpoint(client.url, client=client), prompts, [samples] * len(prompts), tokens, params, seed,
                   target.config.vocab_size, concurrency=workers, settings=head, bar=bar)


def server_samples(target, client: ServerClient, prompts: list[list[int]], samples: int, tokens: int,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int = 0,
                   workers: int = CONCURRENCY, model_check: bool = True, settings: dict | None = None,
                   progress: bool = False) -> SampleSet:
    """Every sample of `server_drawing` (the same arguments), drawn now: the SampleSet audit_samples tests like a
    samples file. Raises ServerError."""
    return server_drawing(target, client, prompts, samples, tokens, temperature, top_k, top_p, seed, workers,
                          model_check, settings, progress).run().samples
