"""``OUT/report.html``: a plan as pictures, one self-contained file (inline SVG and CSS, nothing fetched, no script),
so it opens on a cluster's login node as well as on a laptop.

1. One step as a timeline per pipeline rank (`partc.timeline`, the walk the cost model prices): each forward and
   backward of a micro-batch through a chunk, split into compute, tensor-parallel collectives and the pipeline
   send/receive; the wait for the slowest rank; the exposed data-parallel traffic and the optimizer step; the
   predicted step time at the end.
2. Memory per pipeline rank, stacked by category, against the GPU's usable memory; `partc check`'s measurements
   beside each bar, and its traffic beside the predicted traffic.
3. The step-time breakdown; the alternatives the search ranked as a scatter of step time against memory (the
   chosen plan marked, the memory limit drawn); the tensor-parallel style of each layer of one block.
4. With a training log (`partc run --log-jsonl`): the loss curve and the measured step time and memory against
   the predicted (`partc.report_log`).

`render` takes plain data (``Plan.to_dict()``, `partc check`'s rank records, the log's records), so the compiler and
the commands that measure draw the same report. Every drawn quantity carries its number in ``data-`` attributes
(tests/test_report.py reads them back).
"""

from __future__ import annotations

import bisect
import json
import math
import operator
from pathlib import Path

from partc import output, timeline
from partc.cluster import Cluster
from partc.errors import PartcError
from partc.plan import read_plan
from partc.parallel import REQUIRED_AXES, SHOWN_AXES
from partc.report_draw import (BREAKDOWN, CATEGORIES, CATEGORY_NAMES, COLORS, CSS, OFF_SCALE, STYLE_COLORS, _axis,
                               _bytes, _e, _legend, _mem_unit, _nice_ticks, _num, _secs, _svg, _tick, _ticks_between)
from partc.report_log import _log


# --- 1. The timeline --------------------------------------------------------------------------------------------

def _step_of(plan: dict) -> tuple[timeline.Step, int, int, int]:
    par = plan["parallel"]
    p = par["pp"]
    v = par.get("virtual_stages", 1) if par["schedule"] == "interleaved-1f1b" else 1
    m = par["global_batch_size"] // (par["dp"] * par["micro_batch_size"])
    return timeline.step(plan["predicted"], par["schedule"], p, v, m), p, v, m


_START, _END = operator.attrgetter("start"), operator.attrgetter("end")

DETAIL_MAX = 4000
"""The most actions of one rank a view draws one by one; beyond, it draws the stretches the rank is busy (a step of
thousands of micro-batches would otherwise make a report of tens of megabytes, and pixels too thin to see)."""


def _timeline_svg(step: timeline.Step, p: int, v: int, id_: str, t_lo: float, t_hi: float,
                  width: int = 1200, title: str = "") -> str:
    """The ranks' rows between `t_lo` and `t_hi` seconds. Each part (a forward's compute, its TP collectives, ...)
    of a rank is one path; the slots a rank holds are drawn under them as runs (the wait for the slowest rank)."""
    left, right, top = 80, 70, 26
    row = 26 if p <= 16 else max(8, 420 // p)
    gap = 4 if row >= 16 else 1
    height = top + p * row + 40
    scale = (width - left - right) / (t_hi - t_lo)
    x = lambda t: left + (min(max(t, t_lo), t_hi) - t_lo) * scale  # noqa: E731
    body = [f'<defs><clipPath id="{id_}-clip"><rect x="{left}" y="0" width="{width - left - right}" '
            f'height="{height}"/></clipPath></defs>',
            f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{p * row}" fill="{COLORS["idle"]}"/>',
            f'<text x="{left}" y="{top - 8}" fill="#333" font-weight="bold">{_e(title)}</text>']
    ticks = _nice_ticks(t_hi - t_lo, 8 if width >= 1000 else 4)
    tick_step = ticks[1] if len(ticks) > 1 else 1.0
    for k in range(math.ceil(t_lo / tick_step - 1e-9), int(t_hi / tick_step + 1e-9) + 1):
        t = k * tick_step
        if t_lo - 1e-12 <= t <= t_hi * 1.0001:
            body.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{top + p * row}" stroke="#fff"/>'
                        f'<text x="{x(t):.1f}" y="{top + p * row + 14}" text-anchor="middle" fill="#555">'
                        f'{_e(_tick(t))}</text>')
    for rs in step.ranks:
        y, h = top + rs.rank * row, row - gap
        # A rank runs one action at a time (each starts at or after the previous one's end): those in view are
        # one run of the list, found by bisection (a step of many micro-batches has hundreds of thousands).
        seen = rs.actions[bisect.bisect_right(rs.actions, t_lo, key=_END):
                          bisect.bisect_left(rs.actions, t_hi, key=_START)]
        body.append(f'<text x="{left - 8}" y="{y + h / 2 + 4:.1f}" text-anchor="end">pp rank {rs.rank}</text>'
                    f'<g class="rank" data-rank="{rs.rank}" data-actions="{len(rs.actions)}" '
                    f'clip-path="url(#{id_}-clip)">')
        runs: list[list[float]] = []  # the rank's slots, contiguous ones merged
        tol = 1e-12 * step.step_s
        for a in seen:
            if runs and abs(a.start - runs[-1][1]) <= tol:
                runs[-1][1] = a.end
            else:
                runs.append([a.start, a.end])
        detail = len(seen) <= DETAIL_MAX
        body.append(f'<path fill="{COLORS["wait" if detail else "busy"]}" d="'
                    + "".join(f"M{x(s):.1f} {y}H{x(e):.1f}v{h}H{x(s):.1f}z" for s, e in runs) + '"/>')
        paths: dict[str, list[str]] = {}
        for a in (seen if detail else ()):
            kind = "fwd" if a.forward else "bwd"
            t0 = a.start
            for part in timeline.PARTS:
                d = (rs.fwd if a.forward else rs.bwd).get(part, 0.0) / v
                if d > 0 and d * scale >= 0.05:
                    key = kind if part == "compute" else part
                    paths.setdefault(key, []).append(f"M{x(t0):.1f} {y}h{max(0.1, d * scale):.1f}v{h}h"
                                                     f"{-max(0.1, d * scale):.1f}z")
                t0 += d
        for key, d in paths.items():
            body.append(f'<path class="part {key}" fill="{COLORS[key]}" d="{"".join(d)}"/>')
        for a in (seen if h >= 14 else ()):
            if (a.end - a.start) * scale >= 14:
                body.append(f'<text x="{x((a.start + a.end) / 2):.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" '
                            f'fill="#fff" font-size="9">{a.microbatch if v == 1 else f"{a.microbatch}"}</text>')
        for kind, (s, e), color in (("dp", rs.dp, COLORS["dp"]), ("optimizer", rs.optimizer,
                                                                    COLORS["optimizer_step"])):
            if e > t_lo and s < t_hi:
                body.append(f'<rect class="ev {kind}" data-rank="{rs.rank}" data-start="{_num(s)}" '
                            f'data-end="{_num(e)}" x="{x(s):.1f}" y="{y}" width="{max(0.5, x(e) - x(s)):.1f}" '
                            f'height="{h}" fill="{color}"><title>'
                            f'{"exposed data-parallel traffic" if kind == "dp" else "optimizer step"}: {_secs(e - s)}'
                            f'</title></rect>')
        body.append("</g>")
    if t_lo <= step.step_s <= t_hi * 1.0001:
        end = x(step.step_s)
        body.append(f'<line class="step-end" data-step-s="{_num(step.step_s)}" x1="{end:.1f}" x2="{end:.1f}" '
                    f'y1="{top - 14}" y2="{top + p * row + 4}" stroke="{COLORS["limit"]}" stroke-width="1.5"/>'
                    f'<text x="{end + 4:.1f}" y="{top - 6}" fill="{COLORS["limit"]}">step</text>'
                    f'<text x="{end + 4:.1f}" y="{top + 6}" fill="{COLORS["limit"]}">{_e(_secs(step.step_s))}</text>')
    return _svg(width, height, body, id_, f' data-step-s="{_num(step.step_s)}" data-span-s="{_num(step.span_s)}" '
                                          f'data-from-s="{_num(t_lo)}" data-to-s="{_num(t_hi)}"')


def _timeline(plan: dict) -> str:
    par = plan["parallel"]
    if not all("timeline_s" in r for r in plan["predicted"].get("ranks", [])):
        return ('<p class="note">This plan.json was written by a partc without the step\'s timeline: compile it '
                'again (partc compile --from-plan OUT/plan.json) to draw it.</p>')
    step, p, v, m = _step_of(plan)
    slot = step.slot_fwd_s + step.slot_bwd_s
    legend = _legend([("forward", COLORS["fwd"]), ("backward (+ recomputation)", COLORS["bwd"]),
                      ("TP collectives", COLORS["tp"]), ("pipeline send/receive", COLORS["pp"]),
                      ("waiting for the slowest rank", COLORS["wait"]),
                      ("DP traffic (exposed)", COLORS["dp"]), ("optimizer step", COLORS["optimizer_step"]),
                      ("idle (bubble)", COLORS["idle"])])
    out = [legend, _timeline_svg(step, p, v, "timeline", 0.0, step.step_s, title="the whole step")]
    # A long step (many micro-batches) in one picture shows bands; its start and end, closer, show the schedule.
    zoom = (p - 1 + 2 * p) * slot / v
    if zoom < 0.4 * step.step_s:
        out.append(f'<p class="note">The first {_secs(zoom)} and the last {_secs(zoom)}, closer:</p>')
        out.append(_timeline_svg(step, p, v, "timeline-start", 0.0, zoom, 600, f"the first {_secs(zoom)}")
                   + _timeline_svg(step, p, v, "timeline-end", step.step_s - zoom, step.step_s, 600,
                                   f"the last {_secs(zoom)}"))
    if 2 * m * v > DETAIL_MAX:
        out.append(f'<p class="note">The whole step holds {2 * m * v:,} forwards and backwards a rank, too many to '
                   f'draw one by one: its overview shows the stretches each rank is busy (grey-blue); the closer views '
                   f'show the actions.</p>')
    sched = par["schedule"] + (f", {v} chunks a rank" if v > 1 else "")
    out.append(
        f'<p class="note">One training step of one GPU per pipeline rank ({_e(sched)}, {m} micro-batches of '
        f'{par["micro_batch_size"]}), walked in the schedule\'s order: an action starts when its rank is free and '
        f'its input has arrived. As the cost model does, the slowest rank sets the pace (a forward of a chunk takes '
        f'{_secs(step.slot_fwd_s / v)}, a backward {_secs(step.slot_bwd_s / v)}); a faster rank waits out the rest '
        f'of each slot. Numbers in the boxes are micro-batches. The pipeline ends at {_secs(step.span_s)}; then the '
        f'exposed data-parallel traffic, and the optimizer step once every rank\'s traffic is done: the step ends at '
        f'{_secs(step.step_s)}, the predicted step time.</p>')
    return "".join(out)


# --- 2. Memory ---------------------------------------------------------------------------------------------------

def _memory(plan: dict, usable: float, measured: list[dict] | None) -> str:
    ranks = plan["predicted"]["ranks"]
    p = len(ranks)
    by_rank = {r["pp_rank"]: r for r in measured or []}
    data_top = max([r["memory_bytes"]["total"] for r in ranks] +
                   [sum(r["memory_bytes"].get(c, 0) for c in CATEGORIES) for r in by_rank.values()])
    on_scale = usable <= OFF_SCALE * data_top  # else the bars would be slivers under a far limit
    unit, unit_name = _mem_unit(max(data_top, usable if on_scale else 0.0))
    ticks = _nice_ticks(max(data_top, usable if on_scale else 0.0) / unit * 1.05, 6)
    left, top, plot_h = 70, 20, 300
    bar = 34 if p <= 16 else max(4, 640 // p // (2 if measured else 1))
    group = bar * (2 if measured else 1) + max(6, bar // 2)
    width = max(520, left + p * group + 220)
    height = top + plot_h + 48
    y = lambda b: top + plot_h - b / unit / ticks[-1] * plot_h  # noqa: E731
    body = []
    for t in ticks:
        body.append(f'<line x1="{left}" x2="{width - 200}" y1="{y(t * unit):.2f}" y2="{y(t * unit):.2f}" '
                    f'stroke="#e4e4e4"/><text x="{left - 6}" y="{y(t * unit) + 4:.2f}" text-anchor="end" fill="#555">'
                    f'{t:g} {unit_name}</text>')

    def stack(x0: float, values: dict, kind: str, rank: int) -> None:
        base = 0.0
        for c in CATEGORIES:
            n = values.get(c)
            if n is None:
                continue
            body.append(f'<rect class="mem {kind}" data-kind="{kind}" data-rank="{rank}" data-category="{c}" '
                        f'data-bytes="{int(n)}" x="{x0:.1f}" y="{y(base + n):.2f}" width="{bar}" '
                        f'height="{max(0.0, y(base) - y(base + n)):.2f}" fill="{COLORS[c]}"'
                        + (' fill-opacity="0.55" stroke="#333" stroke-width="0.6"' if kind == "measured" else "")
                        + f'><title>{kind} {CATEGORY_NAMES[c]}: {_bytes(n)}</title></rect>')
            base += n

    for r, rank in enumerate(ranks):
        x0 = left + 8 + r * group
        stack(x0, rank["memory_bytes"], "predicted", r)
        if p <= 16:
            body.append(f'<text x="{x0 + bar / 2:.1f}" y="{y(rank["memory_bytes"]["total"]) - 4:.1f}" '
                        f'text-anchor="middle" fill="#333" font-size="10">'
                        f'{rank["memory_bytes"]["total"] / unit:.3g}</text>')
        if r in by_rank:
            stack(x0 + bar, {c: by_rank[r]["memory_bytes"].get(c) for c in CATEGORIES if c != "buffers"}, "measured", r)
        label = f"{r}" if p > 16 else f"rank {r}"
        body.append(f'<text x="{x0 + bar * (2 if measured else 1) / 2:.1f}" y="{top + plot_h + 14}" '
                    f'text-anchor="middle" fill="#555">{label}</text>')
    body.append(f'<g id="usable" data-bytes="{int(usable)}">' + (
                f'<line x1="{left}" x2="{width - 200}" y1="{y(usable):.2f}" y2="{y(usable):.2f}" '
                f'stroke="{COLORS["limit"]}" stroke-dasharray="6 3" stroke-width="1.5"/>'
                f'<text x="{width - 196}" y="{y(usable) + 4:.2f}" fill="{COLORS["limit"]}">usable {_bytes(usable)}</text>'
                if on_scale else f'<text x="{width - 196}" y="{top + 4}" fill="{COLORS["limit"]}">usable '
                                 f'{_bytes(usable)}: far above</text>') + "</g>"
                f'<text x="{left + (width - 200 - left) / 2}" y="{top + plot_h + 34}" text-anchor="middle" fill="#555">'
                f'pipeline rank{" (left: predicted, right: measured by partc check)" if measured else ""}</text>')
    svg = _svg(width, height, body, "memory")
    legend = _legend([(CATEGORY_NAMES[c], COLORS[c]) for c in CATEGORIES])
    rows = "".join(
        f'<tr><td>{r}</td>' + "".join(f'<td class="n">{_bytes(rank["memory_bytes"][c])}</td>' for c in CATEGORIES)
        + f'<td class="n"><b>{_bytes(rank["memory_bytes"]["total"])}</b></td>'
        + (f'<td class="n">{_bytes(by_rank[r]["memory_bytes"]["total"])}</td>' if r in by_rank else
           ("<td></td>" if measured else "")) + "</tr>" for r, rank in enumerate(ranks))
    head = ("<tr><th>pp rank</th>" + "".join(f'<th class="n">{_e(CATEGORY_NAMES[c])}</th>' for c in CATEGORIES)
            + '<th class="n">total</th>' + ('<th class="n">measured peak</th>' if measured else "") + "</tr>")
    note = ('<p class="note">Measured bars: the most each category held at any moment of one step on fake tensors '
            '(partc check); the tracker does not see the communicators\' buffers.</p>' if measured else "")
    return legend + svg + note + f"<table>{head}{rows}</table>"


def _traffic(measured: list[dict]) -> str:
    """Predicted and measured collective payload per pipeline rank and mesh axis (partc check)."""
    rows = []
    for r in sorted(measured, key=lambda r: r["pp_rank"]):
        for axis in SHOWN_AXES:
            pred = float(r.get("predicted_comm_bytes", {}).get(axis, 0))
            got = float(r.get("comm_bytes", {}).get(axis, 0))
            scale = max(pred, got, 1.0)
            err = (got - pred) / scale if max(pred, got) else 0.0
            bars = "".join(f'<div style="background:{c};height:6px;width:{160 * n / scale:.1f}px;margin:1px 0"></div>'
                           for n, c in ((pred, "#9ab"), (got, COLORS["measured"])))
            rows.append(f'<tr class="traffic" data-rank="{r["pp_rank"]}" data-axis="{axis}" data-predicted="{pred:.0f}" '
                        f'data-measured="{got:.0f}"><td>{r["pp_rank"]}</td><td>{axis}</td>'
                        f'<td class="n">{_bytes(pred)}</td><td class="n">{_bytes(got)}</td>'
                        f'<td class="n{" bad" if abs(err) > 0.1 else ""}">{err:+.1%}</td><td>{bars}</td></tr>')
    return ('<table><tr><th>pp rank</th><th>axis</th><th class="n">predicted</th><th class="n">measured</th>'
            '<th class="n">error</th><th>grey: predicted, black: measured</th></tr>' + "".join(rows) + "</table>")


# --- 3. Breakdown, alternatives, tensor-parallel styles -----------------------------------------------------------

def _breakdown(plan: dict) -> str:
    pred = plan["predicted"]
    parts = pred.get("breakdown_s", {})
    total = pred["step_time_s"]
    width, left = 1000, 10
    scale = (width - 2 * left) / total
    body, x0 = [], float(left)
    for key, name in BREAKDOWN:
        s = parts.get(key, 0.0)
        w = s * scale
        body.append(f'<rect class="part" data-part="{key}" data-seconds="{_num(s)}" x="{x0:.2f}" y="4" width="{w:.2f}" '
                    f'height="26" fill="{COLORS[key]}"><title>{_e(name)}: {_secs(s)}</title></rect>')
        if w > 60:
            body.append(f'<text x="{x0 + w / 2:.2f}" y="21" text-anchor="middle" fill="#fff">{s / total:.0%}</text>')
        x0 += w
    svg = _svg(width, 36, body, "breakdown", f' data-step-s="{_num(total)}"')
    rows = "".join(f'<tr><td><i style="display:inline-block;width:10px;height:10px;background:{COLORS[k]}"></i> '
                   f'{_e(n)}</td><td class="n">{_secs(parts.get(k, 0.0))}</td>'
                   f'<td class="n">{parts.get(k, 0.0) / total:.1%}</td></tr>' for k, n in BREAKDOWN)
    return (svg + f'<table>{rows}<tr><td><b>step</b></td><td class="n"><b>{_secs(total)}</b></td><td></td></tr>'
            '</table><p class="note">The step on the slowest pipeline rank: m micro-batches of its compute and '
            'communication, the fill and drain of the pipeline, then the exposed data-parallel traffic and the '
            'optimizer step of the slowest rank.</p>')


def _summary(par: dict) -> str:
    """The plan's one line, as `Parallel.summary` writes it for the CLI (sequence parallelism, ep, precision...),
    from the plan's dict as it is (a report draws whatever plan it is given)."""
    text = " ".join(f"{a}={par.get(a, 1)}" for a in SHOWN_AXES if a in REQUIRED_AXES or par.get(a, 1) != 1)
    text += f" zero={par['zero']} mb={par['micro_batch_size']} recompute={par['recompute']} {par['schedule']}"
    text += f" v={par['virtual_stages']}" if par.get("virtual_stages", 1) > 1 else ""
    text += " sp" if par.get("sequence_parallel") else ""
    text += "+regather" if par.get("sp_regather") else ""
    text += " fused" if par.get("fuse_pointwise") else ""
    text += f" ep={par['ep']}" if par.get("ep", 1) > 1 else ""
    text += f" imbalance={par['expert_imbalance']:g}" if par.get("ep", 1) > 1 and \
        par.get("expert_imbalance", 1.0) != 1.0 else ""
    return text + (f" {par['precision']}" if par.get("precision", "bf16") != "bf16" else "")


def _alternatives(plan: dict, usable: float) -> str:
    pred = plan["predicted"]
    points = [("chosen", _summary(plan["parallel"]), pred["step_time_s"], pred["memory_per_gpu"]["total"])]
    points += [("alt", _summary(a["parallel"]), a["step_time_s"], a["memory_bytes"]) for a in plan["alternatives"]]
    left, top, pw, ph = 80, 20, 640, 320
    width, height = left + pw + 40, top + ph + 50 + 16 * len(points)
    # Axes around the points (the plans the search ranked lie close together), memory up to the limit unless it is
    # far beyond them.
    mem_hi = max(pt[3] for pt in points)
    on_scale = usable <= OFF_SCALE * mem_hi
    unit, unit_name = _mem_unit(max(mem_hi, usable if on_scale else 0.0))
    x_lo, x_hi = _axis(min(pt[3] for pt in points) / unit, max(usable if on_scale else 0.0, mem_hi) / unit)
    y_lo, y_hi = _axis(min(pt[2] for pt in points), max(pt[2] for pt in points))
    x = lambda b: left + (b / unit - x_lo) / (x_hi - x_lo) * pw  # noqa: E731
    y = lambda s: top + ph - (s - y_lo) / (y_hi - y_lo) * ph  # noqa: E731
    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for t in _ticks_between(x_lo, x_hi):
        body.append(f'<line x1="{x(t * unit):.1f}" x2="{x(t * unit):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                    f'<text x="{x(t * unit):.1f}" y="{top + ph + 14}" text-anchor="middle" fill="#555">{t:g}</text>')
    for t in _ticks_between(y_lo, y_hi):
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#eee"/>'
                    f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end" fill="#555">{_e(_tick(t))}</text>')
    body.append(f'<g id="limit" data-bytes="{int(usable)}">' + (
                f'<line x1="{x(usable):.1f}" x2="{x(usable):.1f}" y1="{top}" y2="{top + ph}" '
                f'stroke="{COLORS["limit"]}" stroke-dasharray="6 3" stroke-width="1.5"/>'
                f'<text x="{x(usable) - 4:.1f}" y="{top + 12}" text-anchor="end" fill="{COLORS["limit"]}">usable '
                f'memory {_bytes(usable)}</text>' if on_scale else
                f'<text x="{left + pw - 4}" y="{top + 12}" text-anchor="end" fill="{COLORS["limit"]}">usable memory '
                f'{_bytes(usable)}: far to the right</text>') + "</g>"
                f'<text x="{left + pw / 2}" y="{top + ph + 34}" text-anchor="middle" fill="#555">memory per GPU '
                f'({unit_name})</text><text x="16" y="{top + ph / 2}" fill="#555" transform="rotate(-90 16 {top + ph / 2})" '
                f'text-anchor="middle">step time</text>')
    for i, (kind, label, s, b) in reversed(list(enumerate(points))):
        cx, cy = x(b), y(s)
        shape = (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="8" fill="{COLORS["limit"]}" stroke="#000"/>' if kind == "chosen"
                 else f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="#4e79a7" fill-opacity="0.8"/>')
        body.append(f'<g class="point {kind}" data-step-s="{_num(s)}" data-memory-bytes="{int(b)}">{shape}'
                    f'<title>{_e(label)}: {_secs(s)}, {_bytes(b)}</title>'
                    f'<text x="{cx + 10:.1f}" y="{cy + 4:.1f}" fill="#333">{i if kind == "alt" else "chosen"}</text></g>')
    for i, (kind, label, s, b) in enumerate(points):  # the key, under the plot (it travels with the picture)
        body.append(f'<text x="{left}" y="{top + ph + 56 + 16 * i}" fill="#333"><tspan font-weight="bold">'
                    f'{"chosen" if kind == "chosen" else i}</tspan>  {_e(label)}: {_e(_secs(s))}, {_e(_bytes(b))}'
                    f'</text>')
    rows = "".join(f'<tr><td>{"chosen" if kind == "chosen" else i}</td><td>{_e(label)}</td>'
                   f'<td class="n">{_secs(s)}</td><td class="n">{_bytes(b)}</td></tr>'
                   for i, (kind, label, s, b) in enumerate(points))
    svg = _svg(width, height, body, "alternatives")
    note = ("" if plan["alternatives"] else
            '<p class="note">No alternatives: the plan was read back (--from-plan), not searched.</p>')
    return (svg + note + '<table><tr><th></th><th>plan</th><th class="n">step time</th><th class="n">memory per GPU'
            f'</th></tr>{rows}</table>')


def _block_layers(plan: dict) -> tuple[str, list[str]]:
    """The first module of the plan's stages that holds two or more layers (one block), and its layers."""
    tp = plan.get("tp", {})
    best: tuple[str, list[str]] = ("", [])
    for stage in plan["stages"]:
        for module in stage["modules"]:
            layers = [f for f in tp if f.startswith(module + ".")]
            if len(layers) >= 2:
                return module, layers
            if layers and not best[1]:
                best = (module, layers)
    return best


def _tp_styles(plan: dict) -> str:
    module, layers = _block_layers(plan)
    if not layers or plan["parallel"]["tp"] == 1:
        return '<p class="note">No layer is split: tensor parallelism is off (tp = 1).</p>'
    why = plan.get("tp_why", {})
    rows = "".join(f'<tr class="tp-layer" data-layer="{_e(f)}" data-style="{_e(plan["tp"][f])}"><td>{_e(f)}</td>'
                   f'<td><span class="style" style="background:{STYLE_COLORS.get(plan["tp"][f], "#777")}">'
                   f'{_e(plan["tp"][f])}</span></td><td>{_e(why.get(f, ""))}</td></tr>' for f in layers)
    return (f'<p class="note">The layers of {_e(module)} (tp = {plan["parallel"]["tp"]}); the other blocks '
            f'are alike unless the plan says otherwise (plan.json: tp).</p>'
            f'<table><tr><th>layer</th><th>style</th><th>why</th></tr>{rows}</table>')




# --- 4. A training log: reading it (`partc.report_log` draws it) ---------------------------------------------------

def read_log(path: str | Path) -> list[dict]:
    """The records of a ``partc run --log-jsonl`` file (one JSON object a line; blank lines skipped)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PartcError(f"cannot read the log {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise PartcError(f"{path}:{n} is not a JSON record") from None
        if not isinstance(rec, dict):
            raise PartcError(f"{path}:{n} is not a JSON object")
        out.append(rec)
    return out


# --- The page ------------------------------------------------------------------------------------------------------

def render(plan: dict, *, measured: list[dict] | None = None, log: list[dict] | None = None) -> str:
    """The report of `plan` (``Plan.to_dict()``), with `partc check`'s rank records (``RankCheck.to_dict()``) and a
    training log's records (`read_log`) where given."""
    par, pred, model = plan["parallel"], plan["predicted"], plan.get("model", {})
    usable = Cluster.from_dict(plan["cluster"]).usable_memory_bytes
    world = par["dp"] * par["tp"] * par["pp"]
    unit = model.get("throughput_unit", "tokens")
    rate = pred.get(f"{unit}_per_s", pred.get("tokens_per_s", 0.0))
    kv = [("model", f"{model.get('name', '?')} ({model.get('num_params', 0) / 1e9:.2f} B parameters)"),
          ("cluster", f"{world} GPUs, {plan['cluster'].get('name', '')} ({plan['cluster'].get('gpus_per_node', '?')} "
                      f"a node), usable memory {_bytes(usable)} a GPU"),
          ("plan", _summary(par) + f", global batch {par['global_batch_size']}"),
          ("predicted step", f"{_secs(pred['step_time_s'])}, {rate:,.0f} {unit}/s, MFU {pred.get('mfu', 0):.1%}, "
                             f"bubble {pred.get('bubble_fraction', 0):.1%}"),
          ("memory per GPU", f"{_bytes(pred['memory_per_gpu']['total'])} (the fullest pipeline rank)")]
    head = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in kv)
    parts = [f"<h1>partc plan: {_e(model.get('name', ''))}</h1>",
             f'<table class="kv">{head}</table>',
             '<section id="s-timeline"><h2>One step, per pipeline rank</h2>' + _timeline(plan) + "</section>",
             '<section id="s-memory"><h2>Memory per pipeline rank</h2>' + _memory(plan, usable, measured) + "</section>"]
    if measured:
        parts.append('<section id="s-traffic"><h2>Traffic per step (partc check)</h2>' + _traffic(measured) + "</section>")
    parts += ['<section id="s-breakdown"><h2>Step time</h2>' + _breakdown(plan) + "</section>",
              '<section id="s-alternatives"><h2>Alternatives</h2>' + _alternatives(plan, usable) + "</section>",
              '<section id="s-tp"><h2>Tensor parallelism in one block</h2>' + _tp_styles(plan) + "</section>"]
    if log is not None:
        parts.append('<section id="s-log"><h2>Training log</h2>' + _log(plan, log) + "</section>")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<title>partc plan: {_e(model.get("name", ""))}</title><style>{CSS}</style></head><body>'
            + "\n".join(parts) + "\n</body></html>\n")


def write(out_dir: str | Path, *, measured: list[dict] | None = None, log: list[dict] | None = None) -> Path:
    """Draw ``OUT/report.html`` again from ``OUT/plan.json``, with measurements (`render`); returns its path."""
    path = Path(out_dir) / "plan.json"
    read_plan(path)  # a clear error for a missing or broken plan
    return output.write_report(out_dir, render(json.loads(path.read_text()), measured=measured, log=log))


def read_check(path: str | Path) -> list[dict]:
    """The rank records of ``partc check --format json`` saved to a file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PartcError(f"cannot read partc check's JSON {path}: {e}") from None
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, dict) and "pp_rank" in r and "memory_bytes" in r
                                              for r in ranks):
        raise PartcError(f"{path} is not the output of partc check --format json")
    return ranks
