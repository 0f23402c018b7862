"""Section 4 of ``report.html``: a training log (``partc run --log-jsonl``) drawn against the plan: the loss curve,
the measured step time and MFU against the predicted, and the per-rank memory peaks against the plan's.

Apart from `partc.report` because it draws measurements of a run, not the plan: the records it reads may lack any
field (it draws what a record has), and its line charts are drawn nowhere else.
"""

from __future__ import annotations

import math

from partc.report_draw import COLORS, _bytes, _e, _nice_ticks, _num, _secs, _svg


def _line_chart(id_: str, series: list[tuple[str, list[tuple[float, float]], str]], y_label: str,
                hline: tuple[float, str] | None = None, fmt=lambda v: f"{v:g}") -> str:
    pts = [pt for _, s, _ in series for pt in s]
    if not pts:
        return ""
    left, top, pw, ph = 80, 14, 560, 220
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    ys = [p[1] for p in pts] + ([hline[0]] if hline else [])
    y_hi = max(ys) * 1.08 if max(ys) > 0 else 1.0
    y_lo = min(0.0, min(ys))
    xs = lambda v: left + (v - x_lo) / max(x_hi - x_lo, 1e-12) * pw  # noqa: E731
    yv = lambda v: top + ph - (v - y_lo) / (y_hi - y_lo) * ph  # noqa: E731
    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for t in _nice_ticks(y_hi, 5):
        if t >= y_lo:
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yv(t):.1f}" y2="{yv(t):.1f}" stroke="#eee"/>'
                        f'<text x="{left - 6}" y="{yv(t) + 4:.1f}" text-anchor="end" fill="#555">{_e(fmt(t))}</text>')
    for name, s, color in series:
        d = " ".join(f"{xs(a):.1f},{yv(b):.1f}" for a, b in s)
        body.append(f'<polyline class="series" data-name="{_e(name)}" data-points="{len(s)}" points="{d}" fill="none" '
                    f'stroke="{color}" stroke-width="1.6"/>')
        if len(s) == 1:
            body.append(f'<circle cx="{xs(s[0][0]):.1f}" cy="{yv(s[0][1]):.1f}" r="3" fill="{color}"/>')
    if hline:
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yv(hline[0]):.1f}" y2="{yv(hline[0]):.1f}" '
                    f'stroke="{COLORS["limit"]}" stroke-dasharray="6 3"/><text x="{left + pw + 4}" '
                    f'y="{yv(hline[0]) + 4:.1f}" fill="{COLORS["limit"]}">{_e(hline[1])}</text>')
    body.append(f'<text x="{left + pw / 2}" y="{top + ph + 30}" text-anchor="middle" fill="#555">step</text>'
                f'<text x="{left}" y="{top + ph + 14}" fill="#555">{x_lo:g}</text>'
                f'<text x="{left + pw}" y="{top + ph + 14}" text-anchor="end" fill="#555">{x_hi:g}</text>'
                f'<text x="14" y="{top + ph / 2}" fill="#555" transform="rotate(-90 14 {top + ph / 2})" '
                f'text-anchor="middle">{_e(y_label)}</text>')
    return _svg(left + pw + 200, top + ph + 40, body, id_)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _log(plan: dict, records: list[dict]) -> str:
    pred = plan["predicted"]
    recs = [r for r in records if _finite(r.get("step"))]
    loss = [(r["step"], r["loss"]) for r in recs if _finite(r.get("loss"))]
    times = [(r["step"], r["step_time_s"]) for r in recs if _finite(r.get("step_time_s"))]
    out = []
    if loss:
        out.append("<h3>Loss</h3>" + _line_chart("loss", [("loss", loss, "#4e79a7")], "loss"))
    if times:
        later = [t for _, t in times[1:]] or [t for _, t in times]  # the first step warms up
        mean = sum(later) / len(later)
        err = (mean - pred["step_time_s"]) / pred["step_time_s"]
        out.append("<h3>Step time</h3>" + _line_chart(
            "step-time", [("measured", times, "#333")], "seconds",
            (pred["step_time_s"], f"predicted {_secs(pred['step_time_s'])}"), fmt=_secs)
            + f'<p class="note" id="step-time-summary" data-measured-s="{_num(mean)}" '
              f'data-predicted-s="{_num(pred["step_time_s"])}">Measured {_secs(mean)} a step (mean of '
              f'{len(later)} step{"s" if len(later) != 1 else ""}{" after the first" if len(times) > 1 else ""}), '
              f'predicted {_secs(pred["step_time_s"])}: {err:+.1%}.</p>')
    mfu = [(r["step"], r["mfu"]) for r in recs if _finite(r.get("mfu"))]
    if mfu:
        out.append("<h3>MFU</h3>" + _line_chart("mfu", [("measured", mfu, "#333")], "MFU",
                                                (pred["mfu"], f"predicted {pred['mfu']:.1%}"), fmt=lambda v: f"{v:.0%}"))
    last = next((r for r in reversed(recs) if isinstance(r.get("ranks"), list)), None)
    peaks: dict[int, float] = {}
    for rank in (last or {}).get("ranks") or []:
        if isinstance(rank, dict) and _finite(rank.get("peak_memory_bytes")) and _finite(rank.get("pp_rank")):
            peaks[rank["pp_rank"]] = max(peaks.get(rank["pp_rank"], 0.0), rank["peak_memory_bytes"])
    if peaks:
        mems = [r["memory_bytes"] for r in pred["ranks"]]
        rows = "".join(f'<tr class="log-memory" data-rank="{r}" data-measured="{peaks[r]:.0f}" '
                       f'data-predicted="{mems[r]["total"]}"><td>{r}</td><td class="n">{_bytes(mems[r]["total"])}</td>'
                       f'<td class="n">{_bytes(mems[r]["total"] - mems[r].get("buffers", 0))}</td>'
                       f'<td class="n">{_bytes(peaks[r])}</td></tr>' for r in sorted(peaks) if 0 <= r < len(mems))
        out.append('<h3>Memory</h3><table><tr><th>pp rank</th><th class="n">predicted</th><th class="n">predicted '
                   'without the communicators\' buffers</th><th class="n">measured peak (the most any GPU of the '
                   f'rank allocated; the allocator does not see those buffers)</th></tr>{rows}</table>')
    if not out:
        out.append('<p class="note">The log holds no step with a loss, a step time or a memory peak.</p>')
    return "".join(out)
