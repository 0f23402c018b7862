"""The drawing vocabulary of ``report.html`` (`partc.report`, `partc.report_log`): the categories and their colours,
the page's CSS, number and unit formats, axis ticks and the SVG frame.

Apart from the sections so that every picture of the report formats a second, a byte and a tick the same way, and
so that `partc.report` reads as the list of its sections.
"""

from __future__ import annotations

import html
import math

GiB = 2 ** 30
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
CATEGORY_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
                  "activations": "activations and working memory", "buffers": "communicator buffers"}
COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759",
          "buffers": "#9c755f",
          "fwd": "#4e79a7", "bwd": "#59a14f", "tp": "#f28e2b", "pp": "#b07aa1", "dp": "#e15759",
          "optimizer_step": "#9c755f", "wait": "#cdd5df", "busy": "#7f9fb5", "idle": "#f2f2f2",
          "compute": "#4e79a7", "tp_comm": "#f28e2b", "pp_comm": "#b07aa1", "bubble": "#bab0ac", "dp_comm": "#e15759",
          "limit": "#d62728", "measured": "#333333"}
BREAKDOWN = (("compute", "compute"), ("tp_comm", "tensor-parallel collectives"), ("pp_comm", "pipeline send/receive"),
             ("bubble", "pipeline bubble"), ("dp_comm", "data-parallel traffic (exposed)"),
             ("optimizer", "optimizer step"))
STYLE_COLORS = {"colwise": "#4e79a7", "rowwise": "#f28e2b", "replicate": "#bab0ac", "vocab": "#59a14f"}

CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px;
       color: #222; max-width: 1240px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.sub { color: #555; font-size: 13px; } .note { color: #555; font-size: 12px; max-width: 1150px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
td, th { border-bottom: 1px solid #e4e4e4; padding: 3px 10px; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.kv td:first-child { color: #555; } .bad { color: #c0392b; font-weight: bold; }
.legend { font-size: 12px; margin: 4px 0 6px 0; } .legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px;
            border: 1px solid #0002; }
svg text { font-family: inherit; } .style { padding: 1px 6px; border-radius: 3px; color: #fff; font-size: 11px; }
section { break-inside: avoid; }
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(x: float) -> str:
    """A number for a ``data-`` attribute: exact enough to compare with plan.json."""
    return repr(float(x))


def _secs(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def _tick(t: float) -> str:
    """An axis label in seconds: as few digits as the value needs."""
    if t == 0:
        return "0"
    return f"{t:.6g} s" if t >= 1 else f"{t * 1e3:.6g} ms"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _nice_ticks(hi: float, n: int = 6) -> list[float]:
    """About `n` round tick values from 0 to at least `hi`."""
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 2.5, 5, 10) if k * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step - 1e-9)) + 1)]


OFF_SCALE = 4.0
"""A memory limit more than this many times the largest bar is written, not drawn (the bars would be slivers)."""


def _mem_unit(top: float) -> tuple[float, str]:
    """The unit of a memory axis reaching `top` bytes."""
    for name, scale in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if top >= scale:
            return float(scale), name
    return 1.0, "B"


def _axis(lo: float, hi: float) -> tuple[float, float]:
    """A plotting range around [lo, hi] with a margin (a tenth of the span, or of the value when they are equal)."""
    pad = (hi - lo) * 0.1 or abs(hi) * 0.05 or 1.0
    return max(0.0, lo - pad), hi + pad


def _ticks_between(lo: float, hi: float, n: int = 6) -> list[float]:
    step = _nice_ticks(hi - lo, n)[1] if hi > lo else 1.0
    return [k * step for k in range(math.ceil(lo / step - 1e-9), int(hi / step + 1e-9) + 1)]


def _legend(items) -> str:
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_e(name)}</span>'
                                            for name, c in items) + "</div>"


def _svg(width: int, height: int, body: list[str], id_: str, attrs: str = "") -> str:
    return (f'<svg id="{id_}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-size="11"{attrs}>' + "".join(body) + "</svg>")
