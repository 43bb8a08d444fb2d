"""Draws docs/grafana-dashboard.png: the Grafana dashboard's panels, from a real run (no Grafana here).

Starts a real daemon on the default model, drives load through gRPC in four phases (light, busy, overload with
batch work that admission sheds, light again), scrapes the API port's /metrics every second, and draws every panel
of scripts/dashboard_panels.py from those scrapes: each query is the very one deploy/grafana/tokend-dashboard.json
sends Prometheus, evaluated over the same rate window. About three minutes.

    .venv/bin/python scripts/render_dashboard.py                      # writes docs/grafana-dashboard.png
    .venv/bin/python scripts/render_dashboard.py --seconds 60 --out /tmp/dashboard.png
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

import grpc  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from dashboard_panels import PANELS, Panel, Samples, Window  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokend.v1 import tokend_pb2 as pb  # noqa: E402

RATE_WINDOW_S = 10.0  # what $__rate_interval is at a 1 s scrape interval in a short range
# Small enough for this machine to queue and shed in the overload phase, and a KV cache (2 MiB: 1024 tokens of the
# tiny model) that the busy phases fill, so that requests wait for pages in the scheduler too.
DAEMON_CONFIG = """\
max_num_seqs = 8
kv_cache_bytes = 2097152
max_queued_requests = 12
batch_max_queue_wait = 3.0
"""
SYSTEM_PROMPT = "You are a careful assistant. Answer briefly, cite nothing, and never make up facts. " * 3


@dataclass(frozen=True)
class Phase:
    name: str
    share: float  # of the run's duration
    interactive: int  # clients, each with one request in flight at a time
    batch: int


PHASES = (
    Phase("light", 0.25, 2, 0),
    Phase("busy", 0.3, 10, 4),
    Phase("overload", 0.25, 6, 28),
    Phase("light", 0.2, 2, 0),
)

# Grafana's dark theme and its classic palette
BACKGROUND, PANEL, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e9e"
PALETTE = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#96d98d")


class Scraper(threading.Thread):
    """Scrapes a /metrics URL every second: [(wall time, monotonic time, samples)]."""

    def __init__(self, url: str):
        super().__init__(name="scraper", daemon=True)
        self.url = url
        self.scrapes: list[tuple[float, float, Samples]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import urllib.request

        next_at = time.monotonic()
        while not self.stop.is_set():
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                text = reply.read().decode()
            samples: Samples = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
            self.scrapes.append((time.time(), time.monotonic(), samples))
            next_at += 1.0
            self.stop.wait(max(0.0, next_at - time.monotonic()))


class Load:
    """Clients that each keep one Generate call in flight until their phase ends; counts what happened."""

    def __init__(self, daemon: LocalDaemon):
        self.daemon = daemon
        self.counts = {"finished": 0, "shed": 0, "failed": 0}
        self._lock = threading.Lock()

    def run(self, phases: tuple[Phase, ...], seconds: float) -> None:
        """Each phase's clients start as the previous phase's stop asking (their last calls still run out)."""
        clients = []
        for phase in phases:
            print(f"{phase.name}: {phase.interactive} interactive + {phase.batch} batch clients", flush=True)
            until = time.monotonic() + phase.share * seconds
            for priority, number in ((pb.PRIORITY_INTERACTIVE, phase.interactive), (pb.PRIORITY_BATCH, phase.batch)):
                for i in range(number):
                    rng = random.Random(f"{phase.name}{priority}{i}")
                    clients.append(threading.Thread(target=self._client, args=(priority, until, rng)))
                    clients[-1].start()
            time.sleep(max(0.0, until - time.monotonic()))
        for client in clients:
            client.join()

    def _client(self, priority: int, until: float, rng: random.Random) -> None:
        while time.monotonic() < until:
            # Half the prompts share a system prompt, as chat traffic does: the prefix cache finds it.
            question = " ".join(rng.choice(("why", "how", "tokens", "cache", "batch", "latency")) for _ in range(8))
            prompt = (SYSTEM_PROMPT if rng.random() < 0.5 else "") + question
            sampling = pb.SamplingParams(max_tokens=rng.randint(8, 96), temperature=0.8, ignore_eos=True)
            request = pb.GenerateRequest(prompt=prompt, sampling=sampling, priority=priority)
            try:
                for _ in self.daemon.generation.Generate(request, timeout=120):
                    pass
                outcome = "finished"
            except grpc.RpcError as error:
                outcome = "shed" if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
                time.sleep(0.5)  # a shed client backs off before it asks again
            with self._lock:
                self.counts[outcome] += 1


def evaluate(panel: Panel, scrapes: list[tuple[float, float, Samples]]) -> dict[str, tuple[list, list]]:
    """Each legend's line: (times, values), every query evaluated at every scrape a full window in."""
    lines: dict[str, tuple[list, list]] = {}
    start = 0
    for wall, now, samples in scrapes:
        while start + 1 < len(scrapes) and now - scrapes[start + 1][1] >= RATE_WINDOW_S:
            start += 1
        if now - scrapes[start][1] < RATE_WINDOW_S:
            continue
        window = Window(before=scrapes[start][2], now=samples, seconds=now - scrapes[start][1])
        for query in panel.queries:
            for legend, value in query.evaluate(window).items():
                times, values = lines.setdefault(legend, ([], []))
                times.append(datetime.datetime.fromtimestamp(wall))
                values.append(value)
    return lines


def _unit_formatter(unit: str) -> FuncFormatter:
    def seconds(value: float, _) -> str:
        return f"{value * 1e3:.0f} ms" if abs(value) < 1 else f"{value:.1f} s"

    formats = {
        "s": seconds,
        "percentunit": lambda value, _: f"{value * 100:.0f}%" if value >= 0.1 or value == 0 else f"{value * 100:.1f}%",
        "reqps": lambda value, _: f"{value:.1f} req/s",
        "short": lambda value, _: f"{value:.0f}" if abs(value) >= 10 or value == 0 else f"{value:.1f}",
    }
    return FuncFormatter(formats[unit])


def draw(scrapes: list[tuple[float, float, Samples]], out: Path, subtitle: str) -> None:
    columns = 3
    rows = -(-len(PANELS) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(18, 3.9 * rows + 0.8), facecolor=BACKGROUND)
    start, end = (datetime.datetime.fromtimestamp(scrapes[i][0]) for i in (0, -1))
    figure.suptitle("tokend", x=0.012, y=0.995, ha="left", color=TEXT, fontsize=17, fontweight="bold")
    figure.text(0.012, 0.968, f"Model: All    {start:%H:%M:%S} to {end:%H:%M:%S}    {subtitle}", color=MUTED,
                fontsize=10.5)  # fmt: skip
    for ax, panel in zip(axes.flat, PANELS, strict=False):
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_color(GRID)
        ax.grid(color=GRID, linewidth=0.8)
        ax.tick_params(colors=MUTED, labelsize=9)
        ax.set_title(panel.title, loc="left", color=TEXT, fontsize=12, pad=8)
        lines = evaluate(panel, scrapes)
        for color, (legend, (times, values)) in zip(PALETTE * 4, lines.items(), strict=False):
            ax.plot(times, values, color=color, linewidth=1.8, label=legend)
            ax.fill_between(times, values, color=color, alpha=0.08)
        if not lines:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=13)
        ax.set_xlim(start, end)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(_unit_formatter(panel.unit))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        if lines:
            legend = ax.legend(loc="upper left", bbox_to_anchor=(0, -0.1), ncol=4, frameon=False, fontsize=9.5)
            for text in legend.get_texts():
                text.set_color(TEXT)
    for ax in axes.flat[len(PANELS) :]:
        ax.set_visible(False)
    figure.tight_layout(rect=(0, 0, 1, 0.955), h_pad=2.2)
    figure.savefig(out, dpi=90, facecolor=BACKGROUND)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the load runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "grafana-dashboard.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokend-dashboard-") as scratch:
        config = Path(scratch) / "tokend.toml"
        config.write_text(DAEMON_CONFIG)
        with LocalDaemon("--config", str(config)) as daemon:
            scraper = Scraper(f"{daemon.http_url}/metrics")
            scraper.start()
            load = Load(daemon)
            time.sleep(RATE_WINDOW_S)  # an idle start, as a dashboard shows one
            load.run(PHASES, args.seconds)
            time.sleep(RATE_WINDOW_S)
            scraper.stop.set()
            scraper.join()
    counts = ", ".join(f"{number} {outcome}" for outcome, number in load.counts.items())
    print(f"requests: {counts}; {len(scraper.scrapes)} scrapes", flush=True)
    subtitle = f"rendered by scripts/render_dashboard.py from a real run: tokend-tiny-random on CPU; {counts}"
    draw(scraper.scrapes, args.out, subtitle)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
