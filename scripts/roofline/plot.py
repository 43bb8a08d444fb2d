"""The roofline's picture: per context length, milliseconds per decode step against the batch size."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_roofline(result: dict, path: Path) -> None:
    rows = result["decode"]
    contexts = sorted({row["context"] for row in rows})
    figure, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
    for axis, context in zip(axes[0], contexts, strict=True):
        at_context = [row for row in rows if row["context"] == context]
        for backend in dict.fromkeys(row["backend"] for row in at_context):
            points = [row for row in at_context if row["backend"] == backend]
            axis.plot([p["batch"] for p in points], [p["engine_ms"] for p in points], "o-", label=f"engine ({backend})")
        first = [row for row in at_context if row["backend"] == at_context[0]["backend"]]
        batches = [p["batch"] for p in first]
        axis.plot(batches, [p["chain_ms"] for p in first], "s--", label="weights-only matmul chain")
        axis.plot(batches, [p["engine_linears_chain_ms"] for p in first], "^--", label="the same, engine's linears")
        axis.plot(batches, [p["bound_ms"] for p in first], "k:", label="bound: max(bytes/bandwidth, FLOPs/peak)")
        axis.set(xscale="log", yscale="log", xlabel="batch (sequences decoding)", ylabel="ms per decode step",
                 title=f"{context}-token contexts")  # fmt: skip
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    machine = result["machine"]
    figure.suptitle(
        f"decode step, {result['shape']} model, {result['dtype']} on {result['device']} "
        f"({machine['gemm_gflops']} GFLOP/s GEMM, {machine['bandwidth_gb_s']} GB/s copy)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
