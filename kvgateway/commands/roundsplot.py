"""The PNG of ``gateway rounds --plot``: tokens/s and TTFT p99 against concurrency.

matplotlib is optional (the ``plot`` extra; the ``bench`` extra has it too), imported
only here and only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvgateway.commands.roundsreport import repeat_key
from kvgateway.commands.roundstats import Round


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot_rounds(rounds: Sequence[Round], path: Path) -> None:
    """One line per round in each panel; a step that preempted is marked with an x.
    Repeats of one configuration share a colour, later runs dashed, so their spread (the
    run-to-run noise the verdicts weigh changes against) shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvgateway[plot]' (or matplotlib)"
        ) from exc
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = sorted({s.concurrency for r in rounds for s in r.steps})
    colours: dict[str, str] = {}
    try:
        for r in rounds:
            xs = [s.concurrency for s in r.steps]
            tok = [s.tokens_per_s for s in r.steps]
            ttft = [s.ttft_p99_s if s.ttft_p99_s is not None else float("nan") for s in r.steps]
            key = repeat_key(r)
            style = {"linestyle": "--", "color": colours[key]} if key in colours else {}
            (line,) = tok_ax.plot(xs, tok, marker="o", label=r.name, **style)
            colours.setdefault(key, line.get_color())
            ttft_ax.plot(
                xs, ttft, marker="o", label=r.name, **(style or {"color": line.get_color()})
            )
            hot = [i for i, s in enumerate(r.steps) if s.preemptions > 0]
            for ax, ys in ((tok_ax, tok), (ttft_ax, ttft)):
                ax.scatter(
                    [xs[i] for i in hot], [ys[i] for i in hot], marker="x", s=90,
                    color=line.get_color(), zorder=3,
                )  # fmt: skip
        for ax, title in (
            (tok_ax, "generated tokens/s"),
            (ttft_ax, "TTFT p99 (s)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests (x: the node preempted)")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
        tok_ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
