"""Plots as PNG bytes, drawn off-screen: what the run report and a draft's evaluation embed."""

from __future__ import annotations

import io
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(figure: Any) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    pyplot().close(figure)
    return buffer.getvalue()
