"""Which engine draws the samples, with which options, and the audit that follows: the engine dispatch of
`python -m minispec equivalence`, which the command line (minispec.cli) parses and hands here.

    check_options(args)                            # before any model loads: one line (OptionError) if wrong
    report = run(args, target, prompts, test)      # an engine with the target: its samples through the PIT
    report = two_sample(args, prompts)             # a server engine without it: beside reference samples

The engines: minispec's `speculate` and transformers' (run_equivalence drives them), llama.cpp's llama-server
(started here from --server-model, or one at --url), and deployed servers by protocol (openai, sglang: at --url).
`OPTIONS` is the one table of which options each engine takes; an option given to an engine that does not take it
is refused in one line, before any model loads or any server starts. Every server started here stops however the
run ends (success, error, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..draft_loader import load_draft
from ..drafters import PROMPT_LOOKUP
from ..errors import MAX_SEED, GenerationError
from ..sampling import SamplingParams
from .drawing import SERVER_MAX_SEED, Drawing
from .engines import ENGINES as LOCAL
from .engines import exported
from .harness import DEFAULTS, audit_samples, check_window, run_equivalence
from .llama_server import CONCURRENCY as LLAMA_CPP_CONCURRENCY
from .llama_server import ENGINE as LLAMA_CPP
from .llama_server import MAX_K, LlamaServer, ServerClient, context_size, server_drawing
from .openai import KINDS as REMOTE_KINDS
from .openai import Endpoint
from .samples import EquivalenceInputError
from .two_sample import audit as two_sample_audit

SERVERS = (LLAMA_CPP, *REMOTE_KINDS)
ENGINES = (*LOCAL, *SERVERS)  # the command line's --engine names
# the largest seed each engine takes: minispec's and transformers' generators take 64-bit seeds, llama.cpp 32-bit
MAX_SEEDS = {**{e: MAX_SEED for e in LOCAL}, **{e: SERVER_MAX_SEED for e in SERVERS}}
_SERVER_HOME = f"the server engines ({', '.join(SERVERS)})"
_LLAMA_HOME = f"--engine {LLAMA_CPP}"

# Which options each engine takes: option -> (its attribute, the engines that take it, where the minispec and
# transformers engines' refusal sends it). check_options refuses an option given to an engine not listed; each
# engine then checks the values it takes (a model draft for transformers, --k a number for llama.cpp, ...).
OPTIONS = {
    "--server-model": ("server_model", (LLAMA_CPP,), _LLAMA_HOME),
    "--server-draft": ("server_draft", (LLAMA_CPP,), _LLAMA_HOME),
    "--url": ("url", SERVERS, _LLAMA_HOME),
    "--server-threads": ("server_threads", (LLAMA_CPP,), _LLAMA_HOME),
    "--no-model-check": ("no_model_check", SERVERS, _LLAMA_HOME),
    "--draft": ("draft", LOCAL, None),
    "--hf-target": ("hf_target", LOCAL, None),
    "--hf-draft": ("hf_draft", LOCAL, None),
    "--draft-dtype": ("draft_dtype", LOCAL, None),
    "--sampler": ("sampler", LOCAL, None),  # a value other than exact
    "--model": ("model", ("openai",), "--engine openai"),
    "--reference-url": ("reference_url", SERVERS, _SERVER_HOME),
    "--concurrency": ("concurrency", SERVERS, _SERVER_HOME),
    "--mixed-seeds": ("mixed_seeds", SERVERS, _SERVER_HOME),
}
# the sampling options a samples file states itself (--samples-file refuses them); argparse defaults are None
# so that an option given can be told from one left at its default (DEFAULTS fills those in)
SAMPLING_OPTIONS = {"samples": "--samples", "tokens": "--tokens", "temperature": "--temperature", "top_k": "--top-k",
                    "top_p": "--top-p", "k": "--k", "sampler": "--sampler"}


class OptionError(EquivalenceInputError):
    """An option the engine does not take, or a combination of options that cannot run: one line, exit status 2."""


def _given(args, attr: str) -> bool:
    v = getattr(args, attr)
    return v is not None and v is not False and not (attr == "sampler" and v == "exact")


def _refused(args, engine: str, home: str | None = None) -> list[str]:
    """The options given that `engine` does not take (--model apart: every engine words it alike), in OPTIONS' order;
    with `home`, only those the refusal sends there."""
    return [flag for flag, (attr, engines, where) in OPTIONS.items() if flag != "--model" and engine not in engines
            and _given(args, attr) and home in (None, where)]


def check_options(args) -> None:
    """The combinations argparse cannot check alone, before any model loads: OptionError naming what is wrong.
    Fills in the sampling defaults."""
    if args.samples_file is not None:
        return _check_samples_file(args)
    _check_tree(args)
    for name in SAMPLING_OPTIONS:
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[name])
    _check_reference(args)
    if args.seed > MAX_SEEDS[args.engine]:
        raise OptionError(f"--seed {args.seed} is more than {MAX_SEEDS[args.engine]}, the largest seed --engine "
                          f"{args.engine} takes")
    if args.engine in REMOTE_KINDS:
        return _check_remote(args)
    if args.model is not None:
        raise OptionError("--model goes with --engine openai")
    if args.engine == LLAMA_CPP:
        return _check_llama_cpp(args)
    _check_local(args)


def _check_samples_file(args) -> None:
    """--samples-file: the target to score under, and none of the options the file's first line states or that
    draw samples."""
    if args.target is None:
        raise OptionError("--samples-file needs --target DIR: the samples are scored under the target")
    given = [flag for name, flag in SAMPLING_OPTIONS.items() if getattr(args, name) is not None]
    given += [flag for flag, (attr, _, _) in OPTIONS.items() if attr not in SAMPLING_OPTIONS and _given(args, attr)]
    given += [flag for flag, v in (("--prompt-ids", args.prompt_ids), ("--prompt", args.prompt),
                                  ("--prompts", args.prompts), ("--save-samples", args.save_samples))
              if v is not None]
    if args.engine != "minispec":
        given.append("--engine")
    if args.tree is not None:
        given.append("--tree")
    if given:
        raise OptionError(f"{', '.join(given)} do(es) not apply with --samples-file: the file's first line states "
                          "the settings and its samples are already drawn")


def _check_tree(args) -> None:
    if args.tree is not None:
        if args.engine != "minispec":
            raise OptionError(f"--tree is minispec's token tree (--engine minispec); --engine {args.engine} drafts "
                              "chains")
        if args.k is not None:
            raise OptionError("give --k (a chain of drafts) or --tree (a tree of them), not both")
        if args.draft == PROMPT_LOOKUP:
            raise OptionError("--tree needs a model draft (--draft DIR): prompt lookup drafts no tree")


def _check_reference(args) -> None:
    """Without --target: a server engine, sampling above temperature 0, a reference deployment and prompts as ids;
    with it, no --reference-url."""
    if args.target is None:
        if args.engine not in SERVERS:
            raise OptionError(f"--engine {args.engine} needs --target DIR (only a server engine can be audited "
                              "without the target's weights, by the two-sample test)")
        if args.temperature == 0:
            raise OptionError("without --target, --temperature 0 cannot be audited: greedy runs are compared with the "
                              "target's greedy decoding")
        if args.reference_url is None and not (args.engine == LLAMA_CPP and args.server_model is not None):
            raise OptionError("without --target the audit compares with reference samples drawn with speculation off: "
                              "give --reference-url URL (a deployment of the same model without a draft)")
        if args.prompt is not None or args.prompts is not None:
            raise OptionError("without --target there is no tokenizer: give the prompts as --prompt-ids 1,2,3")
    elif args.reference_url is not None:
        raise OptionError("--reference-url is the two-sample audit's reference; with --target the target itself is "
                          "the reference")


def _check_local(args) -> None:
    """--engine minispec or a transformers engine: no server option, and the draft each one needs."""
    for home in (_SERVER_HOME, _LLAMA_HOME):
        if refused := _refused(args, args.engine, home):
            raise OptionError(f"{', '.join(refused)} go(es) with {home}")
    if args.engine == "minispec" and args.draft is None:
        raise OptionError("--engine minispec needs --draft DIR|prompt-lookup (or give --samples-file)")
    if args.engine != "minispec":
        if args.draft == PROMPT_LOOKUP:
            raise OptionError(f"--engine {args.engine} loads a model draft with transformers: prompt-lookup is "
                              "minispec's own drafter")
        if args.sampler != "exact":
            raise OptionError(f"--sampler {args.sampler} is a minispec negative control; --engine {args.engine} "
                              "samples with transformers' own code")
        if args.draft_dtype is not None:
            raise OptionError(f"--draft-dtype is minispec's; --engine {args.engine} loads the draft with transformers")
        if args.engine == "transformers-assisted" and args.draft is None and args.hf_draft is None:
            raise OptionError("--engine transformers-assisted needs --draft DIR (exported) or --hf-draft DIR")
        if args.engine == "transformers" and (args.draft is not None or args.hf_draft is not None):
            raise OptionError("--engine transformers samples the target alone: --draft/--hf-draft do not apply")


def _check_llama_cpp(args) -> None:
    """--engine llama.cpp: a server to start (--server-model) or one running (--url), and minispec's options out."""
    if (args.server_model is None) == (args.url is None):
        raise OptionError(f"--engine {LLAMA_CPP} needs --server-model FILE.gguf (a server started here) or --url URL "
                          "(one already running), not both")
    if args.url is not None and (args.server_draft is not None or args.server_threads is not None):
        raise OptionError("--server-draft and --server-threads start a server; a server at --url runs with its own "
                          "settings")
    for path in (args.server_model, args.server_draft):
        if path is not None and not Path(path).is_file():
            raise OptionError(f"{path} is not a file (--server-model / --server-draft take GGUF files)")
    if refused := _refused(args, LLAMA_CPP):
        raise OptionError(f"{', '.join(refused)} do(es) not apply with --engine {LLAMA_CPP}: the server samples with "
                          "its own code (its draft: --server-draft)")
    if not isinstance(args.k, int):
        raise OptionError(f"--engine {LLAMA_CPP} takes a number for --k (the server's maximum draft length)")
    if args.k > MAX_K:
        raise OptionError(f"--k {args.k} is more than {MAX_K}, the longest draft llama-server is asked for (each "
                          "slot's context holds a round of drafts)")
    if args.mixed_seeds and args.target is not None:
        raise OptionError(f"--mixed-seeds with --target: audit the llama-server as --engine openai --url URL/v1 "
                          f"(the {LLAMA_CPP} engine seeds every request)")


def _check_remote(args) -> None:
    """--engine openai / sglang: a server at --url, nothing started; minispec's own options out."""
    if args.url is None:
        raise OptionError(f"--engine {args.engine} needs --url (BASE ending in /v1 for openai, the server's root for "
                          "sglang)")
    if refused := _refused(args, args.engine):
        raise OptionError(f"{', '.join(refused)} do(es) not apply with --engine {args.engine}: the server at --url "
                          "samples with its own code and settings")
    if args.model is not None and args.engine != "openai":
        raise OptionError("--model goes with --engine openai (SGLang's /generate serves one model)")


# ---- the audits

def run(args, target, prompts: list[list[int]], test: dict, device):
    """The report of --engine's samples after `prompts` under the target: run_equivalence for an engine minispec
    drives, audit_samples for a server's samples, drawn as they are scored (a failed early-stop look ends the
    sampling). test: the harness's test settings (seed, alpha, bins, ...)."""
    if args.engine in SERVERS:
        check_window(target, prompts, args.tokens)  # before any server starts
        if args.engine == LLAMA_CPP:
            return _server_audit(args, target, prompts, test)
        with contextlib.ExitStack() as stack:
            return audit_samples(target, _remote(args, target, prompts, stack)[0], **test)
    sampling = dict(samples=args.samples, tokens=args.tokens, k=args.k, temperature=args.temperature,
                    top_k=args.top_k or None, top_p=args.top_p, sampler=args.sampler, engine=args.engine,
                    **({} if args.tree is None else {"tree": args.tree}))
    if args.engine == "minispec":
        try:
            draft = (args.draft if args.draft == PROMPT_LOOKUP
                     else load_draft(args.draft, target, args.draft_dtype, device))
        except GenerationError as e:  # a draft made for another target is a bad pair of arguments
            raise EquivalenceInputError(str(e)) from None
        return run_equivalence(target, draft, prompts, **sampling, **test)
    with exported({"target": args.hf_target or args.target, "draft": args.hf_draft or args.draft}) as hf_dirs:
        return run_equivalence(target, None, prompts, hf_dirs=hf_dirs, **sampling, **test)


def two_sample(args, prompts: list[list[int]]):
    """A server engine audited without the target: its samples beside reference samples drawn with speculation off
    (--reference-url, or a plain llama-server started beside --server-model), through the two-sample test."""
    with contextlib.ExitStack() as stack:
        return _remote(args, None, prompts, stack)[1]


def _server_audit(args, target, prompts: list[list[int]], test: dict):
    """llama-server's samples through its native API, audited as they are drawn: a server started for the run
    (stopped however it ends), or one at --url."""
    kw = dict(samples=args.samples, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k or None,
              top_p=args.top_p, seed=args.seed, model_check=not args.no_model_check, progress=True,
              workers=args.concurrency or LLAMA_CPP_CONCURRENCY)
    if args.url is not None:
        return audit_samples(target, server_drawing(target, ServerClient(args.url, deadline=args.request_timeout),
                                                    prompts, **kw), **test)
    with _llama_server(args, prompts, args.concurrency or LLAMA_CPP_CONCURRENCY) as server:
        drawing = server_drawing(target, server.client, prompts, settings=server.settings, **kw)
        return audit_samples(target, drawing, **test)


def _llama_server(args, prompts: list[list[int]], parallel: int, reference: bool = False) -> LlamaServer:
    """The llama-server of --server-model (and --server-draft) as the options ask, or the reference beside it (the
    same model, plain: speculation off), its context the one the run's prompts and tokens take with --server-draft's
    k drafted."""
    ctx = context_size(prompts, args.tokens, args.k if args.server_draft is not None else 0)
    speculation = {} if reference else {"draft": args.server_draft, "k": args.k}
    return LlamaServer(args.server_model, **speculation, threads=args.server_threads, ctx_size=ctx,
                       parallel=parallel, deadline=args.request_timeout)


def _urls(args, prompts: list[list[int]], concurrency: int, stack: contextlib.ExitStack) -> tuple[str, str | None]:
    """The OpenAI-compatible addresses of the server under test and of the reference (None: none given), with the
    llama-servers --server-model asks for started on `stack` (the one with --server-draft, and a plain one as the
    reference when no --reference-url is given)."""
    if args.engine != LLAMA_CPP:
        return args.url, args.reference_url
    if args.server_model is None:
        return args.url + "/v1", args.reference_url and args.reference_url + "/v1"
    started = stack.enter_context(_llama_server(args, prompts, concurrency))
    if args.reference_url is not None:
        return started.client.url + "/v1", args.reference_url + "/v1"
    plain = stack.enter_context(_llama_server(args, prompts, concurrency, reference=True))
    return started.client.url + "/v1", plain.client.url + "/v1"


def _remote(args, target, prompts: list[list[int]], stack: contextlib.ExitStack):
    """(the Drawing under test, the two-sample report or None) of a server engine by protocol: with the target, the
    drawing alone, for audit_samples to draw as it scores; without it, drawn here beside reference samples drawn
    with speculation off. The llama-servers started for it stop with `stack`."""
    from tqdm import tqdm

    params = SamplingParams(args.temperature, args.top_k or None, args.top_p)
    vocab = target.config.vocab_size if target is not None else 2**31 - 1
    concurrency = args.concurrency or (LLAMA_CPP_CONCURRENCY if args.engine == LLAMA_CPP else 1)
    n = args.samples * len(prompts)

    def arm(endpoint, seed, desc):
        bar = tqdm(total=n, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True)
        return Drawing(endpoint, prompts, [args.samples] * len(prompts), args.tokens, params, seed, vocab,
                       concurrency=concurrency, mixed_seeds=args.mixed_seeds, bar=bar)

    test_url, ref_url = _urls(args, prompts, concurrency, stack)
    kind = "sglang" if args.engine == "sglang" else "openai"
    endpoint = Endpoint(test_url, kind, model=args.model, deadline=args.request_timeout)
    check = "skipped"
    if target is not None and not args.no_model_check:
        check = endpoint.check_model(target, prompts[0])  # before any sampling
    drawing = arm(endpoint, args.seed, args.engine)
    drawing.settings["model_check"] = check
    if target is not None:
        return drawing, None
    # the reference's seeds follow the test's, so no seed is used twice; both drawn in step, with early looks
    reference = arm(Endpoint(ref_url, kind, model=args.model, deadline=args.request_timeout), args.seed + n,
                    "reference")
    return drawing, two_sample_audit(drawing, reference, args.batch_size, alpha=args.alpha, seed=args.seed,
                                     power_runs=args.power_runs,
                                     names=(f"{args.engine} at {test_url}", f"speculation off at {ref_url}"))
