"""The engines the harness can audit besides minispec's own `speculate`: Hugging Face transformers.

- "transformers": plain sampling, `generate(..., do_sample=True)`;
- "transformers-assisted": transformers' speculative decoding, `generate(..., assistant_model=draft, do_sample=True)`.

Both load the pair with transformers from Hugging Face directories (the ones
minispec.hf_export writes: `exported` makes them from minispec checkpoints in a
temporary directory) and yield the samples in chunks, which the harness scores
with minispec's own target like any engine's.

The sampling settings are exactly the stated ones. transformers fills every
generation setting left unset from the checkpoint's generation_config.json and
then from its global defaults (top_k=50 among them), so `generation_config` sets
every one that changes the distribution, writes "off" explicitly (top_k=0,
top_p=1.0, repetition_penalty=1.0, ...), disables eos (no stop, no eos masking:
min_new_tokens is then a no-op) and replaces the model's own generation config
with it, so nothing is merged in from the directory.

transformers is a test dependency of minispec, not a library one: it is imported
here, inside the functions that run these engines, and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from pathlib import Path

import torch

from ..errors import InputError, one_line
from ..hf_export import ExportWarning, export_hf
from ..sampling import SamplingParams
from .samples import EquivalenceInputError

ENGINES = ("minispec", "transformers", "transformers-assisted")
# the settings that would change the sampled distribution if transformers filled them in: written "off"
NEUTRAL = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0,
               epsilon_cutoff=0.0, eta_cutoff=0.0, min_p=None, top_h=None, bad_words_ids=None, suppress_tokens=None,
               begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None,
               guidance_scale=None, exponential_decay_length_penalty=None, renormalize_logits=False,
               remove_invalid_values=False, watermarking_config=None, num_beams=1, num_return_sequences=1)
# how well transformers' target must agree with minispec's on one prompt (max |logit difference|, fp32)
LOGIT_TOLERANCE = 1e-2


def import_transformers():
    """transformers, or a one-line error saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise EquivalenceInputError("the transformers engines need the transformers package (a test dependency of "
                                    "minispec, not a library one): pip install 'transformers>=4.45'") from None
    return transformers


def is_hf_dir(path) -> bool:
    """A Hugging Face checkpoint directory (config.json with a model_type) rather than a minispec one."""
    cfg = Path(path) / "config.json"
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return d.get("format") != "minispec" and "model_type" in d


@contextlib.contextmanager
def exported(dirs: dict[str, str | None]):
    """{"target": DIR, "draft": DIR or None} -> the same with every minispec checkpoint exported by
    minispec.hf_export into a temporary directory (removed afterwards); Hugging Face directories pass through."""
    out = dict(dirs)
    todo = {k: v for k, v in dirs.items() if v is not None and not is_hf_dir(v)}
    if not todo:
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="minispec-hf-") as tmp:
        for name, src in todo.items():
            out[name] = _export(src, Path(tmp) / name)
        yield out


def _export(src, dst: Path) -> str:
    """`src` exported to `dst` for transformers, or EquivalenceInputError saying why it could not be.

    A subset lm_head's warning is left out: a draft's only changes what the assistant proposes, which leaves
    the target's distribution exact, and a target's would fail check_same_target."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)
            export_hf(src, dst, progress=False)
    except (InputError, OSError) as e:
        raise EquivalenceInputError(f"{src} could not be exported for transformers: {one_line(e)}") from None
    return str(dst)


def load_hf(transformers, path):
    """A transformers causal LM from a Hugging Face directory, in float32, in eval mode."""
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise EquivalenceInputError(f"transformers cannot load {path}: {str(e).splitlines()[0]}") from None
    return model.to(torch.float32).eval()


def generation_config(transformers, params: SamplingParams, new_tokens: int):
    """Exactly the stated settings, every other one that shapes the distribution off, eos disabled. Greedy
    decoding (temperature 0) sets no sampling filter: transformers applies none without do_sample."""
    sampling = {} if params.greedy else dict(temperature=params.temperature, top_k=params.top_k or 0,
                                             top_p=params.top_p or 1.0)
    return transformers.GenerationConfig(do_sample=not params.greedy, max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **sampling,
                                         **NEUTRAL)


def check_same_target(hf_model, target, prompt: list[int], where: str) -> float:
    """transformers' target must be minispec's --target (the PIT scores with minispec's): max |logit difference|
    on one prompt, or EquivalenceInputError."""
    x = torch.tensor([prompt])
    with torch.inference_mode():
        a = hf_model(x).logits[0].float()
        b = target(x.to(target.device))[0].float().cpu()
    if a.shape != b.shape:
        raise EquivalenceInputError(f"{where} gives logits {tuple(a.shape)}, the target {tuple(b.shape)}: not the "
                                    "same model")
    diff = float((a - b).abs().max())
    if diff > LOGIT_TOLERANCE:
        raise EquivalenceInputError(f"{where} is not the --target model: their logits differ by up to {diff:.3g} "
                                    f"(> {LOGIT_TOLERANCE}) on the first prompt; export --target with "
                                    "tools/export_hf.py")
    return diff


class TransformersEngine:
    """transformers' sampling ("transformers") or assisted generation ("transformers-assisted") on the pair in
    hf_dirs {"target": DIR, "draft": DIR}, loaded and checked once; `chunks` draws the samples.

    k: the assistant's num_assistant_tokens (schedule "constant"); "auto" keeps transformers' own defaults for the
    assistant. `info` holds what the report states: the engine, transformers' version, the assistant's settings.
    """

    def __init__(self, engine: str, hf_dirs: dict, target, first_prompt: list[int], params: SamplingParams,
                 new_tokens: int, k):
        transformers = import_transformers()
        self.assisted = engine == "transformers-assisted"
        self.new_tokens = new_tokens
        self.model = load_hf(transformers, hf_dirs["target"])
        diff = check_same_target(self.model, target, first_prompt, f"the transformers target {hf_dirs['target']}")
        self.config = generation_config(transformers, params, new_tokens)
        self.model.generation_config = self.config  # nothing left to merge in from the directory
        self.info = {"engine": engine, "engine_version": transformers.__version__,
                     "hf_target": str(hf_dirs["target"]), "hf_logit_difference": diff}
        self.kw = {}
        if self.assisted:
            assistant = load_hf(transformers, hf_dirs["draft"])
            if assistant.config.vocab_size != self.model.config.vocab_size:
                raise EquivalenceInputError(f"the assistant {hf_dirs['draft']} has vocab_size "
                                            f"{assistant.config.vocab_size}, the target {self.model.config.vocab_size}")
            agc = transformers.GenerationConfig(eos_token_id=None, pad_token_id=0)
            if k != "auto":
                agc.num_assistant_tokens, agc.num_assistant_tokens_schedule = int(k), "constant"
            assistant.generation_config = agc
            self.kw["assistant_model"] = assistant
            self.info.update(hf_draft=str(hf_dirs["draft"]), assistant={
                "num_assistant_tokens": agc.num_assistant_tokens,
                "num_assistant_tokens_schedule": agc.num_assistant_tokens_schedule,
                "assistant_confidence_threshold": agc.assistant_confidence_threshold})

    def chunks(self, prompts: list[list[int]], counts: list[int], seed: int, batch_size: int, bar=None):
        """(prompt, samples) in groups of up to batch_size samples, prompt by prompt. Assisted generation takes
        batch size 1, so each of its samples is its own call, sample g of the run seeded torch.manual_seed(seed + g);
        plain sampling draws a group per call, seeded with seed + its first sample's index."""
        per_call = 1 if self.assisted else batch_size
        try:
            g = 0
            for prompt, n in zip(prompts, counts):
                for start in range(0, n, batch_size):
                    drawn = []
                    for s in range(start, min(start + batch_size, n), per_call):
                        b = min(per_call, n - s)
                        drawn += self._generate(prompt, b, seed + g)
                        g += b
                        if bar is not None:
                            bar.update(b)
                    yield prompt, drawn
        finally:
            if bar is not None:
                bar.close()

    def _generate(self, prompt: list[int], b: int, seed: int) -> list[list[int]]:
        """b samples after prompt; transformers draws from torch's global generator, seeded here and then restored."""
        x = torch.tensor([prompt] * b)
        with torch.random.fork_rng(), torch.inference_mode():
            torch.manual_seed(seed)
            out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=self.config, **self.kw)
        new = out[:, len(prompt):].tolist()
        for t in new:
            if len(t) != self.new_tokens:
                raise RuntimeError(f"transformers returned {len(t)} new tokens, expected {self.new_tokens} "
                                   "(eos is disabled): the engine ended a sequence early")
        return new
