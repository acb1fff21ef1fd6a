"""The command line with token trees: `generate --tree` and `equivalence --tree`, their checks (exit status 2, one
line, no traceback) and the tree reaching speculate through the harness, on tiny checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_main
from tiny_files import tiny_checkpoint, tiny_tokenizer_dir


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, and a second one (another seed) as its draft."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tree_cli")
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_checkpoint(root / name, seed=seed, eos_id=2)
        tiny_tokenizer_dir(root / name)
    return {name: str(root / name) for name in ("target", "draft")}


def generate(ckpt, *extra):
    return run_main(["generate", "--target", ckpt["target"], "--prompt", "a b c", "--max-new-tokens", "10", *extra])


def test_generate_with_a_tree_gives_greedy_generation(ckpt, capsys):
    assert generate(ckpt) == 0
    plain = capsys.readouterr()
    for tree, shown in (("2,2,2", "speculation tree=2,2,2:"), ("3", "speculation tree=3:"), ("3x3", "tree=3x3:"),
                        ("auto", "speculation tree=auto (most chosen ")):
        assert generate(ckpt, "--draft", ckpt["draft"], "--tree", tree) == 0
        out = capsys.readouterr()
        assert out.out == plain.out and shown in out.err, out.err
    assert generate(ckpt, "--draft", ckpt["draft"], "--tree", "2,2", "--temperature", "1", "--seed", "3") == 0
    assert "speculation tree=2,2:" in capsys.readouterr().err


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("extra, match", [
    (["--draft", "DRAFT", "--tree", "2,2", "--k", "3"], "not both"),
    (["--draft", "DRAFT", "--tree", "auto", "--k", "auto"], "not both"),
    (["--draft", "prompt-lookup", "--tree", "2,2"], "needs a model draft"),
    (["--tree", "2,2"], "needs a model draft"),
])
def test_generate_tree_usage_errors_exit_2(ckpt, capsys, extra, match):
    assert generate(ckpt, *(ckpt["draft"] if a == "DRAFT" else a for a in extra)) == 2
    assert match in _one_line_error(capsys)


@pytest.mark.parametrize("value, match", [
    ("0", "'0' is not a tree"), ("2,0", "integer >= 1"), ("2,x", "'2,x' is not a tree"), ("", "is not a tree"),
    ("2,,2", "is not a tree"), ("-1", "is not a tree"), ("16,16,16", "more than 256"), ("1.5", "is not a tree"),
    ("4x", "'4x' is not a tree"), ("0x4", "width >= 1"), ("20x20", "more than 256"), ("2x2x2", "is not a tree"),
])
def test_bad_trees_are_argparse_errors(ckpt, capsys, value, match):
    assert generate(ckpt, "--draft", ckpt["draft"], f"--tree={value}") == 2
    err = capsys.readouterr().err
    assert "argument --tree" in err and match in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("python -m minispec generate: error: argument --tree")


def equivalence(ckpt, *extra):
    return run_main(["equivalence", "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt", "a b",
                     "--samples", "64", "--tokens", "3", "--power-runs", "0", "--json", *extra])


def test_equivalence_with_a_tree(ckpt, capsys):
    assert equivalence(ckpt, "--tree", "2,2") == 0
    report = json.loads(capsys.readouterr().out)
    s = report["settings"]
    assert report["passed"] and s["tree"] == [2, 2] and s["k"] is None and "tree=2,2" in s["under_test"]
    # 64 samples of 3 tokens drew trees of 6 nodes: more drafts than tokens, which a chain of k = 4 cannot
    assert report["drafted"] > 64 * 3 * 1.5
    assert equivalence(ckpt, "--tree", "auto") == 0
    assert json.loads(capsys.readouterr().out)["settings"]["tree"] == "auto"
    assert equivalence(ckpt, "--tree", "3x2") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["settings"]["tree"] == "3x2" and "tree=3x2" in report["settings"]["under_test"]


def test_equivalence_notes_a_control_that_the_round_does_not_take(ckpt, capsys):
    equivalence(ckpt, "--sampler", "tree-independent")
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("tree-independent breaks a tree round only" in n for n in notes), notes
    equivalence(ckpt, "--sampler", "no-residual", "--tree", "2,2")
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("a tree round does not take" in n for n in notes), notes
    equivalence(ckpt, "--sampler", "target-at-t1", "--tree", "2,2")  # a tree round takes the target's p
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert not any("does not take" in n or "tree round only" in n for n in notes), notes


@pytest.mark.parametrize("extra, match", [
    (["--tree", "2,2", "--k", "4"], "not both"),
    (["--tree", "2,2", "--engine", "transformers"], "drafts chains"),
    (["--tree", "2,2", "--draft", "prompt-lookup"], "needs a model draft"),
])
def test_equivalence_tree_usage_errors_exit_2(ckpt, capsys, extra, match):
    assert equivalence(ckpt, *extra) == 2
    assert match in _one_line_error(capsys)


def test_equivalence_tree_with_a_samples_file_exit_2(ckpt, capsys, tmp_path):
    path = tmp_path / "s.jsonl"
    settings = {"temperature": 1.0, "top_k": None, "top_p": None, "new_tokens": 2, "engine": "x",
                "engine_version": None}
    path.write_text("\n".join([json.dumps(settings)] + [json.dumps({"prompt": [1, 2], "tokens": [3, 4]})] * 10))
    assert run_main(["equivalence", "--target", ckpt["target"], "--samples-file", str(path), "--tree", "2,2"]) == 2
    assert "--tree" in _one_line_error(capsys)


@pytest.mark.parametrize("value, match", [("-1,2", "'-1,2' is not a tree"), ("-1x3", "width >= 1")])
def test_a_negative_tree_given_apart_reaches_the_trees_check(ckpt, capsys, value, match):
    # argparse would take "-1,2" for an option and report a missing value instead
    assert generate(ckpt, "--draft", ckpt["draft"], "--tree", value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m minispec generate: error: argument --tree: ") and match in err[-1], err


def test_negative_prompt_ids_given_apart_reach_their_check(capsys):
    from minispec.cli import _attach_list_values

    assert run_main(["equivalence", "--engine", "openai", "--url", "http://127.0.0.1:1/v1", "--reference-url",
                     "http://127.0.0.1:2/v1", "--prompt-ids", "-1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --prompt-ids '-1,2': give one or more token ids >= 0"], err
    bench = ["bench", "--tree", "-1,2"]  # tools/bench.py's arguments go on as given
    assert _attach_list_values(bench) == bench
    assert _attach_list_values(["generate", "--tree", "--k"]) == ["generate", "--tree", "--k"]
