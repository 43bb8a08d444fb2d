"""From one strategy's records to its JSON summary, and all strategies' time to first token to one plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from daemon.bench.metrics import percentile
from rollout_bench.traffic import failed, truncated

SWAP_RATIO_TARGET = 1.5  # the bound: TTFT p90 during the swap <= 1.5x steady state


def window(shorts: list[dict], start: float, end: float) -> dict:
    """The short requests sent in [start, end): their TTFT percentiles and whose weights served them."""
    mine = [r for r in shorts if start <= r["sent"] < end]
    ttfts = [r["ttft"] for r in mine if r["ttft"] is not None]
    return {
        "n": len(ttfts),
        "sent": len(mine),
        "seconds": round(end - start, 2),
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p90_s": _round(percentile(ttfts, 90)),
        "ttft_max_s": _round(max(ttfts, default=None)),
        "generations": dict(Counter("+".join(r["generations"]) for r in mine)),
    }


def load_window(loads: list[dict], start: float, end: float) -> dict:
    """The workers' load reports sampled in [start, end): the most requests waiting (all workers together) and
    the fullest KV cache of any worker; a wait there, not the rollout itself, is what a TTFT spike often is."""
    mine = [s for s in loads if start <= s["t"] < end]
    waiting: Counter[float] = Counter()
    for sample in mine:
        waiting[sample["t"]] += sample["num_waiting"]
    return {
        "max_num_waiting": max(waiting.values(), default=None),
        "max_kv_cache_usage": _round(max((s["kv_cache_usage"] for s in mine), default=None)),
        "max_busy_workers": max(Counter(s["t"] for s in mine if s["num_running"]).values(), default=0),
    }


def summarize(run: dict) -> dict:
    """One strategy's result. `run` holds the records (shorts, longs) and the times (monotonic) of the steady
    window's start, the Rollout call, the phase's end, and the end of short arrivals (the phase's end plus a tail)."""
    shorts, longs = run["shorts"], run["longs"]
    steady = window(shorts, run["steady_start"], run["rollout_called"])
    swap = window(shorts, run["rollout_called"], run["arrivals_stopped"])
    steady["load"] = load_window(run["loads"], run["steady_start"], run["rollout_called"])
    swap["load"] = load_window(run["loads"], run["rollout_called"], run["arrivals_stopped"])
    ratio = swap["ttft_p90_s"] / steady["ttft_p90_s"] if steady["ttft_p90_s"] and swap["ttft_p90_s"] else None
    after_done = [r for r in shorts + longs if r["sent"] >= run["rollout_ended"]]
    streams = shorts + longs
    return {
        "phase": run["phase"],
        "error": run["error"],
        "steady": steady,
        "swap": swap,
        "ttft_p90_ratio": _round(ratio),
        "ttft_p90_ratio_target": SWAP_RATIO_TARGET,
        "within_target": ratio is not None and ratio <= SWAP_RATIO_TARGET,
        "swap_seconds": round(run["rollout_ended"] - run["rollout_called"], 2),
        "failed_streams": sum(failed(r) for r in streams),
        "truncated_streams": sum(truncated(r) for r in streams),
        "failures": sorted({r["error"] or r["finish_reason"] for r in streams if failed(r)}),
        "migrated_streams": sum(r["migrated"] for r in streams),
        "short_requests": len(shorts),
        "long_streams_completed": len(longs),
        "long_stream_generations": dict(Counter("+".join(r["generations"]) for r in longs)),
        "generations_after_done": sorted({g for r in after_done for g in r["generations"]}),
        "events": run["events"],
        "workers_after": run["workers"],
    }


def plot(runs: dict[str, dict], summaries: dict[str, dict], path: Path) -> str | None:
    """TTFT of each short request against its arrival, per strategy; returns why it made no plot, if it did not."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.6 * len(runs)), squeeze=False)
    for ax, (strategy, run) in zip(axes[:, 0], runs.items(), strict=True):
        zero = run["rollout_called"]
        by_generation: dict[str, list[tuple[float, float]]] = {}
        for r in run["shorts"]:
            if r["ttft"] is not None:
                label = "+".join(g.split("@")[0] for g in r["generations"]) or "?"
                by_generation.setdefault(label, []).append((r["sent"] - zero, r["ttft"]))
        for label, points in sorted(by_generation.items()):
            ax.scatter(*zip(*points, strict=True), s=10, label=f"served by {label}")
        waiting: Counter[float] = Counter()
        for sample in run["loads"]:
            waiting[sample["t"] - zero] += sample["num_waiting"]
        if any(waiting.values()):  # only when requests queued: an axis of zeros says nothing
            twin = ax.twinx()
            twin.step(*zip(*sorted(waiting.items()), strict=True), color="tab:gray", linewidth=0.7, where="post")
            twin.set_ylabel("requests waiting, all workers (gray line)", fontsize=8)
            twin.set_ylim(bottom=0)
        ax.axvspan(0, run["rollout_ended"] - zero, color="tab:gray", alpha=0.15, label="rollout (call to done)")
        steady_p90 = summaries[strategy]["steady"]["ttft_p90_s"]
        if steady_p90:
            ax.axhline(steady_p90, color="tab:green", linewidth=1, label="steady p90")
            ax.axhline(SWAP_RATIO_TARGET * steady_p90, color="tab:red", linestyle="--", linewidth=1,
                       label=f"{SWAP_RATIO_TARGET}x steady p90")  # fmt: skip
        ratio = summaries[strategy]["ttft_p90_ratio"]
        ax.set_title(f"{strategy}: swap p90 / steady p90 = {ratio}", fontsize=10)
        ax.set_xlabel("arrival, seconds from the Rollout call")
        ax.set_ylabel("time to first token (s)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
