"""The harness's picture: u histograms per position against the band a uniform histogram stays in."""

from __future__ import annotations

import math

import numpy as np

from .harness import EquivalenceReport
from .stats import chi2_bins


def plot_report(report: EquivalenceReport, path) -> None:
    """PNG of the u histograms per position and pooled (one row of panels per token order), the samples under
    test against target-only, over the band a uniform histogram stays in with probability 1 - alpha per bin;
    the title gives the verdict and the power figure ("would have caught a bias of TV >= x")."""
    if report.mode != "pit":
        raise ValueError("plots need the PIT (temperature > 0); a greedy run has no u's to plot")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    from scipy import stats

    orders = list(report.u)
    T = report.u[orders[0]].shape[1]
    cols = min(T + 1, 6)  # T positions + pooled, wrapped into rows of at most 6 panels per order
    rows_per_order = math.ceil((T + 1) / cols)
    fig, axes = plt.subplots(rows_per_order * len(orders), cols, squeeze=False,
                             figsize=(2.6 * cols, 2.3 * rows_per_order * len(orders)))
    for ax in axes.flat:
        ax.axis("off")
    alpha, s = report.settings["alpha"], report.settings
    for j, order in enumerate(orders):
        u = report.u[order]
        ur = None if report.u_reference is None else report.u_reference[order]
        for i in range(T + 1):
            ax = axes[j * rows_per_order + i // cols, i % cols]
            ax.axis("on")
            us = u[:, i] if i < T else u.ravel()
            b = chi2_bins(us.size, s["bins"])
            edges = np.linspace(0, 1, b + 1)
            lo, hi = stats.binom.ppf([alpha / 2, 1 - alpha / 2], us.size, 1 / b)
            ax.axhspan(lo, hi, color="0.85", label=f"uniform, {1 - alpha:.0%} per bin")
            ax.axhline(us.size / b, color="0.4", lw=0.8)
            ax.hist(us, bins=edges, histtype="step", lw=1.5, color="C3", label=report.speculative.label)
            if ur is not None:
                ax.hist(ur[:, i] if i < T else ur.ravel(), bins=edges, histtype="step", lw=1.0, color="C0",
                        label="target-only")
            ax.set_title(f"{'position ' + str(i + 1) if i < T else 'all positions'} ({order} order)", fontsize=8)
            ax.set_xlim(0, 1)
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=6)
    power = "" if report.power is None else "\n" + report.power.phrase()
    fig.suptitle(f"PIT u histograms: {s['under_test']}, temperature={s['temperature']}, top_k={s['top_k']}, "
                 f"top_p={s['top_p']}, {s['samples_total']} samples over {s['prompts']} prompt(s): "
                 f"{'PASSED' if report.passed else 'FAILED'}{power}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.9))  # room for the two-line title
    fig.savefig(path, dpi=100)
    plt.close(fig)
