"""The harness on samples from outside (--samples-file) and from transformers (--engine transformers[-assisted]).

The JSONL route on a tiny random pair: minispec's exact samples pass, each broken sampler's samples fail, prompts
may differ from line to line, and every way a file can be wrong is a one-line error with exit status 2 that
names the line. Then transformers: the pair saved as minispec checkpoints, exported by minispec.hf_export,
sampled by transformers' own generate (plain and assisted), scored by minispec's target; a directory whose
generation_config.json asks for other settings changes nothing (and, used as transformers would by default,
is caught). Every run uses fixed seeds, so every p-value here is deterministic.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minispec import SamplingParams, cli
from minispec.controls import CONTROLS
from minispec.equivalence import (
    EquivalenceInputError,
    SampleSet,
    SamplesFileError,
    audit_samples,
    read_samples,
    run_equivalence,
)
from minispec.equivalence.samples import group

from helpers import equivalence_cli as main  # python -m minispec equivalence ARGV -> exit status

PROMPTS = [[1, 5, 2, 7, 3], [4, 4, 9]]
SETTINGS = {"temperature": 0.7, "top_k": 8, "top_p": None, "new_tokens": 3, "engine": "test", "engine_version": "1"}
N = 300  # samples per prompt: enough for every broken sampler to fail by a wide margin here (see test_broken)
FAST = dict(power_runs=0)  # the power figure has its own tests (test_power.py)


def speculative_samples(pair, sampler: str, n: int = N, seed: int = 0) -> SampleSet:
    """n samples per prompt from minispec's speculate with this sampler, as a samples file would hold them."""
    target, draft = pair
    pairs = []
    for j, prompt in enumerate(PROMPTS):
        r = target.speculate(draft, [prompt] * n, k=3, max_new_tokens=3, temperature=0.7, top_k=8,
                             seed=seed + 10_000 * j, stop_tokens=[], sampler=sampler)
        pairs += [(prompt, t) for t in r.tokens]
    return group(SETTINGS, pairs)


def write_jsonl(path: Path, settings, samples) -> Path:
    lines = [settings if isinstance(settings, str) else json.dumps(settings)]
    lines += [s if isinstance(s, str) else json.dumps(s) for s in samples]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------
# the samples file
# ---------------------------------------------------------------------------

def test_exact_samples_pass_from_a_file(pair, tmp_path):
    target, _ = pair
    s = speculative_samples(pair, "exact")
    s.write(tmp_path / "exact.jsonl")
    r = audit_samples(target, tmp_path / "exact.jsonl", **FAST)
    assert r.passed and r.calibrated, r.format()
    assert r.settings["engine"] == "test" and r.settings["engine_version"] == "1"
    assert r.settings["prompts"] == 2 and r.settings["samples_total"] == 2 * N and r.u["id"].shape == (2 * N, 3)
    assert r.reference.tests["id"][0].n == 2 * N  # the calibration: same prompts, same counts
    assert "samples from test 1" in r.format() and "speculative_samples_per_s" not in r.speed


@pytest.mark.parametrize("sampler", CONTROLS)
def test_broken_samples_fail_from_a_file(pair, tmp_path, sampler):
    # p_holm here: no-residual 3e-9, always-accept 0, unprocessed-q 4e-6, greedy-draft 1e-20 (exact: 1); one-hot-q
    # moves less mass on this pair (8e-4 at 300 per prompt), so it gets 500 (2e-9)
    target, _ = pair
    speculative_samples(pair, sampler, n=500 if sampler == "one-hot-q" else N).write(tmp_path / "broken.jsonl")
    r = audit_samples(target, tmp_path / "broken.jsonl", reference=False, **FAST)
    assert not r.passed and r.speculative.min_adjusted < 1e-4, r.format()


def test_prompts_may_differ_line_by_line(pair, tmp_path):
    # shuffled lines, three prompts with 300, 200 and 1 sample(s): grouped by prompt, scored, calibrated alike
    target, _ = pair
    s = speculative_samples(pair, "exact")
    lines = [{"prompt": p, "tokens": t} for (_, p), t in zip(s.per_sample_prompts(), s.tokens)][:500]
    lines.append({"prompt": [7], "tokens": [1, 2, 3]})
    np.random.default_rng(0).shuffle(lines)
    r = audit_samples(target, write_jsonl(tmp_path / "mixed.jsonl", SETTINGS, lines), **FAST)
    assert r.passed and r.calibrated and r.settings["prompts"] == 3 and r.settings["samples"] is None, r.format()
    assert sorted(r.samples.counts) == [1, 200, 300]


def test_a_sample_set_in_memory_is_checked_like_a_file(pair):
    target, _ = pair
    s = speculative_samples(pair, "exact", n=20)
    s.tokens[3] = s.tokens[3][:2]
    with pytest.raises(SamplesFileError, match="sample 3: 2 new tokens, but the settings say new_tokens=3"):
        audit_samples(target, s)


def test_greedy_samples_are_compared_token_for_token(pair, tmp_path):
    target, draft = pair
    settings = {**SETTINGS, "temperature": 0, "top_k": None}
    good = target.generate(PROMPTS, max_new_tokens=3, temperature=0.0, stop_tokens=[])
    lines = [{"prompt": p, "tokens": t} for p, t in zip(PROMPTS, good)] * 6
    r = audit_samples(target, write_jsonl(tmp_path / "g.jsonl", settings, lines))
    assert r.mode == "greedy" and r.passed, r.format()
    lines[5] = {"prompt": lines[5]["prompt"], "tokens": lines[5]["tokens"][:2] + [(lines[5]["tokens"][2] + 1) % 32]}
    bad = audit_samples(target, write_jsonl(tmp_path / "b.jsonl", settings, lines))
    assert not bad.passed and bad.greedy_mismatches == [(1, 2)], bad.format()


# ---------------------------------------------------------------------------
# the command line: one-line errors, exit status 2, nothing written early
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(pair, tmp_path_factory):
    target, draft = pair
    base = tmp_path_factory.mktemp("engines")
    target.save_pretrained(base / "target")
    draft.save_pretrained(base / "draft")
    return base


GOOD = {"prompt": [1, 2], "tokens": [3, 4, 5]}


@pytest.mark.parametrize("settings,samples,match", [
    ("not json", [GOOD] * 20, r"line 1 is not JSON"),
    ([1, 2], [GOOD] * 20, r"line 1: the first line must be a JSON object"),
    ({k: v for k, v in SETTINGS.items() if k != "top_k"}, [GOOD] * 20, r"line 1: the settings line lacks top_k"),
    ({**SETTINGS, "top_k": -1}, [GOOD] * 20, r"top_k must be an integer >= 1 or null .*vLLM's -1"),
    ({**SETTINGS, "top_p": 1.5}, [GOOD] * 20, r"top_p must be in \(0, 1\] or null"),
    ({**SETTINGS, "temperature": "hot"}, [GOOD] * 20, r"temperature must be a number >= 0"),
    ({**SETTINGS, "new_tokens": 0}, [GOOD] * 20, r"new_tokens must be an integer >= 1"),
    (SETTINGS, [GOOD] * 5 + ["{oops"] + [GOOD] * 20, r"line 7 is not JSON"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [1]}], r"line 22: a sample needs prompt and tokens; this line lacks tokens"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [1, 40], "tokens": [3, 4, 5]}],
     r"line 22: prompt holds token id 40, outside the target's vocabulary \[0, 32\)"),
    (SETTINGS, [GOOD] * 3 + [{"prompt": [1], "tokens": [3, -4, 5]}] + [GOOD] * 20, r"line 5: tokens holds token id -4"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [1], "tokens": [3, 4.5, 5]}], r"tokens must be a list of integer token ids"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [1], "tokens": [3, 4]}],
     r"line 22: 2 new tokens, but the settings say new_tokens=3; sample with stop tokens disabled"),
    (SETTINGS, [GOOD] * 20 + [{**SETTINGS, "temperature": 1.0}],
     r"line 22: mixed settings \(temperature=1.0 here, 0.7 on the settings line\)"),
    (SETTINGS, [GOOD] * 20 + [{**GOOD, "top_k": 50}], r"mixed settings \(top_k=50 here, 8"),
    (SETTINGS, [GOOD] * 9, r"holds 9 sample\(s\); the test needs at least 10"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [1] * 62, "tokens": [3, 4, 5]}],
     r"line 22: prompt \(62 tokens\) \+ 3 new tokens exceeds the target's max_seq_len=64"),
    (SETTINGS, [GOOD] * 20 + [{"prompt": [], "tokens": [3, 4, 5]}], r"line 22: the prompt is empty"),
])
def test_cli_bad_samples_files_exit_2_with_one_line(checkpoints, tmp_path, capsys, settings, samples, match):
    path = write_jsonl(tmp_path / "s.jsonl", settings, samples)
    rc = main(["--target", str(checkpoints / "target"), "--samples-file", str(path), "--plot", str(tmp_path / "u.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert str(path) in err and re.search(match, err), err
    assert not (tmp_path / "u.png").exists()  # nothing written


def test_cli_missing_or_empty_file_exit_2(checkpoints, tmp_path, capsys):
    assert main(["--target", str(checkpoints / "target"), "--samples-file", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read samples file" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert main(["--target", str(checkpoints / "target"), "--samples-file", str(tmp_path / "empty.jsonl")]) == 2
    assert "is empty" in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--temperature", "1.0"], "--temperature do(es) not apply with --samples-file"),
    (["--draft", "prompt-lookup"], "--draft do(es) not apply with --samples-file"),
    (["--engine", "transformers"], "--engine do(es) not apply"),
    (["--tokens", "3", "--prompt", "x"], "--tokens, --prompt do(es) not apply"),
    (["--draft-dtype", "float16"], "--draft-dtype do(es) not apply"),
])
def test_cli_samples_file_rejects_sampling_options(checkpoints, tmp_path, capsys, extra, match):
    path = write_jsonl(tmp_path / "s.jsonl", SETTINGS, [GOOD] * 20)
    assert main(["--target", str(checkpoints / "target"), "--samples-file", str(path)] + extra) == 2
    assert match in capsys.readouterr().err


def test_cli_writes_nothing_when_the_run_cannot_complete(checkpoints, tmp_path, capsys):
    # the tiny checkpoints carry no tokenizer, so a text prompt cannot be encoded: no sampling, no file
    saved = tmp_path / "saved.jsonl"
    rc = main(["--target", str(checkpoints / "target"), "--draft", str(checkpoints / "draft"), "--prompt", "x",
               "--samples", "20", "--save-samples", str(saved), "--plot", str(tmp_path / "u.png")])
    assert rc == 2 and "has no tokenizer" in capsys.readouterr().err
    assert not saved.exists() and not (tmp_path / "u.png").exists() and list(tmp_path.iterdir()) == []


def test_cli_writes_the_samples_it_tested(pair, checkpoints, tmp_path, capsys, monkeypatch):
    # prompts as ids (the tiny checkpoints have no tokenizer): the command line's encoder is replaced by the ids
    monkeypatch.setattr(cli, "_encode_prompts", lambda args, texts, target: PROMPTS)
    saved = tmp_path / "saved.jsonl"
    base = ["--target", str(checkpoints / "target"), "--json", "--power-runs", "0", "--seed", "4"]
    assert main(base + ["--draft", str(checkpoints / "draft"), "--prompt", "ids", "--samples", "200", "--tokens", "3",
                        "--top-k", "8", "--save-samples", str(saved)]) == 0
    first = json.loads(capsys.readouterr().out)
    s = read_samples(saved, 32, 64, 10)
    assert s.settings["engine"] == "minispec" and s.settings["sampler"] == "exact" and s.settings["seed"] == 4
    assert s.counts == [200, 200] and s.prompts == PROMPTS and s.new_tokens == 3
    assert main(base + ["--samples-file", str(saved)]) == 0
    again = json.loads(capsys.readouterr().out)
    # the same samples and the same PIT uniforms: the same table
    assert again["speculative"]["rows"] == first["speculative"]["rows"]
    assert again["settings"]["engine_settings"]["k"] == 4


def test_cli_engine_option_combinations_exit_2(checkpoints, capsys):
    base = ["--target", str(checkpoints / "target"), "--prompt", "x"]
    assert main(base) == 2 and "needs --draft" in capsys.readouterr().err
    assert main(base + ["--engine", "transformers-assisted"]) == 2 and "--hf-draft" in capsys.readouterr().err
    assert main(base + ["--engine", "transformers", "--draft", str(checkpoints / "draft")]) == 2
    assert "samples the target alone" in capsys.readouterr().err
    assert main(base + ["--engine", "transformers", "--sampler", "no-residual"]) == 2
    assert "minispec negative control" in capsys.readouterr().err
    assert main(base + ["--engine", "transformers-assisted", "--draft", "prompt-lookup"]) == 2
    assert "prompt-lookup is minispec's own drafter" in capsys.readouterr().err
    assert main(base + ["--engine", "transformers-assisted", "--draft", str(checkpoints / "draft"),
                        "--draft-dtype", "int4"]) == 2
    assert "--draft-dtype is minispec's" in capsys.readouterr().err
    assert main(base + ["--draft", str(checkpoints / "draft"), "--save-samples", "/no/such/folder/s.jsonl"]) == 2
    assert "folder /no/such/folder does not exist" in capsys.readouterr().err


def test_missing_transformers_is_a_one_line_error(pair, monkeypatch, tmp_path):
    target, _ = pair
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(EquivalenceInputError, match=r"pip install 'transformers>=4.45'"):
        run_equivalence(target, None, PROMPTS[0], samples=10, engine="transformers", hf_dirs={"target": tmp_path})


def test_the_library_imports_transformers_only_in_the_engine():
    # a fresh interpreter: importing minispec and running the harness's imports never loads transformers
    code = ("import sys, minispec, minispec.cli, minispec.equivalence; "
            "sys.exit(1 if 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0


# ---------------------------------------------------------------------------
# transformers, on the pair exported by minispec.hf_export
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(checkpoints):
    pytest.importorskip("transformers")
    from minispec.hf_export import export_hf

    for name in ("target", "draft"):
        export_hf(checkpoints / name, checkpoints / f"hf-{name}", progress=False)
    return {"target": str(checkpoints / "hf-target"), "draft": str(checkpoints / "hf-draft")}


TF = dict(samples=200, tokens=4, top_k=None, batch_size=200, power_runs=0)  # top_k off: transformers' default is 50


def test_transformers_plain_sampling_passes(pair, hf_dirs):
    import transformers

    target, _ = pair
    r = run_equivalence(target, None, PROMPTS[0], engine="transformers", hf_dirs=hf_dirs, **TF)
    assert r.passed and r.calibrated, r.format()
    assert r.settings["engine_version"] == transformers.__version__ and r.settings["hf_logit_difference"] < 1e-4
    assert r.samples.settings["engine"] == "transformers"


@pytest.mark.slow
def test_transformers_assisted_sampling_passes(pair, hf_dirs):
    # slow: assisted generation takes a batch of one per call
    target, draft = pair
    r = run_equivalence(target, None, PROMPTS[0], engine="transformers-assisted", hf_dirs=hf_dirs, k=3, **TF)
    assert r.passed and r.calibrated, r.format()
    assert r.settings["assistant"]["num_assistant_tokens"] == 3
    # the same test at the same size has power: minispec's greedy-draft (transformers 4.41-4.44's bug) fails it
    bad = run_equivalence(target, draft, PROMPTS[0], k=3, sampler="greedy-draft", reference=False,
                          **{**TF, "batch_size": 100})
    assert not bad.passed, bad.format()


@pytest.fixture
def poisoned(hf_dirs, tmp_path):
    """The exported target with a generation_config.json asking for other settings (and eos 2, which the tiny
    target gives real mass)."""
    import shutil

    dst = tmp_path / "poisoned"
    shutil.copytree(hf_dirs["target"], dst)
    (dst / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.2, "top_k": 3, "repetition_penalty": 1.5, "eos_token_id": 2,
         "bos_token_id": 1, "no_repeat_ngram_size": 2}))
    return {**hf_dirs, "target": str(dst)}


def test_a_checkpoints_generation_config_changes_nothing(pair, poisoned):
    target, _ = pair
    r = run_equivalence(target, None, PROMPTS[0], engine="transformers", hf_dirs=poisoned, **TF)
    assert r.passed, r.format()


def test_the_generation_config_would_be_caught_if_it_leaked(pair, poisoned):
    # the negative control of the test above: sampling with the directory's settings merged in, as
    # transformers does by default, is rejected by the same test
    import transformers

    target, _ = pair
    model = transformers.AutoModelForCausalLM.from_pretrained(poisoned["target"]).float().eval()
    x = torch.tensor([PROMPTS[0]] * 200)
    torch.manual_seed(0)
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=0.7, max_new_tokens=4,
                         min_new_tokens=4, pad_token_id=0)
    s = group({**SETTINGS, "top_k": None, "new_tokens": 4}, [(PROMPTS[0], t) for t in out[:, 5:].tolist()])
    r = audit_samples(target, s, reference=False, **FAST)
    assert not r.passed, r.format()


def test_transformers_applies_exactly_the_stated_processors(poisoned):
    # what generate() builds from the engine's config, even over the poisoned directory: the stated settings and
    # nothing else (no top_k=50 default when top_k is off, no repetition penalty, no eos masking). This reads
    # transformers' private preparation steps; a version without them skips, the PIT tests still cover it.
    transformers = pytest.importorskip("transformers")
    from minispec.equivalence.engines import generation_config, load_hf

    model = load_hf(transformers, poisoned["target"])
    if not all(hasattr(model, f) for f in ("_prepare_generation_config", "_prepare_special_tokens",
                                           "_get_logits_processor")):
        pytest.skip(f"transformers {transformers.__version__} prepares generation differently")
    for params, expect in [(SamplingParams(0.7), ["TemperatureLogitsWarper"]),
                           (SamplingParams(1.0), []),
                           (SamplingParams(0.5, 5, 0.9), ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                          "TopPLogitsWarper"])]:
        gc = generation_config(transformers, params, 4)
        model.generation_config = gc
        prepared, _ = model._prepare_generation_config(gc)
        model._prepare_special_tokens(prepared, device="cpu")
        procs = model._get_logits_processor(prepared, input_ids_seq_length=5, device="cpu")
        assert [type(p).__name__ for p in procs] == expect, params
        assert prepared.eos_token_id is None and prepared.do_sample


def test_transformers_target_must_be_the_target(pair, hf_dirs):
    _, draft = pair  # scoring with the draft while transformers samples the target: refused before sampling
    with pytest.raises(EquivalenceInputError, match="is not the --target model"):
        run_equivalence(draft, None, PROMPTS[0], engine="transformers", hf_dirs=hf_dirs, **TF)


@pytest.mark.slow
def test_cli_transformers_assisted_exports_the_pair(pair, checkpoints, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(cli, "_encode_prompts", lambda args, texts, target: PROMPTS[:1])
    saved = tmp_path / "tf.jsonl"
    rc = main(["--target", str(checkpoints / "target"), "--draft", str(checkpoints / "draft"), "--prompt", "ids",
               "--engine", "transformers-assisted", "--samples", "100", "--tokens", "3", "--top-k", "0", "--k", "2",
               "--json", "--power-runs", "0", "--save-samples", str(saved)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"] and out["settings"]["engine"] == "transformers-assisted"
    s = read_samples(saved, 32, 64, 10)
    assert s.settings["engine"] == "transformers-assisted" and s.settings["assistant"]["num_assistant_tokens"] == 2
