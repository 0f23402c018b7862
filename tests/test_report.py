"""report.html (`partc.report`) and the step's walk it draws (`partc.timeline`): the pictures hold the plan's
numbers, the walk ends where the cost model prices the step, nothing is fetched from the network, and a real
browser (headless Chromium, when installed) renders the page without a console message."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import EXAMPLES, ROOT
from partc import report, timeline
from partc.cli.main import main
from partc.cluster import Cluster
from partc.compile import compile_model
from partc.parallel import Pins

PLANS = {
    # name: (gpus, pins, global batch)
    "interleaved": (4, dict(tp=2, pp=2, dp=1, zero=1, micro_batch_size=1, schedule="interleaved-1f1b",
                            virtual_stages=2), 4),
    "1f1b": (4, dict(tp=1, pp=2, dp=2, zero=1, micro_batch_size=1, schedule="1f1b"), 8),
}


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("report")
    for name, (gpus, pins, gbs) in PLANS.items():
        compile_model(str(EXAMPLES / "gpt.py"), gpus=gpus, pins=Pins(**pins), global_batch_size=gbs,
                      out_dir=tmp / name)
    return {name: tmp / name for name in PLANS}


class Page(HTMLParser):
    """Every element of the page as (tag, attributes, the ids of its enclosing elements), and the CSS."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict, tuple]] = []
        self.css = ""
        self._stack: list[tuple[str, str | None]] = []
        self._in_style = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a, tuple(i for _, i in self._stack if i)))
        if tag not in ("rect", "line", "circle", "path", "polyline", "meta", "i", "br"):
            self._stack.append((tag, a.get("id")))
        self._in_style = tag == "style"

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), tuple(i for _, i in self._stack if i)))

    def handle_endtag(self, tag):
        while self._stack and tag not in ("rect", "line", "circle", "path", "polyline"):
            if self._stack.pop()[0] == tag:
                break
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.css += data

    def find(self, tag: str | None = None, cls: str | None = None, inside: str | None = None) -> list[dict]:
        return [a for t, a, ids in self.elements if (tag is None or t == tag)
                and (cls is None or cls in a.get("class", "").split()) and (inside is None or inside in ids)]


def page(out: Path) -> Page:
    return Page((out / "report.html").read_text())


def m_v(plan: dict) -> tuple[int, int]:
    par = plan["parallel"]
    v = par["virtual_stages"] if par["schedule"] == "interleaved-1f1b" else 1
    return par["global_batch_size"] // (par["dp"] * par["micro_batch_size"]), v


# --- the walk --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_walk_ends_where_the_cost_model_prices_the_pipeline(schedule):
    """Every rank runs each (micro-batch, chunk) forward and backward once, one at a time, each after its input;
    the walk ends at `pipeline_span` (walk asserts it too) for any F:B ratio."""
    for p in (2, 3, 4, 8):
        for v in ((2, 3, 4) if schedule == "interleaved-1f1b" else (1,)):
            for m in (range(p, 4 * p + 1, p) if v > 1 else (1, 2, p - 1, p, 2 * p + 1)):
                for fwd, bwd in ((1.0, 2.0), (1.0, 3.0), (0.7, 0.7), (2.0, 1.0)):
                    ranks = timeline.walk(schedule, p, v, m, fwd, bwd)
                    end = max(a.end for r in ranks for a in r)
                    assert end == pytest.approx((m + (p - 1) / v) * (fwd + bwd), rel=1e-12)
                    done = {}
                    for r, actions in enumerate(ranks):
                        assert sorted((a.forward, a.chunk, a.microbatch) for a in actions) == sorted(
                            (f, c, i) for f in (True, False) for c in range(v) for i in range(m))
                        assert all(b.start >= a.end - 1e-12 for a, b in zip(actions, actions[1:]))
                        done.update({(a.forward, a.chunk * p + r, a.microbatch): a for a in actions})
                    for (f, s, i), a in done.items():
                        before = done.get((True, s - 1, i)) if f else done.get((False, s + 1, i), done[(True, s, i)])
                        assert before is None or a.start >= before.end - 1e-12


def test_timeline_ends_at_the_predicted_step_time(outs):
    for out in outs.values():
        plan = json.loads((out / "plan.json").read_text())
        par, pred = plan["parallel"], plan["predicted"]
        m, v = m_v(plan)
        step = timeline.step(pred, par["schedule"], par["pp"], v, m)
        assert step.step_s == pytest.approx(pred["step_time_s"], rel=1e-12)
        bubble = pred["breakdown_s"]["bubble"]
        assert step.span_s == pytest.approx(pred["step_time_s"] - pred["breakdown_s"]["dp_comm"]
                                            - pred["breakdown_s"]["optimizer"], rel=1e-12)
        assert step.span_s - m * (step.slot_fwd_s + step.slot_bwd_s) == pytest.approx(bubble, rel=1e-9)


# --- the page ----------------------------------------------------------------------------------------------------------

def test_memory_bars_add_up_to_the_plan(outs):
    for out in outs.values():
        plan, html = json.loads((out / "plan.json").read_text()), page(out)
        usable = Cluster.from_dict(plan["cluster"]).usable_memory_bytes
        for r, rank in enumerate(plan["predicted"]["ranks"]):
            bars = [a for a in html.find("rect", "mem", inside="memory") if a["data-rank"] == str(r)]
            assert {a["data-kind"] for a in bars} == {"predicted"}
            got = {a["data-category"]: int(a["data-bytes"]) for a in bars}
            assert got == {c: rank["memory_bytes"][c] for c in report.CATEGORIES}
            assert abs(sum(got.values()) - rank["memory_bytes"]["total"]) <= len(got)  # each part rounded
        assert [int(a["data-bytes"]) for a in html.find("g") if a.get("id") == "usable"] == [int(usable)]


def test_timeline_holds_every_action_and_ends_at_the_step_time(outs):
    for out in outs.values():
        plan, html = json.loads((out / "plan.json").read_text()), page(out)
        pred, p = plan["predicted"], plan["parallel"]["pp"]
        m, v = m_v(plan)
        groups = html.find("g", "rank", inside="timeline")
        assert [int(g["data-rank"]) for g in groups] == list(range(p))
        assert all(int(g["data-actions"]) == 2 * m * v for g in groups)
        events = html.find("rect", "ev", inside="timeline")
        assert {(e["data-rank"], c) for e in events for c in e["class"].split()[1:]} == {
            (str(r), k) for r in range(p) for k in ("dp", "optimizer")}
        assert max(float(e["data-end"]) for e in events) == pytest.approx(pred["step_time_s"], rel=1e-12)
        ends = [float(a["data-step-s"]) for a in html.find("line", "step-end", inside="timeline")]
        assert ends == [pytest.approx(pred["step_time_s"], rel=1e-12)]
        parts = html.find("rect", "part", inside="breakdown")
        assert sum(float(a["data-seconds"]) for a in parts) == pytest.approx(pred["step_time_s"], rel=1e-9)


def test_a_step_of_many_micro_batches_stays_small(outs):
    """Thousands of micro-batches: the overview draws busy stretches, not each action; the views up close still
    draw them, and the page stays small."""
    plan = json.loads((outs["interleaved"] / "plan.json").read_text())
    plan["parallel"]["global_batch_size"] = 4096  # m = 4096, v = 2: 16,384 actions a rank
    text = report.render(plan)
    assert len(text) < 1_500_000
    html = Page(text)
    assert all(int(g["data-actions"]) == 2 * 4096 * 2 for g in html.find("g", "rank", inside="timeline"))
    assert not html.find("path", "fwd", inside="timeline") and html.find("path", "fwd", inside="timeline-start")


def test_every_alternative_is_a_point(outs, tmp_path):
    for out in outs.values():
        plan, html = json.loads((out / "plan.json").read_text()), page(out)
        points = html.find("g", "point", inside="alternatives")
        want = [(plan["predicted"]["step_time_s"], plan["predicted"]["memory_per_gpu"]["total"])] + [
            (a["step_time_s"], a["memory_bytes"]) for a in plan["alternatives"]]
        assert sorted((float(a["data-step-s"]), int(a["data-memory-bytes"])) for a in points) == sorted(want)
        assert [a for a in points if "chosen" in a["class"].split()] == [
            a for a in points if float(a["data-step-s"]) == want[0][0] and int(a["data-memory-bytes"]) == want[0][1]
        ][:1]
        assert len(plan["alternatives"]) >= 1


def test_tp_styles_of_one_block(outs):
    plan, html = json.loads((outs["interleaved"] / "plan.json").read_text()), page(outs["interleaved"])
    rows = html.find("tr", "tp-layer")  # the first block's layers, each with the plan's style
    assert sorted(r["data-layer"] for r in rows) == sorted(f for f in plan["tp"] if f.startswith("blocks.0."))
    assert all(plan["tp"][r["data-layer"]] == r["data-style"] for r in rows) and len(rows) >= 4
    assert not page(outs["1f1b"]).find("tr", "tp-layer")  # tp = 1: nothing split, no table


def test_no_network_reference(outs):
    """Nothing to fetch: no script, no stylesheet link, no attribute or CSS naming a URL."""
    for out in outs.values():
        text = (out / "report.html").read_text()
        html = Page(text)
        assert not html.find("script") and not html.find("link") and not html.find("img")
        for tag, attrs, _ in html.elements:
            for key, value in attrs.items():
                assert not re.search(r"(https?:)?//", value or "") or key == "d", (tag, key, value)
                if key in ("src", "href", "xlink:href"):
                    assert value.startswith("#"), (tag, key, value)
        assert "@import" not in html.css and not re.search(r"url\((?!#)", html.css)
        assert not re.search(r"https?://", text)


def test_check_draws_its_measurements_beside_the_bars(outs, tmp_path):
    """`render` with partc check's records: a measured bar beside each predicted one, with check's numbers, and the
    traffic by axis."""
    from partc.runtime.check import RankCheck

    plan = json.loads((outs["1f1b"] / "plan.json").read_text())
    measured = []
    for r, rank in enumerate(plan["predicted"]["ranks"]):
        mem = {c: int(rank["memory_bytes"][c] * (0.9 + 0.05 * r)) for c in ("params", "grads", "optimizer",
                                                                            "activations")}
        measured.append(RankCheck(rank=r * 2, coords={"pp": r, "dp": 0, "cp": 0, "tp": 0}, comm_bytes={"dp": 7, "tp": 0, "pp": 5},
                                  memory_bytes={**mem, "total": sum(mem.values())},
                                  predicted_comm_bytes=rank["comm_bytes"], predicted_memory_bytes=rank["memory_bytes"],
                                  usable_bytes=1e12, seconds=0.0).to_dict())
    html = Page(report.render(plan, measured=measured))
    for rec in measured:
        bars = [a for a in html.find("rect", "measured", inside="memory") if a["data-rank"] == str(rec["pp_rank"])]
        assert {a["data-category"]: int(a["data-bytes"]) for a in bars} == {
            c: v for c, v in rec["memory_bytes"].items() if c != "total"}
        rows = {a["data-axis"]: a for a in html.find("tr", "traffic") if a["data-rank"] == str(rec["pp_rank"])}
        assert {k: int(a["data-measured"]) for k, a in rows.items()} == {"dp": 7, "tp": 0, "pp": 5, "cp": 0}
        assert {k: int(a["data-predicted"]) for k, a in rows.items()} == rec["predicted_comm_bytes"]


def test_report_command_draws_the_log(outs, tmp_path):
    """`partc report OUT --log LOG`: the loss curve, the step time against the prediction, the memory peaks; records
    missing a field (or with fields this partc does not know) are drawn from what they have."""
    out = tmp_path / "out"
    shutil.copytree(outs["1f1b"], out)
    plan = json.loads((out / "plan.json").read_text())
    p = plan["parallel"]["pp"]
    records = [{"step": k, "loss": 5.0 - 0.5 * k, "step_time_s": 0.02 + 0.001 * k, "tokens_per_s": 1000.0,
                "grad_norm": 1.0, "lr": 3e-4, "something_new": [1, 2],
                "ranks": [{"rank": r, "pp_rank": r % p, "peak_memory_bytes": 1000 * (r + 1)} for r in range(4)]}
               for k in range(4)]
    records.append({"step": 4, "loss": None})  # no step time, no loss: skipped, not an error
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    result = CliRunner().invoke(main, ["report", str(out), "--log", str(log)])
    assert result.exit_code == 0, result.output
    html = page(out)
    loss = html.find("polyline", inside="loss")
    assert [int(a["data-points"]) for a in loss] == [4]
    summary = [a for t, a, _ in html.elements if a.get("id") == "step-time-summary"]
    assert float(summary[0]["data-measured-s"]) == pytest.approx((0.021 + 0.022 + 0.023) / 3)
    assert float(summary[0]["data-predicted-s"]) == plan["predicted"]["step_time_s"]
    mem = {int(a["data-rank"]): int(a["data-measured"]) for a in html.find("tr", "log-memory")}
    assert mem == {r: max(1000 * (g + 1) for g in range(4) if g % p == r) for r in range(p)}
    assert json.loads((out / "partc-output.json").read_text())["files"]["report.html"]  # partc's, replaceable


def test_report_command_errors_are_one_line(outs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(outs["1f1b"], out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss": 1.0}\nnot json\n')
    result = CliRunner().invoke(main, ["report", str(out), "--log", str(bad)])
    assert result.exit_code == 2 and re.search(r"error: .*bad\.jsonl:2 is not a JSON record", result.output)
    result = CliRunner().invoke(main, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "error: plan file" in result.output
    # A report.html changed since partc wrote it is not replaced.
    (out / "report.html").write_text("mine\n")
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 2 and "report.html was not written by partc or was changed since" in result.output
    assert (out / "report.html").read_text() == "mine\n"


@pytest.mark.slow
def test_partc_check_adds_what_it_measured(outs, tmp_path):
    """`partc check OUT` draws the report again with its measured memory and traffic: the same numbers as its JSON."""
    out = tmp_path / "out"
    shutil.copytree(outs["1f1b"], out)
    result = CliRunner().invoke(main, ["check", str(out), "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    checked = json.loads(result.stdout)["ranks"]
    html = page(out)
    for rec in checked:
        bars = [a for a in html.find("rect", "measured", inside="memory") if a["data-rank"] == str(rec["pp_rank"])]
        assert {a["data-category"]: int(a["data-bytes"]) for a in bars} == {
            c: v for c, v in rec["memory_bytes"].items() if c != "total"}
        rows = {a["data-axis"]: int(a["data-measured"]) for a in html.find("tr", "traffic")
                if a["data-rank"] == str(rec["pp_rank"])}
        assert rows == rec["comm_bytes"]


# --- a real browser ---------------------------------------------------------------------------------------------------

def _render_script():
    spec = importlib.util.spec_from_file_location("render_report", ROOT / "scripts" / "render_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # two Chromium launches: 5-15 s
@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_chromium_renders_the_report(outs, tmp_path):
    """The page loads in Chromium with nothing on its console, and the script's pictures are PNGs of the size it
    asked for."""
    script = _render_script()
    src = outs["interleaved"] / "report.html"
    done = script.run_chromium(["--dump-dom", src.as_uri()])
    assert done.returncode == 0, done.stderr
    assert script.console_lines(done.stderr) == []
    assert '<svg id="timeline"' in done.stdout and '<svg id="alternatives"' in done.stdout
    png = script.render(src, tmp_path, "tiny", names=["timeline"])[0]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == script.picture_page(src.read_text(), "timeline")[1:]
