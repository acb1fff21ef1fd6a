"""The kept 1.5B beside llama.cpp, quiet and side by side: target-only and speculating (the int4 0.5B, the
kept Q4_K_M 0.5B and the feature draft, k=auto) against llama.cpp's plain and speculative decoding of the
shipped files and ik_llama.cpp's plain decoding with its row-interleaved forms (-rtr, where `python
tools/llama_cpp.py --ik` built it), every contender back to back per prompt; medians in tokens/s.
`python tools/bench_side.py [FEATURE_DRAFT_DIR ...]` (about 10 minutes on 2 cores; feature drafts to compare,
default the committed one)."""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_peers import llama_command, llama_cpp_bin, llama_one, llama_timings
from bench_plan import CODER_PROMPTS

from minispec import Transformer, load_draft

import llama_cpp

NEW_TOKENS, ROUNDS, PROMPTS = 32, 2, 2
TARGET_GGUF = "weights/gguf/qwen2.5-coder-1.5b-instruct.gguf"
DRAFT_GGUF = "weights/gguf/qwen2.5-coder-0.5b-instruct.gguf"


def timed(fn) -> float:
    t = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t)


def ik_one(bin_dir: Path, temperature: float, text: str, i: int) -> float:
    """ik_llama.cpp's plain decoding of one prompt (its llama-cli, -rtr), in tokens/s as it reports its timings
    (prompt processing plus generation, as llama_one does for llama.cpp)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = llama_command(bin_dir, f.name, NEW_TOKENS, 2, temperature, i, str(Path(TARGET_GGUF).resolve()), None)
    cmd = [str(bin_dir / "llama-cli"), *[a for a in cmd[1:] if a != "-no-cnv"], "-rtr"]  # its cli: no chat by default
    # run in the temporary folder: ik's llama-cli writes its main.log to the current directory
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    Path(f.name).unlink()
    if out.returncode:
        raise RuntimeError(f"ik_llama.cpp's llama-cli failed ({out.returncode}): {(out.stdout + out.stderr)[-500:]}")
    n, _, s = llama_timings(out.stdout + out.stderr, False)
    return n / s


def main(feature_dirs: list[str]) -> None:
    target = Transformer.from_pretrained("weights/qwen2.5-coder-1.5b-instruct-q4km")
    drafts = {"int4 0.5B": Transformer.from_pretrained("weights/qwen2.5-coder-0.5b-instruct-draft"),
              # the 0.5B as shipped (its Q4_K_M GGUF's blocks, kept), through the same product as the target
              "kept Q4_K_M 0.5B": Transformer.from_pretrained("weights/qwen2.5-coder-0.5b-instruct-q4km")}
    for d in feature_dirs or ["weights/qwen2.5-coder-1.5b-q4km-draft"]:
        drafts[f"feature {d}" if feature_dirs else "feature"] = load_draft(d, target)
    bin_dir, ik_dir, rates = llama_cpp_bin(), llama_cpp.ik_bin_dir(), {}
    for _ in range(ROUNDS):
        for i, message in enumerate(CODER_PROMPTS[:PROMPTS]):
            ids = target.tokenizer.encode_chat([{"role": "user", "content": message}])
            text = target.tokenizer.decode(ids)
            for t in (0.0, 0.7):
                run = dict(max_new_tokens=NEW_TOKENS, temperature=t, seed=i, stop_tokens=[])
                rates.setdefault(f"minispec target-only T={t}", []).append(
                    timed(lambda ids=ids, run=run: len(target.generate(ids, **run))))
                for name, d in drafts.items():
                    rates.setdefault(f"minispec speculate {name} k=auto T={t}", []).append(
                        timed(lambda d=d, ids=ids, run=run: len(target.speculate(d, ids, k="auto", **run).tokens)))
                for name, draft in (("plain", None), ("speculative", DRAFT_GGUF)):
                    n, _, s = llama_one(bin_dir, 2, t, TARGET_GGUF, draft, text, i, NEW_TOKENS)
                    rates.setdefault(f"llama.cpp {name} T={t}", []).append(n / s)
                if ik_dir is not None:
                    rates.setdefault(f"ik_llama.cpp plain -rtr T={t}", []).append(ik_one(ik_dir, t, text, i))
    for name, r in rates.items():
        print(f"{name:50s} median {statistics.median(r):6.2f} tokens/s  (n={len(r)})")


if __name__ == "__main__":
    main(sys.argv[1:])
