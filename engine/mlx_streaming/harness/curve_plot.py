"""The pool-size curve of a routing trace as a PNG (``plan --trace FILE --plot OUT.png``).

matplotlib is the optional ``plot`` extra (``pip install 'mlx-streaming[plot]'``); nothing else imports it. The
figure: hit rate (left axis) and the I/O-bound decode rate at the given disk rate (right axis, log scale)
against the pool's size in MB, with the machine's memory marked where it falls on the axis (else named in the
title: every pool of the model fits).
"""

from __future__ import annotations

from pathlib import Path

import psutil

from ..errors import ConfigError, OutputError

#: Written into the PNG's text chunk: the file is known as this project's when it is replaced.
SOFTWARE = "mlx-streaming plan --trace"


def write_plot(rows: list, out, disk_gbps: float, pin_hot: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'mlx-streaming[plot]'") from None
    out = Path(out).absolute()
    if out.suffix.lower() != ".png":
        raise OutputError(f"--plot {out}: name the file to write *.png")
    if out.is_dir() or (out.exists() and SOFTWARE.encode() not in out.read_bytes()[:4096]):
        raise OutputError(f"--plot {out}: exists and was not written by mlx-streaming; give a new file name "
                          f"(nothing was changed)")
    pool_mb = [r["pool_bytes"] / 1e6 for r in rows]
    memory_mb = psutil.virtual_memory().total / 1e6
    fig, hits = plt.subplots(figsize=(8, 5), dpi=120)
    hits.plot(pool_mb, [r["hit_rate"] for r in rows], color="tab:blue", marker=".", label="hit rate")
    hits.set_xlabel("expert pool, all MoE layers (MB)")
    hits.set_ylabel("hit rate (routed experts already resident)", color="tab:blue")
    hits.set_ylim(0, 1)
    rate = hits.twinx()
    finite = [(mb, r["io_bound_tok_s"]) for mb, r in zip(pool_mb, rows) if r["io_bound_tok_s"] != float("inf")]
    rate.plot([mb for mb, _ in finite], [v for _, v in finite], color="tab:red", marker=".",
              label=f"I/O-bound decode rate at {disk_gbps:g} GB/s")
    rate.set_yscale("log")
    rate.set_ylabel(f"decode tokens/s the disk allows at {disk_gbps:g} GB/s", color="tab:red")
    title = "pool size vs hit rate and disk-bound decode rate" + (f" ({pin_hot} hot experts pinned)" if pin_hot else "")
    if memory_mb <= 1.5 * pool_mb[-1]:
        hits.axvline(memory_mb, color="black", linestyle="--", label=f"this machine's memory ({memory_mb / 1e3:.1f} GB)")
    else:
        title += f"\nthis machine's memory ({memory_mb / 1e3:.1f} GB) is beyond every pool size: all experts fit"
    hits.set_title(title, fontsize=10)
    hits.grid(alpha=0.3)
    lines = hits.get_legend_handles_labels(), rate.get_legend_handles_labels()
    hits.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="center right", fontsize=8)
    fig.tight_layout()
    partial = out.parent / f".{out.name}.partial.png"
    fig.savefig(partial, metadata={"Software": SOFTWARE})
    plt.close(fig)
    partial.replace(out)
