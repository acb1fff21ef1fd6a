"""Kept quantization against hostile and broken input (issue 33's kept-file half).

- A GGUF block with a non-finite scale is refused by `convert_gguf --keep-quant` in one line naming the
  tensor (requantized to int8 rows, a NaN row used to become zeros), and the distance tables show a NaN as
  NaN, never as 0.
- What the converter writes loads as users load it: a float q, k or v beside kept ones converts and loads
  (kept where kept, the float one row by row), and the converter's own check is the default load.
- A kept checkpoint with a non-finite scale or min is refused at load, naming the file and the tensor.
- A conversion's float copies stay one chunk in size, and an allocation failure is one line.
- A callback that is not callable is refused before any work, in generate and speculate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_quantized import TENSORS, quantized_gguf, rewrite

from minispec import Transformer, forms, quantized
from minispec.checkpoint import CheckpointError
from minispec.errors import GenerationError, InputError
from minispec.forms import RowWise, Stacked

from helpers import run_main

gguf = pytest.importorskip("gguf")
import checks  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

import convert_gguf  # noqa: E402


def one_error_line(capsys) -> str:
    """The single `error: ...` line a tool printed to stderr (and nothing else there)."""
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------
# 1. a non-finite block scale is refused at conversion

# GGUF name -> (its type in TENSORS, byte offsets of its fp16 scales in a block: d (and dmin))
SCALES = {"blk.0.attn_q.weight": (Q.Q4_K, (0, 2)), "blk.0.attn_v.weight": (Q.Q6_K, (208,)),
          "blk.0.attn_output.weight": (Q.Q8_0, (0,)), "blk.0.ffn_down.weight": (Q.Q5_0, (0,)),
          "token_embd.weight": (Q.Q4_K, (0, 2)), "output.weight": (Q.Q6_K, (208,))}


def spoil_block(path: Path, tensor: str, block: int, where: int, value: float) -> None:
    """Write the fp16 `value` at byte `where` of block `block` of the GGUF tensor `tensor`, in place."""
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == tensor)
    offset = int(t.data_offset) + block * gguf.GGML_QUANT_SIZES[t.tensor_type][1] + where
    del reader  # its memory map, before the file is written
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], dtype=np.float16).tobytes())


CASES = [(tensor, where, value) for tensor, (_, offsets) in SCALES.items() for where in offsets
         for value in (float("nan"), float("inf"), float("-inf"))]


@pytest.mark.parametrize("tensor,where,value", CASES)
def test_a_non_finite_block_scale_is_refused_at_conversion(tmp_path, capsys, tensor, where, value):
    assert TENSORS[tensor][1] == SCALES[tensor][0]
    src = quantized_gguf(tmp_path / "bad.gguf")
    spoil_block(src, tensor, 0, where, value)
    assert convert_gguf.main([str(src), str(tmp_path / "out"), "--keep-quant", "--quiet"]) == 1
    err = one_error_line(capsys)
    assert repr(tensor) in err and "NaN or inf" in err and str(src) in err
    assert not (tmp_path / "out").exists()


def test_fuzz_non_finite_scales_anywhere_are_refused(tmp_path, capsys):
    """Random tensors, blocks and scale positions: always the one line, naming the spoilt tensor and row."""
    rng = np.random.default_rng(7)
    for trial in range(6):
        tensor = sorted(SCALES)[rng.integers(len(SCALES))]
        kind, offsets = SCALES[tensor]
        (n, k), per_block = TENSORS[tensor][0], gguf.GGML_QUANT_SIZES[kind][0]
        block = int(rng.integers(n * k // per_block))
        src = quantized_gguf(tmp_path / f"bad{trial}.gguf", seed=trial)
        spoil_block(src, tensor, block, int(rng.choice(offsets)), [float("nan"), float("inf")][trial % 2])
        assert convert_gguf.main([str(src), str(tmp_path / f"out{trial}"), "--keep-quant", "--quiet"]) == 1
        err = one_error_line(capsys)
        assert repr(tensor) in err and f"row {block * per_block // k} as stored" in err, (tensor, block, err)


def test_the_conversion_table_shows_a_nan_distance_as_nan(tmp_path, monkeypatch):
    """Python's max(0.0, nan) is 0.0: the table used to print a NaN distance as an exact 0."""
    nan_values = lambda form, parts: torch.full_like(quantized.dequantize(form, parts), float("nan"))  # noqa: E731
    monkeypatch.setattr(forms, "computed_values", nan_values)
    errors = {}
    convert_gguf.convert(quantized_gguf(tmp_path / "tiny.gguf"), tmp_path / "out", keep_quant=True,
                         progress=False, errors=errors)
    rows = convert_gguf.error_table(errors).splitlines()[1:]
    assert rows and all(row.split()[3] == "nan" for row in rows)


@pytest.mark.parametrize("broken", ["reference", "other"])
def test_the_distance_check_refuses_nan_logits_instead_of_reading_them_as_0(tiny_gguf_kept, monkeypatch, broken):
    """bench distance: a NaN in the reference's p made the KL of its row 0 (NaN > 0 is false); one in the other's
    made the whole mean NaN. Either model's NaN logits are refused, naming it."""
    model = Transformer.from_pretrained(tiny_gguf_kept, int4=False)
    real = checks.all_logits
    ref, low = model, Transformer.from_pretrained(tiny_gguf_kept, int4=False)
    bad = ref if broken == "reference" else low

    def logits(m, ids, start):
        out = real(m, ids, start)
        return out.index_fill(0, torch.tensor([0]), float("nan")) if m is bad else out
    monkeypatch.setattr(checks, "all_logits", logits)
    with pytest.raises(InputError, match=f"the {broken}: its logits are NaN") as e:
        checks.prompt_distance(ref, low, [1, 5, 3], 4)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# 2. a float q, k or v beside kept ones: converted, loaded as users load it

@pytest.fixture(scope="module")
def tiny_gguf_kept(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("kept")
    convert_gguf.convert(quantized_gguf(tmp / "tiny.gguf"), tmp / "kept", keep_quant=True, progress=False)
    return tmp / "kept"


FLOAT_PARTS = [("k",), ("q",), ("v",), ("q", "v"), ("k", "v")]


@pytest.mark.parametrize("floats", FLOAT_PARTS, ids=["+".join(f) for f in FLOAT_PARTS])
def test_a_float_projection_beside_kept_ones_converts_and_loads(tmp_path, floats):
    tensors = {**TENSORS, **{f"blk.0.attn_{p}.weight": (TENSORS[f"blk.0.attn_{p}.weight"][0], Q.F32)
                             for p in floats}}
    src = quantized_gguf(tmp_path / "mixed.gguf", tensors=tensors)
    assert convert_gguf.main([str(src), str(tmp_path / "out"), "--keep-quant", "--quiet"]) == 0
    kept = Transformer.from_pretrained(tmp_path / "out")  # the default load: kept where kept
    qkv = kept.layers[0].self_attn.qkv_proj.weight
    assert isinstance(qkv, Stacked) and forms.is_packed(kept)
    assert [isinstance(p, RowWise) for p in qkv.parts] == [p in floats for p in ("q", "k", "v")]
    plain = Transformer.from_pretrained(tmp_path / "out", int4=False)
    x = torch.tensor([[1, 5, 3, 9, 4, 12, 7, 2]])
    a, b = kept(x), plain(x)
    assert (a - b).abs().max() < 0.03 * b.abs().max()  # activations quantized to 8 bits by the kept product
    prompts = [[1, 5, 3], [4, 12, 7, 2, 10, 11]]
    want = kept.generate(prompts, max_new_tokens=10, stop_tokens=[])
    assert kept.speculate(plain, prompts, k=3, max_new_tokens=10, stop_tokens=[]).tokens == want


def test_the_converters_check_is_the_default_load(tmp_path, monkeypatch):
    """A kept checkpoint that the default (packed) load refuses is not written, even if a dequantized load works."""
    def refuse(*args):
        raise quantized.QuantizedCheckpointError("refused by the packed load")
    monkeypatch.setattr(forms, "install", refuse)
    with pytest.raises(InputError, match="does not load .*refused by the packed load"):
        convert_gguf.convert(quantized_gguf(tmp_path / "tiny.gguf"), tmp_path / "out", keep_quant=True,
                             progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# 3. a non-finite scale in a kept checkpoint: refused at load, naming the file and the tensor

# (tensor, byte offset of an fp16 scale in its row's last block): Q4_K's d and dmin, Q6_K's d, Q5_0's and Q8_0's d
SCALE_PARTS = [("layers.0.mlp.up_proj.weight.q4_k", 144 - 144), ("layers.0.mlp.up_proj.weight.q4_k", 2),
               ("layers.0.self_attn.v_proj.weight.q6_k", 208), ("layers.0.mlp.down_proj.weight.q5_0", 352 - 22),
               ("layers.0.self_attn.o_proj.weight.q8_0", 272 - 34), ("embed_tokens.weight.q4_k", 0),
               ("lm_head.weight.q6_k", 208)]
FP16_BYTES = {"nan": (0x00, 0x7E), "inf": (0x00, 0x7C), "-inf": (0x00, 0xFC)}  # little-endian fp16


def spoil_scale(part: str, offset: int, value: str):
    def spoil(tensors):
        tensors[part][-1, offset:offset + 2] = torch.tensor(FP16_BYTES[value], dtype=torch.uint8)
    return spoil


@pytest.mark.parametrize("value", list(FP16_BYTES))
@pytest.mark.parametrize("part,offset", SCALE_PARTS)
@pytest.mark.parametrize("int4", [None, False])
def test_a_non_finite_scale_in_a_kept_checkpoint_is_refused_at_load(tiny_gguf_kept, tmp_path, part, offset, value,
                                                                    int4):
    bad = rewrite(tiny_gguf_kept, tmp_path / "bad", spoil_scale(part, offset, value))
    with pytest.raises(CheckpointError, match="NaN or inf") as e:
        Transformer.from_pretrained(bad, int4=int4)
    assert str(bad / "model.safetensors") in str(e.value) and part in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_kept_checkpoint_with_a_nan_scale_in_one_line(tiny_gguf_kept, tmp_path, capsys):
    bad = rewrite(tiny_gguf_kept, tmp_path / "bad", spoil_scale("layers.0.mlp.up_proj.weight.q4_k", 0, "nan"))
    assert run_main(["generate", "--target", str(bad), "--prompt", "ab", "--max-new-tokens", "2"]) == 1
    err = one_error_line(capsys)
    assert "layers.0.mlp.up_proj.weight.q4_k" in err and "norm_eps" not in err


# ---------------------------------------------------------------------------------------------
# 4. a conversion's memory: chunks, and an allocation failure in one line

def test_a_kept_matrix_is_made_a_chunk_at_a_time_and_the_same(tmp_path, monkeypatch):
    src = quantized_gguf(tmp_path / "tiny.gguf")
    convert_gguf.convert(src, tmp_path / "whole", keep_quant=True, progress=False)
    sizes = []
    real = gguf.quants.dequantize

    def dequantize(data, kind):
        out = real(data, kind)
        sizes.append(out.size)
        return out
    monkeypatch.setattr(convert_gguf, "CHUNK_VALUES", 4096)
    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    convert_gguf.convert(src, tmp_path / "chunked", keep_quant=True, progress=False)
    assert sizes and max(sizes) <= 4096  # never a whole matrix (the largest here is 131,072 values)
    whole, chunked = load_file(str(tmp_path / "whole" / "model.safetensors")), \
        load_file(str(tmp_path / "chunked" / "model.safetensors"))
    assert whole.keys() == chunked.keys() and all(torch.equal(whole[n], chunked[n]) for n in whole)


def test_the_gguf_is_unmapped_before_the_load_back_check(tmp_path, monkeypatch):
    """The file's pages count as the process's memory once read: held through the check, they would add the
    GGUF's size to the loaded model's."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("no /proc/self/maps to read the mappings from")
    src, mapped = quantized_gguf(tmp_path / "tiny.gguf"), []
    real = convert_gguf.check_output_loads

    def check(*args, **kwargs):
        mapped.append(str(src) in Path("/proc/self/maps").read_text())
        return real(*args, **kwargs)
    monkeypatch.setattr(convert_gguf, "check_output_loads", check)
    convert_gguf.convert(src, tmp_path / "out", keep_quant=True, progress=False)
    assert mapped == [False]


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] . "
                                                               "DefaultCPUAllocator: not enough memory: you tried "
                                                               "to allocate 545947648 bytes.")])
def test_running_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(convert_gguf, "check_output_loads", fail)
    src = quantized_gguf(tmp_path / "tiny.gguf")
    assert convert_gguf.main([str(src), str(tmp_path / "out"), "--keep-quant", "--quiet"]) == 1
    assert "out of memory" in one_error_line(capsys)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_another_runtime_error_is_still_a_bug(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(convert_gguf, "check_output_loads", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        convert_gguf.main([str(quantized_gguf(tmp_path / "tiny.gguf")), str(tmp_path / "out"), "--keep-quant",
                           "--quiet"])


# ---------------------------------------------------------------------------------------------
# 5. a callback that is not callable: refused before any work

@pytest.mark.parametrize("callback", [42, "print", [print]])
@pytest.mark.parametrize("how", ["generate", "speculate"])
def test_a_callback_that_is_not_callable_is_refused_up_front(tiny_gguf_kept, monkeypatch, callback, how):
    model = Transformer.from_pretrained(tiny_gguf_kept, int4=False)
    steps = []
    real = model.step
    monkeypatch.setattr(model, "step", lambda *a, **k: steps.append(1) or real(*a, **k))
    call = model.generate if how == "generate" else lambda *a, **k: model.speculate("prompt-lookup", *a, **k)
    with pytest.raises(GenerationError, match="on_tokens must be a callable") as e:
        call([1, 5, 3], max_new_tokens=4, on_tokens=callback)
    assert "\n" not in str(e.value) and not steps  # refused before the prefill
