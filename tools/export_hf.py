"""Export a minispec checkpoint to a Hugging Face directory that transformers loads.

    python tools/export_hf.py SRC_DIR DST_DIR [--overwrite]

The command line over minispec.hf_export.export_hf, which describes the output: config.json,
generation_config.json, model.safetensors with Hugging Face tensor names and the tokenizer files,
as LlamaForCausalLM (or Qwen2ForCausalLM for a model with q/k/v biases), in the stored dtype.
DST_DIR appears only once it is complete.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings

from minispec.hf_export import ExportWarning
from minispec.hf_export import export_hf as export  # export_hf.export: the name this tool has always had

from _common import run_tool, tool_parser


def _show(show, message, category, *rest) -> None:
    """warnings.showwarning while exporting: an ExportWarning as the tool's one-line note on stderr, any other
    warning as `show` (Python's) shows it."""
    if issubclass(category, ExportWarning):
        print(f"note: {message}", file=sys.stderr)
    else:
        show(message, category, *rest)


@contextlib.contextmanager
def notes():
    """While exporting: an ExportWarning shown as the tool's one-line `note: ...` on stderr, each time."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ExportWarning)
        warnings.showwarning = functools.partial(_show, warnings.showwarning)
        yield


def main(argv: list[str] | None = None) -> int:
    args = tool_parser(__doc__.split("\n\n")[0],
                       src_help="minispec checkpoint directory (config.json + model.safetensors)",
                       dst_help="Hugging Face checkpoint directory to create").parse_args(argv)

    def job() -> str:
        with notes():
            hf = export(args.src, args.dst, overwrite=args.overwrite, progress=not args.quiet)
        return f"wrote {args.dst} ({hf['architectures'][0]})"
    return run_tool(job)


if __name__ == "__main__":
    sys.exit(main())
