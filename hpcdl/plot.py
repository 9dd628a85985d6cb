"""matplotlib, imported only when a command draws, and PNGs written the way every hpcdl file is."""

from __future__ import annotations

import os

from hpcdl.errors import DataError


def pyplot(command: str):
    """matplotlib.pyplot on the Agg backend, or an error naming ``command`` and the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DataError(f"{command} needs matplotlib ({exc}); pip install 'hpcdl[plot]'") from None
    return plt


def save_png(fig, out: str) -> str:
    """Write ``fig`` to a temporary name beside ``out``, then rename it; close the figure."""
    import matplotlib.pyplot as plt

    tmp = f"{out}.tmp.png"
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def counts_axis(axes, counts: list[int], label: str) -> None:
    """An x axis of rank or node counts on each of ``axes``: each count a tick, base-2 log when they span
    more than 8x; a grid and a legend."""
    counts = sorted(counts)
    for ax in axes:
        ax.set_xlabel(label)
        if counts[-1] / counts[0] > 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
