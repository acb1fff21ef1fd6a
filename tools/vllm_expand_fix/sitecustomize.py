"""The corrected expand op for vLLM's CPU build, applied at a vLLM server's start (tools/vllm_cpu.py --fix-expand).

tools/vllm_cpu.py puts this directory on PYTHONPATH of the vLLM server it starts, so Python imports this module at
start-up (`site` imports `sitecustomize`) in the server and in every process it spawns. Nothing else is changed:
when vLLM imports `vllm.utils.cpu_triton_utils`, its `_expand_kernel_impl` (the CPU stand-in vLLM's CPU platform
registers for the Triton `expand_kernel` of `vllm/v1/sample/rejection_sampler.py`) is replaced by `expand`
below, before `CpuPlatform.register_triton_kernel_overrides` reads it.

The stock `_expand_kernel_impl` hands `torch.ops._C.expand_kernel_impl` the int64 copies `_ensure_int64` makes of
tensors that are not int64 (a float32 temperature, an int32 top-k, a float32 top-p): the op writes into a copy,
and the caller's buffer (`x.new_empty(num_tokens)` in `expand_batch_to_tokens`) keeps whatever memory it was
given. `expand` does what the Triton kernel does, in place, in the caller's dtype (docs/equivalence.md, "Auditing
vLLM").
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "vllm.utils.cpu_triton_utils"
MARK = "minispec: vllm.utils.cpu_triton_utils._expand_kernel_impl replaced by the corrected expand (--fix-expand)"


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """Request i's value (replace_from read as replace_to) written to output[cu[i-1]:cu[i]] (at most
    MAX_NUM_TOKENS of them), in output's own storage and dtype: the Triton expand_kernel's effect."""
    import torch

    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    cu = cu_num_tokens.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    counts = cu - starts
    if MAX_NUM_TOKENS is not None:
        counts = counts.clamp(max=int(MAX_NUM_TOKENS))
    for i in range(int(cu.shape[0])):  # a batch of requests: a few rows
        n = int(counts[i])
        if n > 0:
            s = int(starts[i])
            output[s:s + n] = vals[i].to(output.dtype)


class _Patch(importlib.abc.MetaPathFinder):
    """Finds MODULE with the other finders and replaces its _expand_kernel_impl once it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._expand_kernel_impl = expand
            print(MARK, file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _Patch) for f in sys.meta_path):
    sys.meta_path.insert(0, _Patch())
