"""Two figures: serving workers over time against the arrival rate, and attainment / worker-seconds side by side."""

from __future__ import annotations

from pathlib import Path

POLICIES = ("utilisation", "ongoing_requests", "reactive_ttft", "tokend", "tokend_learned_peak")
COLORS = {"utilisation": "tab:gray", "ongoing_requests": "tab:orange", "reactive_ttft": "tab:blue",
          "tokend": "tab:green", "tokend_learned_peak": "tab:olive"}  # fmt: skip


def plot(results: dict, timelines: dict, rates: dict, plot_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    traces = list(results["traces"])
    warmups = list(results["params"]["warmups_s"])
    written = []

    fig, axes = plt.subplots(len(traces), len(warmups), figsize=(5 * len(warmups), 3.2 * len(traces)), squeeze=False)
    for i, trace in enumerate(traces):
        for j, warmup in enumerate(warmups):
            ax = axes[i][j]
            times, rate = rates[trace]
            rate_ax = ax.twinx()
            rate_ax.fill_between(times, rate, color="0.85", step="mid", label="arrivals/s")
            rate_ax.set_ylabel("requests/s", color="0.5")
            ax.set_zorder(rate_ax.get_zorder() + 1)
            ax.patch.set_visible(False)
            for policy in POLICIES:
                line = timelines[(trace, warmup, policy)]
                ax.step([p["t"] for p in line], [p["billed"] for p in line], where="post", color=COLORS[policy],
                        label=policy)  # fmt: skip
            ax.set_title(f"{trace}, warm-up {warmup:g} s", fontsize=9)
            ax.set_ylabel("workers billed")
            ax.set_xlabel("seconds")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = plot_dir / "autoscale-workers.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(str(path))

    fig, axes = plt.subplots(2, len(traces), figsize=(5 * len(traces), 6.5), squeeze=False)
    width = 0.8 / len(POLICIES)
    for j, trace in enumerate(traces):
        for k, policy in enumerate(POLICIES):
            runs = [results["traces"][trace][policy]["by_warmup_s"][f"{w:g}"] for w in warmups]
            xs = [i + (k - (len(POLICIES) - 1) / 2) * width for i in range(len(warmups))]
            axes[0][j].bar(xs, [r["ttft_attainment"] for r in runs], width, color=COLORS[policy], label=policy)
            axes[1][j].bar(xs, [r["worker_seconds"] for r in runs], width, color=COLORS[policy])
        target = results["params"]["ttft_target_s"]
        axes[0][j].set_title(f"{trace}: share of requests with TTFT <= {target:g} s", fontsize=9)
        axes[1][j].set_title(f"{trace}: worker-seconds", fontsize=9)
        for row in (0, 1):
            axes[row][j].set_xticks(range(len(warmups)), [f"warm-up {w:g} s" for w in warmups])
        axes[0][j].axhline(0.95, color="k", lw=0.6, ls="--")
        axes[0][j].set_ylim(0, 1.05)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = plot_dir / "autoscale-attainment.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(str(path))
    return written
