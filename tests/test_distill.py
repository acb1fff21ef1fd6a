"""tools/distill_draft.py (the package tools/distill/) on a tiny random target: generation resumes without
duplicates and matches `generate`, training resumes bit-for-bit from its checkpoint, the exported draft loads and
shares the target's tokenizer, and the greedy round replay counts rounds as speculation does."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from minispec import CheckpointError, ModelConfig, Transformer
from minispec.tokenizer import load_tokenizer

import distill as dd
from helpers import Payload, write_word_tokenizer

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "\n", "You", "are", "a", "helpful",
         "the", "sky", "is", "blue", "why", "tell", "me", "about", "cats", "dogs", "rain", "sun", "and", "."]
TEMPLATE = ("{% for m in messages %}{% if loop.first %}{{ '<|im_start|>system\\nYou are a helpful<|im_end|>\\n' }}"
            "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
VOCAB = 32


def write_tokenizer(d: Path) -> None:
    """A word-level tokenizer.json over WORDS (ids 0..24; the model's vocab is 32) and a chat template."""
    write_word_tokenizer(d, WORDS, specials=("<|im_start|>", "<|im_end|>", "\n"),
                         config={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
                                 "chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, bos_id=1,
                      eos_id=2, tie_embeddings=False)
    m = Transformer(cfg)
    with torch.no_grad():  # large random weights: a context-dependent argmax and a spread-out distribution
        m.lm_head.weight.normal_(0.0, 0.5)
        for name, w in m.named_parameters():
            if name.endswith("proj.weight"):
                w.normal_(0.0, 0.3)
    write_tokenizer(d)
    m.tokenizer = load_tokenizer(d)
    m.save_pretrained(d / "ckpt")
    return d / "ckpt"


PROMPTS = [{"id": i, "split": "heldout" if i == 5 else "train", "kind": "topic",
            "messages": [{"role": "user", "content": text}]}
           for i, text in enumerate(["why is the sky blue", "tell me about cats", "tell me about dogs", "rain and sun",
                                     "why is the sun", "tell me about the sky", "cats and dogs", "why rain",
                                     "about the blue sky", "why cats"])]


def keys_of(data: Path) -> list[tuple[int, float, int]]:
    keys = []
    for p in dd.shard_paths(data):
        s = dd.Shard.load(p)
        temps = np.round(s.temperature.astype(np.float64), 3).tolist()
        keys += [dd.item_key(i, t, d) for i, t, d in zip(s.prompt_id.tolist(), temps, s.seed.tolist())]
    return keys


@pytest.fixture(scope="module")
def generated(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    data, labels = root / "data", root / "labels"
    target = Transformer.from_pretrained(target_dir)
    kw = dict(batch=3, max_new_tokens=12, sample_every=2, temperature=0.7, flush_every=2, refill=1, progress=False)
    n1 = dd.generate_stage(target, PROMPTS, data, labels, max_items=5, **kw)
    n2 = dd.generate_stage(target, PROMPTS, data, labels, **kw)
    n3 = dd.generate_stage(target, PROMPTS, data, labels, **kw)
    n4 = dd.generate_stage(target, PROMPTS, data, labels, samples=2, **kw)  # more samples later: only the new ones
    return root, target, (n1, n2, n3, n4)


def test_generate_resumes_without_duplicates(generated):
    root, _, (n1, n2, n3, n4) = generated
    one = dd.work_items(PROMPTS, 2, 0.7)
    expected = dd.work_items(PROMPTS, 2, 0.7, samples=2)
    assert set(one) < set(expected)
    assert (n1, n2, n3, n4) == (5, len(one) - 5, 0, len(expected) - len(one))
    keys = keys_of(root / "data")
    assert len(keys) == len(set(keys)) == len(expected)
    assert set(keys) == {dd.item_key(*it) for it in expected}
    assert 5 not in {k[0] for k in keys}  # the held-out prompt is never generated from


def test_generated_text_matches_generate_and_labels_match_shards(generated, target_dir):
    root, target, _ = generated
    target_bf16 = Transformer.from_pretrained(target_dir, dtype=dd.DTYPES["bfloat16"])
    for path in dd.shard_paths(root / "data"):
        shard = dd.Shard.load(path)
        with np.load(dd.labels_path(root / "labels", path)) as z:
            ids, logp = z["ids"], z["logp"]
        assert ids.shape == (len(shard.resp_tokens), dd.TOPK) and logp.shape == ids.shape
        off = 0
        for i, (prompt, resp) in enumerate(shard.sequences()):
            temp, seed = float(shard.temperature[i]), int(shard.seed[i])
            ref = target.generate(prompt.tolist(), max_new_tokens=12, temperature=temp, seed=seed)
            assert resp.tolist() == ref  # continuous batching and prefix forking change nothing
            if temp == 0:  # the soft label's top-1 is the greedy token itself
                assert ids[off:off + len(resp), 0].tolist() == resp.tolist()
            off += len(resp)
        # the cached labels are what a fresh forward pass computes
        re_ids, re_logp = dd.compute_labels(target, shard)
        assert (re_ids[:, :4] == ids[:, :4]).all()
        np.testing.assert_allclose(re_logp, logp.astype(np.float32), atol=2e-2)
        # --target-dtype bfloat16: the same labels up to bf16 rounding
        bf_ids, bf_logp = dd.compute_labels(target_bf16, shard)
        # the top-1 may differ only at near-ties (a gap in log-probability within bf16's rounding of the logits)
        gap = re_logp[:, 0] - re_logp[:, 1]
        assert (bf_ids[:, 0] == ids[:, 0])[gap > 0.1].all()
        assert (bf_ids[:, 0] == ids[:, 0]).mean() > 0.8
        assert np.abs(bf_logp[:, 0] - logp[:, 0].astype(np.float32)).mean() < 0.05


def small_cfg() -> dd.TrainConfig:
    return dd.TrainConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_vocab=20, lr=1e-2, embed_lr=1e-2,
                          warmup=2, max_tokens=64, seed=0)


def test_train_resumes_exactly_and_exports_a_loadable_draft(generated, target_dir, tmp_path):
    root, _, _ = generated
    torch.set_num_threads(1)
    args = dict(data_dir=root / "data", labels_dir=root / "labels", target_path=str(target_dir), progress=False,
                eval_every=100)
    straight = tmp_path / "straight"
    dd.train_stage(straight, cfg=small_cfg(), max_steps=8, **args)
    resumed = tmp_path / "resumed"
    dd.train_stage(resumed, cfg=small_cfg(), max_steps=3, **args)
    first = torch.load(resumed / "ckpt.pt", weights_only=True)
    assert first["step"] == 3
    dd.train_stage(resumed, cfg=None, max_steps=8, export_to=tmp_path / "draft", **args)
    a = torch.load(straight / "ckpt.pt", weights_only=True)
    b = torch.load(resumed / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 8
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=0, atol=0, msg=name)
    assert not torch.equal(first["model"]["layers.0.mlp.up_proj.weight"], b["model"]["layers.0.mlp.up_proj.weight"])

    draft = Transformer.from_pretrained(tmp_path / "draft")
    target = Transformer.from_pretrained(target_dir)
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.tokenizer.fingerprint == target.tokenizer.fingerprint
    assert draft.dtype == torch.bfloat16 and draft.config.head_vocab_size == 20
    assert set(target.config.stop_ids) <= set(draft.head_ids.tolist())  # eos can always be proposed
    logits = draft(torch.tensor([[1, 3, 6]]))
    assert torch.isinf(logits[0, -1]).sum() == VOCAB - 20  # tokens outside the head get probability 0
    assert (Path(tmp_path / "draft") / "distill.json").is_file()


def test_a_new_run_can_start_from_an_exported_draft(generated, target_dir, tmp_path):
    root, _, _ = generated
    torch.set_num_threads(1)
    args = dict(data_dir=root / "data", labels_dir=root / "labels", target_path=str(target_dir), progress=False,
                eval_every=100)
    dd.train_stage(tmp_path / "first", cfg=small_cfg(), max_steps=3, export_to=tmp_path / "draft", **args)
    exported = Transformer.from_pretrained(tmp_path / "draft", dtype=torch.float32)
    # the architecture comes from the draft, whatever the config says; training goes on from its weights
    dd.train_stage(tmp_path / "second", cfg=dd.TrainConfig(dim=8, head_vocab=10, warmup=2, max_tokens=64), max_steps=1,
                   init_from=tmp_path / "draft", **args)
    state = torch.load(tmp_path / "second" / "ckpt.pt", weights_only=True)
    assert state["step"] == 1 and state["train_config"]["dim"] == 16 and state["train_config"]["head_vocab"] == 20
    assert torch.equal(state["model"]["head_ids"], exported.head_ids)
    w0, w1 = exported.state_dict()["layers.0.mlp.up_proj.weight"], state["model"]["layers.0.mlp.up_proj.weight"]
    assert 0 < (w1 - w0).abs().max() < 0.05  # one small step away from the exported weights
    target = Transformer.from_pretrained(target_dir)
    target.save_pretrained(tmp_path / "not_a_draft")  # no subset head
    with pytest.raises(ValueError, match="no subset head"):
        dd.train_stage(tmp_path / "third", max_steps=1, init_from=tmp_path / "not_a_draft", **args)


def test_a_stop_request_ends_training_with_a_checkpoint(generated, target_dir, tmp_path):
    """SIGTERM / Ctrl-C during `train` (a StopRequest as the handler) finish the step, checkpoint and return."""
    root, _, _ = generated
    torch.set_num_threads(1)
    stop = dd.StopRequest()
    stop(15, None)
    assert stop.requested
    dd.train_stage(tmp_path / "run", root / "data", root / "labels", str(target_dir), small_cfg(), max_steps=50,
                   progress=False, export_to=None, stop=stop)
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == 1
    with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
        stop(15, None)


def test_simulate_greedy_rounds():
    # k=2: rounds start at 0 (accept 2, commit 3), 3 (accept 0, commit 1), 4 (accept 1, commit 2), 6 (commit 1:
    # the last token of the budget comes from the target, so nothing is drafted)
    agree = [True, True, True, False, True, False, True]
    assert dd.simulate_greedy_rounds(agree, k=2) == (4, 2 + 2 + 2 + 0, 2 + 0 + 1 + 0)
    assert dd.simulate_greedy_rounds([True] * 10, k=4) == (2, 8, 8)
    assert dd.simulate_greedy_rounds([False] * 3, k=4) == (3, 2 + 1 + 0, 0)
    # a sequence that stopped (eos) before its budget: rounds still draft a full k
    assert dd.simulate_greedy_rounds([False] * 3, k=4, budget=10) == (3, 12, 0)


def test_shared_prefix_and_epoch_order_cover_every_example(generated):
    assert dd.shared_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert dd.shared_prefix([[5], [6]]) == []
    root, _, _ = generated
    ex = dd.load_examples(root / "data", root / "labels", target_path=None)
    order = dd.epoch_order(ex, epoch=0, max_tokens=64, seed=0)
    flat = [k for b in order for k in b]
    assert sorted(flat) == sorted(e.key for e in ex)
    assert order == dd.epoch_order(ex, epoch=0, max_tokens=64, seed=0) != dd.epoch_order(ex, 1, 64, 0)


def test_measure_replay_agrees_with_speculate(target_dir, tmp_path):
    """The teacher-forced replay of greedy rounds and the library's speculate see the same rounds."""
    torch.manual_seed(1)
    target = Transformer.from_pretrained(target_dir)
    cfg = dd.make_draft_config(target.config, 32, 2, 4, 2, None, VOCAB)
    draft = Transformer(cfg)  # the target itself with a noisy lm_head: agrees often, not always
    state = {k: v.clone() for k, v in target.state_dict().items()}
    state["head_ids"] = torch.arange(VOCAB)
    state["lm_head.weight"] += 0.3 * torch.randn_like(state["lm_head.weight"])
    draft.load_state_dict(state)
    dd.export_draft(draft, target.tokenizer, tmp_path / "draft")
    prompts = [dict(p, split="heldout") for p in PROMPTS]
    res = dd.measure_stage(str(target_dir), str(tmp_path / "draft"), prompts, n_prompts=6, k=3, max_new_tokens=10,
                           cost_repeats=4)
    rep, spec = res["replay"], res["speculate"]
    assert spec["matches_greedy"]
    assert 0.2 < rep["acceptance_rate"] < 0.95 and rep["tokens_per_round"] > 1  # both kinds of round happen
    # same greedy text, same proposals: the same number of rounds and of accepted tokens
    assert spec["sequence_rounds"] == rep["rounds"]
    assert spec["accepted"] == rep["accepted"]
    assert res["step_ms"]["target_fp32"] > 0 and res["cost_ratio_fp32"] > 0


def test_resume_overrides_only_optimisation_fields_and_growth_wait_returns(generated, target_dir, tmp_path):
    root, _, _ = generated
    args = dict(data_dir=root / "data", labels_dir=root / "labels", target_path=str(target_dir), progress=False,
                eval_every=100)
    run = tmp_path / "run"
    dd.train_stage(run, cfg=small_cfg(), max_steps=2, **args)
    dd.train_stage(run, max_steps=3, overrides={"lr": 1e-4, "max_tokens": 32}, **args)
    state = torch.load(run / "ckpt.pt", weights_only=True)
    assert state["train_config"]["lr"] == 1e-4 and state["train_config"]["max_tokens"] == 32
    with pytest.raises(ValueError, match="fixed by the checkpoint"):
        dd.train_stage(run, max_steps=4, overrides={"dim": 32}, **args)
    ex = dd.load_examples(root / "data", root / "labels", target_path=None)
    # nothing new is being generated: the wait ends at the deadline with the same data
    same, waited = dd.wait_for_growth(ex, 0.5, root / "data", root / "labels", None, deadline=0.0, poll=0.01)
    assert dd.n_tokens(same) == dd.n_tokens(ex) and waited < 5


def test_a_data_directory_refuses_another_targets_text(generated, target_dir, tmp_path):
    root, _, _ = generated
    assert json.loads((root / "data" / dd.MANIFEST).read_text())["config"]["dim"] == 32
    other = Transformer(ModelConfig(vocab_size=VOCAB, dim=48, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=128,
                                    bos_id=1, eos_id=2))
    other.tokenizer = load_tokenizer(target_dir)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="another target.*dim"):
        dd.generate_stage(Transformer.from_pretrained(tmp_path / "other"), PROMPTS, root / "data", root / "labels",
                          progress=False)
    with pytest.raises(ValueError, match="another target"):
        dd.load_examples(root / "data", root / "labels", str(tmp_path / "other"))
    dd.load_examples(root / "data", root / "labels", str(target_dir))  # its own target still reads them


def test_one_command_runs_the_whole_pipeline(target_dir, tmp_path):
    torch.set_num_threads(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "draft"
    argv = ["--target", str(target_dir), "--out", str(out), "--data", str(tmp_path / "data"), "--labels",
            str(tmp_path / "labels"), "--run", str(tmp_path / "run"), "--prompts", str(prompts), "--head-vocab", "20",
            "--train-minutes", "0.02", "--threads", "1"]
    assert dd.main(argv) == 0
    assert len(keys_of(tmp_path / "data")) == len(dd.work_items(PROMPTS, 3, 0.7))  # every train prompt answered
    draft = Transformer.from_pretrained(out)
    assert draft.config.head_vocab_size == 20 and draft.tokenizer.fingerprint == load_tokenizer(target_dir).fingerprint
    step = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"]
    assert dd.main(argv) == 0  # again: nothing left to generate, training resumes from its checkpoint
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] > step


def test_an_interrupted_generate_keeps_its_finished_sequences(target_dir, tmp_path, monkeypatch):
    target = Transformer.from_pretrained(target_dir)
    real_step, calls = target.step, {"n": 0}

    def step(*a, **kw):  # Ctrl-C (or SIGTERM, which cmd_generate turns into it) in the middle of decoding
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        return real_step(*a, **kw)
    monkeypatch.setattr(target, "step", step)
    with pytest.raises(KeyboardInterrupt):
        dd.generate_stage(target, PROMPTS, tmp_path / "data", tmp_path / "labels", batch=2, max_new_tokens=12,
                          flush_every=100, refill=1, progress=False)
    kept = keys_of(tmp_path / "data")
    assert 0 < len(kept) < len(dd.work_items(PROMPTS, 3, 0.7))  # written although no flush was due
    monkeypatch.setattr(target, "step", real_step)
    n = dd.generate_stage(target, PROMPTS, tmp_path / "data", tmp_path / "labels", batch=2, max_new_tokens=12,
                          refill=1, progress=False)
    assert n + len(kept) == len(dd.work_items(PROMPTS, 3, 0.7))  # the rest, once each


def unpickled_plainly(data: bytes, marker: Path) -> bool:
    """The negative control: plain pickle.loads of the same bytes does run the payload."""
    pickle.loads(data)
    return marker.exists()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "weights_only=False" not in err[0]  # never pass on torch's advice to load unsafely
    return err[0]


@pytest.mark.parametrize("writer, refusal", [("torch.save", r"holds a Python object \(\S*open\)"),
                                             ("pickle", "not a readable training checkpoint")])
def test_a_hostile_checkpoint_is_refused_by_resume_and_export_and_never_runs(generated, target_dir, tmp_path, capsys,
                                                                             writer, refusal):
    root, _, _ = generated
    marker, run = tmp_path / "pwned", tmp_path / "run"
    run.mkdir()
    state = {k: 0 for k in dd.checkpoint.KEYS} | {"model": Payload(marker)}
    ckpt = run / "ckpt.pt"
    if writer == "torch.save":
        torch.save(state, ckpt)
        with zipfile.ZipFile(ckpt) as z:  # the pickle inside torch's zip (no tensors: no persistent ids)
            raw = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    else:
        ckpt.write_bytes(pickle.dumps(state))
        raw = ckpt.read_bytes()
    refused = rf"ckpt\.pt: {refusal}.*; delete it and train again$"
    with pytest.raises(CheckpointError, match=refused):  # resuming `train`
        dd.train_stage(run, root / "data", root / "labels", str(target_dir), small_cfg(), max_steps=1, progress=False)
    with pytest.raises(CheckpointError, match=refused):
        dd.load_checkpoint(ckpt)
    common = ["--run", str(run), "--target", str(target_dir)]
    assert dd.main(["export", *common, "--out", str(tmp_path / "draft")]) == 1
    assert re.search(refused, one_error_line(capsys))
    assert dd.main(["train", *common, "--data", str(root / "data"), "--labels", str(root / "labels"),
                    "--max-steps", "1", "--export", ""]) == 1
    assert re.search(refused, one_error_line(capsys))
    assert not marker.exists() and not (tmp_path / "draft").exists()
    assert unpickled_plainly(raw, marker)  # the payload was live all along


def test_a_checkpoint_is_checked_before_its_draft_is_built(generated, target_dir, tmp_path):
    """A checkpoint weights_only can load but whose config does not fit its tensors (10**9 layers, another width),
    that lacks entries, or that is not a checkpoint at all: a CheckpointError at once, nothing allocated."""
    root, _, _ = generated
    run = tmp_path / "run"
    args = dict(data_dir=root / "data", labels_dir=root / "labels", target_path=str(target_dir), progress=False)
    dd.train_stage(run, cfg=small_cfg(), max_steps=1, **args)
    good = torch.load(run / "ckpt.pt", weights_only=True)
    for change, message in [({"n_layers": 10**9}, "model_config cannot be used"),
                            ({"dim": 32}, "does not match the tensors it holds")]:
        bad = dict(good, model_config={**good["model_config"], **change})
        torch.save(bad, run / "ckpt.pt")
        with pytest.raises(CheckpointError, match=message):
            dd.train_stage(run, max_steps=2, **args)
    torch.save(dict(good, train_config={**good["train_config"], "not_a_field": 1}), run / "ckpt.pt")
    with pytest.raises(CheckpointError, match="train_config cannot be used"):
        dd.train_stage(run, max_steps=2, **args)
    torch.save(dict(good, step="3"), run / "ckpt.pt")
    with pytest.raises(CheckpointError, match="step of the wrong type"):
        dd.train_stage(run, max_steps=2, **args)
    torch.save({k: v for k, v in good.items() if k != "rng"}, run / "ckpt.pt")
    with pytest.raises(CheckpointError, match=r"missing \['rng'\]"):
        dd.train_stage(run, max_steps=2, **args)
    (run / "ckpt.pt").write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable training checkpoint"):
        dd.train_stage(run, max_steps=2, **args)
    torch.save(good, run / "ckpt.pt")  # the control: the unchanged checkpoint resumes
    dd.train_stage(run, max_steps=2, **args)
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 2


def test_hostile_shards_and_labels_are_refused_unread(generated, target_dir, tmp_path, capsys):
    """Shards and soft labels are read with allow_pickle=False: pickled object arrays are refused, never run."""
    root, target, _ = generated
    marker = tmp_path / "pwned"
    data, labels = tmp_path / "data", tmp_path / "labels"
    shutil.copytree(root / "data", data)
    shutil.copytree(root / "labels", labels)
    shard = dd.shard_paths(data)[0]
    with np.load(shard) as z:
        clean = {k: z[k] for k in z.files}
    np.savez(shard, **(clean | {"prompt_id": np.array([Payload(marker)], dtype=object)}))
    with pytest.raises(dd.DataError, match=r"gen-00000\.npz: not a distillation shard of plain arrays.*regenerate"):
        dd.load_examples(data, labels, target_path=None)
    with pytest.raises(dd.DataError, match="not a distillation shard"):
        dd.generate_stage(target, PROMPTS, data, labels, progress=False)
    assert dd.main(["train", "--run", str(tmp_path / "run"), "--target", str(target_dir), "--data", str(data),
                    "--labels", str(labels), "--max-steps", "1", "--export", ""]) == 1
    assert "not a distillation shard" in one_error_line(capsys)
    np.savez(shard, **clean)
    label_file = dd.labels_path(labels, shard)
    np.savez(label_file, ids=np.array([Payload(marker)], dtype=object), logp=np.zeros(1))
    with pytest.raises(dd.DataError, match=r"labels\.npz: not a soft-label file of plain arrays.*to recompute it"):
        dd.load_examples(data, labels, target_path=None)
    assert not marker.exists()
    with np.load(label_file, allow_pickle=True) as z:  # the control: with pickles allowed the payload runs
        z["ids"]
    assert marker.exists()
