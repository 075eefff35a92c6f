"""Server-rendered charts of the dashboard: matplotlib figures as inline SVG text (no
JavaScript, no network). Each function returns an ``<svg ...>`` string."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: colours of the waterfall's span kinds (matplotlib's tab10)
KIND_COLOURS = {"llm": "tab:blue", "tool": "tab:orange", "reward": "tab:green", "agent": "tab:purple",
                "other": "tab:gray"}


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def waterfall_svg(rows: list[dict]) -> str:
    """A timeline of ``views.waterfall`` rows: one bar per span from ``t0_s`` to ``t1_s``
    (seconds from the attempt's first span), a diamond per reward, top to bottom in
    sequence order, coloured by kind."""
    fig, ax = plt.subplots(figsize=(9, 0.35 * max(len(rows), 2) + 0.8))
    for i, r in enumerate(rows):
        colour = KIND_COLOURS.get(r["kind"], "tab:gray")
        if r["kind"] == "reward":
            ax.plot([r["t0_s"]], [i], marker="D", color=colour)
        else:
            ax.barh(i, max(r["t1_s"] - r["t0_s"], 1e-3), left=r["t0_s"], color=colour, height=0.6)
    ax.set_yticks(range(len(rows)), [f"{r['attempt_id']}:{'' if r['sequence_id'] is None else r['sequence_id']} "
                                     f"{r['kind']} {r['name'][:32]}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the attempt's first span")
    ax.grid(axis="x", alpha=0.3)
    return _svg(fig)


TRAINING_PANELS = (("loss", "loss"), ("approx_kl", "approx KL"), ("clip_frac", "clip fraction"),
                   ("mean_reward", "mean reward"), ("tokens_per_s", "tokens/s"), ("samples", "samples trained"))


def training_svg(rows: list[dict]) -> str:
    """One panel per metric of :data:`TRAINING_PANELS` against the policy version, one line
    per run (``views.training_rows`` rows)."""
    fig, axes = plt.subplots(2, 3, figsize=(11, 5.2))
    runs = sorted({r["run"] for r in rows})
    for ax, (key, title) in zip(axes.flat, TRAINING_PANELS):
        for run in runs:
            pts = [(r["version"], r["metrics"][key]) for r in rows if r["run"] == run and key in r["metrics"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=run)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("policy version", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0] and len(runs) <= 6:
        axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    return _svg(fig)
