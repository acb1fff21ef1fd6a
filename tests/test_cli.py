"""The command line (python -m minispec) and a smoke run of tools/bench.py on SmolLM2-135M-Instruct."""

from __future__ import annotations

import re

import pytest
import torch

from minispec.cli import main

from helpers import SMOL_DRAFT, require_smollm2


@pytest.fixture(scope="module")
def smol_dirs():
    smol = require_smollm2()
    torch.set_num_threads(1)
    return str(smol), str(SMOL_DRAFT)


def test_generate_plain_and_speculative_agree(smol_dirs, capsys):
    target, draft = smol_dirs
    args = ["generate", "--target", target, "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "12"]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert re.search(r"\b([1-9]|1[0-2]) tokens in [0-9.]+ s", plain.err)  # at most 12: eos may come first
    assert main(args + ["--draft", draft]) == 0  # greedy: speculation changes the speed, never the text
    spec = capsys.readouterr()
    assert spec.out == plain.out and spec.out.strip()
    assert "speculation k=auto (mean" in spec.err
    assert main(args + ["--draft", "prompt-lookup", "--k", "3"]) == 0
    lookup = capsys.readouterr()
    assert lookup.out == plain.out and "speculation k=3" in lookup.err
    assert main(args + ["--draft", draft, "--draft-dtype", "float16"]) == 0  # the draft's precision is free
    half = capsys.readouterr()
    assert half.out == plain.out and "speculation k=auto (mean" in half.err
    assert main(args + ["--draft", draft, "--draft-dtype", "int4", "--k", "4"]) == 0  # and so is its form
    int4 = capsys.readouterr()
    assert int4.out == plain.out and "speculation k=4" in int4.err


@pytest.mark.parametrize("extra, match", [
    (["--k", "0"], "--k"),
    (["--temperature", "-1"], "--temperature"),
    (["--draft", "/nonexistent"], "not a minispec checkpoint"),
])
def test_generate_bad_arguments_exit_2(smol_dirs, capsys, extra, match):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", smol_dirs[0], "--prompt", "Hi", *extra])
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.slow
def test_bench_spec_smoke(smol_dirs, tmp_path):
    """tools/bench.py spec end to end at a tiny size: every contender runs and lands in the table (two of the
    bench prompts: every contender runs once a prompt, and two still exercise the merge over prompts)."""
    import bench

    texts = bench.BENCH_PROMPTS[:2]
    res = bench.bench_spec(*smol_dirs, new_tokens=6, repeats=1, threads=1, ks=(2,), batch_sizes=(1, 2),
                           plot=str(tmp_path / "spec.png"), quick=True, texts=texts)
    engines = {(r["engine"], r["batch"], r["k"], r["temperature"]) for r in res["rows"]}
    assert ("minispec target-only", 1, None, 0.0) in engines and ("minispec speculate", 1, "auto", 0.7) in engines
    assert ("transformers assisted generation", 1, "hf", 0.0) in engines
    assert ("minispec speculate", 2, "auto", 0.0) in engines
    assert {r["phase"] for r in res["rows"] if r["engine"].startswith("transformers")} == {2}  # a phase of its own
    assert all(r["tok_s"] > 0 for r in res["rows"])
    assert res["cost_samples"] == len(texts)  # the step costs: one probe after every prompt's rows
    spec2 = next(r for r in res["rows"]
                 if r["engine"] == "minispec speculate" and r["k"] == 2 and r["temperature"] == 0)
    assert 1.0 <= spec2["measured_per_round"] <= 3.0 and spec2["predicted_per_round"] >= 1.0
    table = bench.spec_table(res)
    assert table.count("\n|") >= len(res["rows"]) and "Resident memory" in table
    assert (tmp_path / "spec.png").stat().st_size > 0


def test_bench_merges_stats_over_prompts():
    """The spec table's acceptance and tokens per round cover every bench prompt, not the last one."""
    from minispec.speculative import SpeculativeStats
    from minispec.tree import chain

    import bench

    a, b = SpeculativeStats(), SpeculativeStats()
    a.record_row(chain(4), 4, 5), a.record_row(chain(4), 1, 2)
    a.rounds, a.k_chosen = 2, [4, 4]
    b.record_row(chain(2), 0, 1)
    b.rounds, b.k_chosen = 1, [2]
    m = bench.merge_stats([a, None, b])
    assert (m.drafted, m.accepted, m.committed, m.rounds, m.sequence_rounds) == (10, 5, 8, 3, 3)
    assert m.acceptance_rate == 0.5 and m.mean_accepted == 8 / 3 and m.k_chosen == [4, 4, 2]
    assert m.position_drafted == [3, 3, 2, 2] and m.position_accepted == [2, 1, 1, 1]
    assert bench.merge_stats([None]) is None


def test_bench_cost_model_arithmetic(monkeypatch):
    """The cost model on hand-worked figures: target-only's measured time per token over the modelled one."""
    from minispec import speculative

    import bench

    res = {"new_tokens": 10, "target_step_ms": 100.0, "draft_cost_ratio": 0.1, "draft2_cost_ratio": 0.2,
           "prefill_cost": {"target": 2.0, "draft": 1.0}, "verify_cost": {0: 1.0, 1: 1.3, 2: 1.4},
           "trunk_cost": {0: 0.8, 1: 1.0, 2: 1.1},
           "rows": [{"engine": "minispec target-only", "batch": 1, "k": None, "temperature": t, "tok_s": 5.0}
                    for t in (0.0, 0.7)]}
    spec = [{"engine": "minispec speculate", "batch": 1, "k": 2, "temperature": t, "tok_s": 9.0,
             "acceptance": 0.75, "measured_per_round": 2.5, "survival": [1.0, 0.5]} for t in (0.0, 0.7)]
    res["rows"] += spec
    # 1 + S_1 + S_2 = 2.5 tokens a round; a round: the verify pass, 1 draft step, the first over 2 tokens half
    # the time: 1.4 + 0.1 + 0.5 * 0.2 + 0.5 * 0.1 = 1.65 steps; a call: (2 + 1 + 10 / 2.5 * 1.65) steps over
    # 10 tokens at 0.1 s a step = 0.096 s a token, against target-only's 0.2
    assert bench.predicted_speedup(res, spec[1]) == pytest.approx(0.2 / 0.096)  # T=0.7: all k+1 logits, 1.4
    assert bench.predicted_speedup(res, spec[0]) == pytest.approx(0.2 / 0.096)  # greedy: trunk 1.1 + head 0.3
    monkeypatch.setattr(speculative, "GREEDY_HEAD_CHUNK", 2)  # 2 positions, then the third if both accepted:
    # 1.1 + 1.0 * (1.3 - 1.0) + 0.5 * (1.0 - 0.8) = 1.5 steps of verify, 1.75 a round, 0.1 s a token
    assert bench.predicted_speedup(res, spec[0]) == pytest.approx(0.2 / 0.1)
    assert bench.predicted_speedup(res, {**spec[0], "engine": "minispec speculate prompt-lookup"}) is None


def test_bench_greedy_check_smoke(smol_dirs):
    """tools/bench.py greedy: speculate against generate per prompt, the verdict and where they part."""
    import bench

    res = bench.greedy_check(*smol_dirs, texts=["Name a colour.", "Count to three."], new_tokens=6, threads=1)
    assert res["equal"] and [r["first_difference"] for r in res["rows"]] == [None, None]
