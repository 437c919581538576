"""The tuner's output (``python -m pooled_loader tune``, pooled_loader.tune): ``tune.png``, the
trials plotted per setting (images/s, where the time goes, worker milliseconds per sample and
stage), and the fixed-width table printed at the end.

matplotlib is imported only when a plot is written (it is an optional dependency).
"""
from __future__ import annotations

from typing import Any

from .search import KNOBS

__all__ = ["write_plot", "format_table"]



def write_plot(trials: list[dict], best: dict, path: str, title: str) -> bool:
    """tune.png: images/s per trial, where the time goes (worker busy/idle, consumer wait) and
    the workers' milliseconds per sample in each stage (getitem, decode, crop_resize, ...).
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"start": "tab:gray", "num_workers": "tab:blue", "batch_size": "tab:orange",
              "prefetch_factor": "tab:brown", "pool_extra": "tab:purple", "confirm": "black"}
    x = list(range(len(trials)))
    labels = [t["label"] for t in trials]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(max(9.0, 0.6 * len(trials) + 5), 10.5),
                                        sharex=True)
    bars = ax1.bar(x, [t["images_per_s"] for t in trials],
                   color=[colors[t["knob"]] for t in trials])
    bars[trials.index(best)].set_edgecolor("black")
    bars[trials.index(best)].set_linewidth(2.5)
    ax1.set_ylabel("images/s")
    ax1.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax1.legend(handles, [f"varied: {k}" if k in KNOBS else k for k in colors], fontsize=8,
               loc="upper left",
               bbox_to_anchor=(1.01, 1.0))
    ax1.annotate("best", (trials.index(best), best["images_per_s"]), ha="center",
                 va="bottom", fontsize=9, fontweight="bold")

    busy = [100 * (t.get("worker_busy_mean") or 0.0) for t in trials]
    ax2.bar(x, busy, color="tab:green", label="workers busy (mean)")
    ax2.bar(x, [100 - b for b in busy], bottom=busy, color="#dddddd",
            label="workers idle")
    ax2.plot(x, [100 * t.get("wait_fraction", float("nan")) for t in trials], "o-",
             color="tab:red",
             label="training loop waiting for data")
    ax2.set_ylabel("% of measured time")
    ax2.set_title("where the time goes", fontsize=10)
    ax2.set_ylim(0, 105)
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _plot_stages(ax3, trials, x)
    ax3.set_xticks(x)
    ax3.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax3.set_xlabel("trial (w=num_workers p=prefetch_factor s=pool_slots b=batch_size)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_stages(ax: Any, trials: list[dict], x: list[int]) -> None:
    """Stacked bars: each trial's worker milliseconds per sample, stage by stage."""
    stages: list[str] = []
    for t in trials:
        for k in t.get("stage_ms_per_sample") or {}:
            if k not in stages:
                stages.append(k)
    bottom = [0.0] * len(trials)
    for k in stages:
        ms = [(t.get("stage_ms_per_sample") or {}).get(k, 0.0) for t in trials]
        ax.bar(x, ms, bottom=bottom, label=k)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_ylabel("worker ms per sample")
    ax.set_title("where the workers' time goes, per stage", fontsize=10)
    if stages:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def format_table(trials: list[dict], best: dict) -> str:
    """The trials as a fixed-width table; the best is marked with '*'."""
    head = (f"{'#':>3} {'varied':<15} {'workers':>7} {'prefetch':>8} {'slots':>5} {'batch':>5} "
            f"{'images/s':>9} {'wait':>5} {'busy':>5} {'grown':>5} {'wRSS MB':>7} {'load':>5}")
    rows = [head, "-" * len(head)]
    for t in trials:
        if "error" in t:
            rows.append(f"{t['id']:>3} {t['knob']:<15} {t['num_workers']:>7} "
                        f"{t['prefetch_factor']:>8} {t['pool_slots']:>5} {t['batch_size']:>5} "
                        f"   failed: {t['error']}"[:160])
            continue
        busy = "-" if t["worker_busy_mean"] is None else f"{t['worker_busy_mean']:.0%}"
        rss = "-" if t["peak_rss_worker_mb"] is None else f"{t['peak_rss_worker_mb']:.0f}"
        rows.append(f"{t['id']:>3} {t['knob']:<15} {t['num_workers']:>7} "
                    f"{t['prefetch_factor']:>8} {t['pool_slots']:>5} {t['batch_size']:>5} "
                    f"{t['images_per_s']:>9.0f} {t['wait_fraction']:>5.0%} {busy:>5} "
                    f"{t['grown']:>5} {rss:>7} {t['load_avg_1min']:>5.1f}"
                    + (" *" if t is best else ""))
    rows.append("wait: share of the loop's time spent waiting for data; busy: mean worker busy "
                "share; grown: pool growths\n(sizing the first batch counts 1); wRSS: peak RSS "
                "of one worker (shared pages included: pool, mapped\nfiles); load: 1-minute "
                "load average after the trial; *: best")
    return "\n".join(rows)
