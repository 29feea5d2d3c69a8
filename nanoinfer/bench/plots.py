"""PNG plots with matplotlib's Agg backend (no display needed)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def plot_roofline(path: str, peak_flops: float, peak_bandwidth: float, results: list[dict], title: str) -> None:
    """Attainable FLOP/s against arithmetic intensity (FLOP/byte), log-log: the slanted
    bandwidth roof meets the flat compute roof at the ridge, peak_flops / peak_bandwidth.
    Decode points sit far left (memory-bound) and move right as the batch grows."""
    points = []
    for r in results:
        b = r["batch_size"]
        points.append(("decode", b, r["decode_step_flops"] / r["decode_step_bytes"],
                       r["decode_step_flops"] / r["tpot_s"]))
        points.append(("prefill", b, r["prefill_flops"] / r["prefill_bytes"], r["prefill_flops"] / r["ttft_s"]))
    ridge = peak_flops / peak_bandwidth
    xs = [p[2] for p in points] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot([lo, ridge, hi], [lo * peak_bandwidth, peak_flops, peak_flops], color="black", lw=1.5,
            label=f"roofline ({peak_bandwidth / 1e9:.3g} GB/s, {peak_flops / 1e12:.3g} TFLOP/s)")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    for kind, marker, color in (("decode", "o", "tab:blue"), ("prefill", "s", "tab:orange")):
        sel = [p for p in points if p[0] == kind]
        ax.scatter([p[2] for p in sel], [p[3] for p in sel], marker=marker, color=color, label=kind, zorder=3)
        for _, b, x, y in sel:
            ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(5, -10 if kind == "prefill" else 5),
                        fontsize=8, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loop(path: str, uncached: list[tuple[int, float]], cached: list[tuple[int, float]], title: str) -> None:
    """Per-forward wall time against context length: the uncached loop grows with the
    context (it recomputes everything), the cached one stays nearly flat."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for series, label, color in ((uncached, "uncached (reference)", "tab:red"), (cached, "cached (engine)", "tab:blue")):
        ax.plot([c for c, _ in series], [s * 1e3 for _, s in series], label=label, color=color, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("wall time per forward (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(path: str, figures: dict[str, dict], title: str) -> None:
    """Output and total tok/s of each engine run on the same requests."""
    names = list(figures)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    width = 0.38
    for i, (key, label) in enumerate((("output_tok_s", "output tok/s"), ("total_tok_s", "total tok/s"))):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ys = [figures[n][key] for n in names]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
