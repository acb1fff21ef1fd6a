"""Distil a small draft model for speculative decoding from a target's own generations.

    python tools/distill_draft.py --target DIR --out DIR [--data DIR] [--gen-minutes M] [--train-minutes M] [--measure]
                                           # all of it: generate, train, export the best draft to --out
    python tools/distill_draft.py generate [--minutes M] [--batch 64] [--max-new-tokens 256] [--device cuda]
    python tools/distill_draft.py train    [--minutes M] [--run runs/distill/main] [--min-growth 0.1] [--device cuda]
    python tools/distill_draft.py export   [--run runs/distill/main] [--out weights/smollm2-135m-draft]
    python tools/distill_draft.py measure  [--draft weights/smollm2-135m-draft] [--n-prompts 32] [--no-speculate]

Every stage is resumable: kill it at any moment and run the same command again.
On a shared CPU run generate and train side by side under `nice -n 19`, train
with `--threads 1 --min-growth 0.1` so the generator keeps most of the CPU.

The code lives in the package tools/distill/ (its docstring describes the
stages); this file is its command line.
"""

import sys

from distill.cli import main  # tools/distill/: this file's folder is on sys.path when it runs as a script

if __name__ == "__main__":
    sys.exit(main())
