"""``python -m fsdptx plan --html FILE``: one self-contained page of the traced step.

Per-rank memory over the step as stacked areas by category (forward per
unit, backward per unit, optimizer step) with the peak marked, the
collectives on the same time axis (FSDP all-gathers and reduce-scatters,
TP redistributions, replica all-reduces, the experts' all-to-alls), and the
plan's unit table. Under context parallelism a lane shows ring attention's
rotations per attention layer, modelled (no CPU kernel runs them) and
labelled so; with pipeline stages the page has one chart per stage, its
schedule's forwards and backwards and its P2P transfers on lanes. Inline
SVG and a few lines of JS for a readout under the pointer: no network, no
CDN, so the file opens anywhere, also on an air-gapped cluster.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._trace import CATEGORIES, RING_BUFFERS, Collective, Sample, where_label

__all__ = ["Lane", "Mark", "cp_lane", "render_html", "render_pipeline_html", "write_html", "write_pipeline_html"]

WIDTH, HEIGHT, LANE = 1100, 320, 18
MAX_POINTS = 1200
"""Samples drawn at most: each drawn point is the largest sample of its
bucket, so the peak survives downsampling."""

_COLORS = {
    "sharded_params": "#4c78a8",
    "sharded_grads": "#72b7b2",
    "optimizer_state": "#54a24b",
    "gathered_params": "#f58518",
    "all_gather_buffers": "#ffbf79",
    "unsharded_grads": "#e45756",
    "reduce_scatter_buffers": "#ff9d98",
    "activations": "#b279a2",
    "temporaries": "#d6a5c9",
    "buffers": "#9d755d",
    "inputs": "#bab0ac",
    RING_BUFFERS: "#eeca3b",
}
_OPS = {"all_gather": "#f58518", "reduce_scatter": "#e45756", "all_reduce": "#54a24b"}
_PHASES = {"forward": "#eef4fb", "backward": "#fbf0ee", "tp_sync": "#f6f0fb", "optimizer": "#eef8ec"}


@dataclass(frozen=True)
class Mark:
    """Something on a lane of the time axis, from sample ``start`` to
    ``end`` (the samples' ``index``), with a tooltip."""

    start: int
    end: int
    color: str
    title: str


@dataclass(frozen=True)
class Lane:
    """A row of marks under the chart, for what the trace's collectives do
    not show: modelled communication (CP's ring rotations) or a pipeline
    stage's schedule and its point-to-point transfers."""

    name: str
    marks: tuple[Mark, ...]


def _bucketed(samples: Sequence[Sample]) -> list[Sample]:
    step = max(1, -(-len(samples) // MAX_POINTS))
    return [max(samples[i : i + step], key=lambda s: s.total) for i in range(0, len(samples), step)]


def _x(index: int, last: int) -> float:
    return 60 + (WIDTH - 80) * index / max(1, last)


def _memory_svg(
    samples: Sequence[Sample], collectives: Sequence[Collective], peak_at: str, lanes: Sequence[Lane] = (), key: str = ""
) -> str:
    from ..core._sizes import format_bytes

    last = max([s.index for s in samples] + [c.index for c in collectives] + [1])
    top = max((s.total for s in samples), default=1) or 1
    keys = [k for k in (*CATEGORIES.values(), RING_BUFFERS) if any(s.bytes.get(k) for s in samples)]
    drawn = _bucketed(samples)
    parts: list[str] = []
    # phase bands
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].phase != samples[start].phase:
            x0, x1 = _x(samples[start].index, last), _x(samples[i - 1].index, last)
            color = _PHASES.get(samples[start].phase, "#f4f4f4")
            parts.append(f'<rect x="{x0:.1f}" y="20" width="{max(1.0, x1 - x0):.1f}" height="{HEIGHT}" fill="{color}"/>')
            parts.append(f'<text x="{x0 + 4:.1f}" y="34" class="phase">{samples[start].phase}</text>')
            start = i

    def y(v: float) -> float:
        return 20 + HEIGHT * (1 - v / top)

    below = [0] * len(drawn)
    for k in keys:
        upper = [b + s.bytes.get(k, 0) for b, s in zip(below, drawn)]
        pts = [f"{_x(s.index, last):.1f},{y(u):.1f}" for s, u in zip(drawn, upper)]
        pts += [f"{_x(s.index, last):.1f},{y(b):.1f}" for s, b in zip(reversed(drawn), reversed(below))]
        parts.append(f'<polygon points="{" ".join(pts)}" fill="{_COLORS[k]}" opacity="0.9"><title>{k}</title></polygon>')
        below = upper
    peak = max(samples, key=lambda s: s.total)
    px = _x(peak.index, last)
    parts.append(f'<line x1="{px:.1f}" y1="20" x2="{px:.1f}" y2="{20 + HEIGHT}" class="peak"/>')
    parts.append(
        f'<text x="{min(px + 4, WIDTH - 260):.1f}" y="16" class="peak-label">peak {html.escape(format_bytes(peak.total))}'
        f" ({html.escape(peak_at)})</text>"
    )
    for frac in (0.25, 0.5, 0.75, 1.0):
        parts.append(f'<text x="4" y="{y(top * frac) + 4:.1f}" class="axis">{html.escape(format_bytes(top * frac))}</text>')
    # units lane: one segment per run of samples in the same unit and phase
    uy = HEIGHT + 26
    parts.append(f'<text x="4" y="{uy + 10}" class="axis">units</text>')
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or (samples[i].phase, samples[i].unit) != (samples[start].phase, samples[start].unit):
            s0 = samples[start]
            x0, x1 = _x(s0.index, last), _x(samples[i - 1].index, last)
            shade = "#9ab" if (len(parts) % 2) else "#ccd"
            title = html.escape(where_label(s0))
            parts.append(
                f'<rect x="{x0:.1f}" y="{uy}" width="{max(1.0, x1 - x0):.1f}" height="{LANE - 6}" '
                f'fill="{shade}"><title>{title}</title></rect>'
            )
            start = i
    # collectives lanes, then the given ones
    sources = sorted({c.source for c in collectives})
    base = HEIGHT + 26 + LANE
    for n, source in enumerate(sources):
        ly = base + n * LANE
        parts.append(f'<text x="4" y="{ly + 12}" class="axis">{source}</text>')
        for c in (c for c in collectives if c.source == source):
            cx = _x(c.index, last)
            title = html.escape(f"{c.op} {format_bytes(c.bytes)} in the {where_label(Sample(c.index, c.phase, c.unit, {}))}")
            color = _OPS.get(c.op, "#888")
            parts.append(
                f'<rect x="{cx:.1f}" y="{ly}" width="2" height="{LANE - 4}" fill="{color}"><title>{title}</title></rect>'
            )
    base += max(1, len(sources)) * LANE
    for n, lane in enumerate(lanes):
        ly = base + n * LANE
        parts.append(f'<text x="4" y="{ly + 12}" class="axis">{html.escape(lane.name)}</text>')
        for mark in lane.marks:
            x0, x1 = _x(mark.start, last), _x(mark.end, last)
            parts.append(
                f'<rect x="{x0:.1f}" y="{ly}" width="{max(2.0, x1 - x0):.1f}" height="{LANE - 4}" fill="{mark.color}" '
                f'opacity="0.8"><title>{html.escape(mark.title)}</title></rect>'
            )
    height = base + len(lanes) * LANE + 10
    legend = "".join(
        f'<span class="key"><i style="background:{_COLORS[k]}"></i>{k}</span>' for k in keys
    ) + "".join(f'<span class="key"><i style="background:{c}"></i>{op}</span>' for op, c in _OPS.items())
    return (
        f'<svg id="step{key}" class="step" data-key="{key}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" aria-label="memory per rank over one training step">'
        + "".join(parts)
        + f'<line id="cursor{key}" x1="0" x2="0" y1="20" y2="{height}" class="cursor"/></svg>'
        + f'<div class="legend">{legend}</div>'
        + f'<div id="readout{key}" class="readout"></div>'
        + f'<script type="application/json" id="points{key}">{_safe_json(_points(samples, collectives))}</script>'
    )


def _points(samples: Sequence[Sample], collectives: Sequence[Collective]) -> list[list[object]]:
    """The readout under the pointer: x and what is held there, per drawn sample."""
    from ..core._sizes import format_bytes

    last = max([s.index for s in samples] + [c.index for c in collectives] + [1])
    return [[round(_x(s.index, last), 1), f"{where_label(s)}: {format_bytes(s.total)}"] for s in _bucketed(samples)]


def _table(data: dict[str, Any]) -> str:
    from ..core._sizes import format_bytes
    from ._common import _rows

    head = ("units", "kind", "storage->compute", "params/rank", "gathered", "reshard", "AG", "RS")
    rows = []
    for label, group in _rows(data["units"]):
        u = group[0]
        cells = (
            label,
            u["kind"],
            f"{u['storage_dtype']}->{u['compute_dtype']}",
            format_bytes(u["bytes_per_rank"]),
            format_bytes(u["gathered_bytes"]),
            str(u["reshard_after_forward"]),
            str(u["all_gathers"]),
            str(u["reduce_scatters"]),
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (
        "<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
        + "".join(rows) + "</tbody></table>"
    )


_SCRIPT = """
(function () {
  var charts = document.querySelectorAll("svg.step");
  charts.forEach(function (svg) {
    var key = svg.getAttribute("data-key"), cursor = document.getElementById("cursor" + key);
    var out = document.getElementById("readout" + key);
    var pts = JSON.parse(document.getElementById("points" + key).textContent);
    svg.addEventListener("mousemove", function (ev) {
      var box = svg.getBoundingClientRect(), x = (ev.clientX - box.left) * svg.viewBox.baseVal.width / box.width;
      var best = pts[0];
      for (var i = 0; i < pts.length; i++) { if (Math.abs(pts[i][0] - x) < Math.abs(best[0] - x)) { best = pts[i]; } }
      cursor.setAttribute("x1", best[0]); cursor.setAttribute("x2", best[0]);
      out.textContent = best[1];
    });
    out.textContent = pts.length + " samples; point at the chart for the memory at that moment";
  });
  document.body.setAttribute("data-ready", "1");
})();
"""

_STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} table{border-collapse:collapse;margin-top:16px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.phase{font-size:12px;fill:#555}.axis{font-size:11px;fill:#444}
.peak{stroke:#d00;stroke-width:2;stroke-dasharray:4 3}.peak-label{font-size:12px;fill:#d00;font-weight:bold}
.cursor{stroke:#000;stroke-width:1;opacity:.4}
.legend{margin:6px 0}.key{margin-right:12px;font-size:12px}
.key i{display:inline-block;width:10px;height:10px;margin-right:4px}
.readout{font-family:monospace;min-height:1.4em}
"""


def _safe_json(value: object) -> str:
    """JSON that cannot end the ``<script>`` element it sits in."""
    return json.dumps(value).replace("</", "<\\/")


def render_html(
    data: dict[str, Any], samples: Sequence[Sample], collectives: Sequence[Collective], lanes: Sequence[Lane] = ()
) -> str:
    """The page for report ``data`` (with traced ``"memory"``) and its trace.

    Args:
        data: the report as :func:`fsdptx.cli._main.report` returns it.
        samples: the traced memory samples.
        collectives: the traced collectives.
        lanes: rows of modelled events under the collectives (:func:`cp_lane`).

    Returns:
        The whole HTML document.
    """
    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    title = html.escape(f"fsdptx plan: {data['model']} on {mesh}")
    return _page(title, _intro(data["memory"]) + _memory_svg(samples, collectives, data["memory"]["peak_at"], lanes) + f"<h2>Plan</h2>{_table(data)}")


def _page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{title}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{title}</h1>{body}<script>{_SCRIPT}</script></body></html>"
    )


def _intro(m: dict[str, Any], what: str = "One training step per rank (rank 0)") -> str:
    """The step's figures and what was estimated instead of traced."""
    from ..core._sizes import format_bytes

    figures = [
        ("parameters", m["params_bytes"]),
        ("gradients", m["grads_bytes"]),
        ("optimizer state", m["optimizer_bytes"]),
        ("activations (end of forward)", m["activations_bytes"]),
        ("peak", m["peak_bytes"]),
    ]
    summary = "".join(f"<tr><th>{k}</th><td>{html.escape(format_bytes(v))}</td></tr>" for k, v in figures)
    notes = "".join(f"<li>estimated: {html.escape(n)}</li>" for n in m.get("estimated", ()))
    shape = f"batch {m['batch']}" if "batch" in m else f"micro-batches of {m['microbatch']}"
    return (
        f"<p>{html.escape(what)}, {shape} x seq {m['seq']} per data-parallel rank, "
        f"traced under FakeTensorMode. Peak {html.escape(format_bytes(m['peak_bytes']))} in the "
        f"{html.escape(m['peak_at'])}.</p>"
        f"<table>{summary}</table><ul>{notes}</ul>"
    )


def cp_lane(ring: Any, samples: Sequence[Sample]) -> Lane:
    """Ring attention's rotations on the time axis, per attention layer and
    phase where its FSDP unit runs: modelled (torch's ring attention has no
    CPU kernels, so the trace has none of its collectives), from the same
    :class:`fsdptx.cli._ring.RingAttention` that sizes its buffers.

    Forward receives K and V of the other ``cp - 1`` ranks' tokens (all at
    once under ``allgather``, a chunk pair per step under ``alltoall``);
    backward receives them again and passes the fp32 dK/dV chunks around
    the ring."""
    from ..core._sizes import format_bytes

    marks: list[Mark] = []
    share = (ring.cp - 1) / ring.cp
    for layer in ring.layers:
        kv = int(ring.batch * ring.seq * layer.kv_bytes_per_token * share)
        dkv = int(2 * ring.batch * ring.seq * layer.kv_width * 4 * share)
        for phase, received, color in (("forward", kv, "#eeca3b"), ("backward", kv + dkv, "#c9a227")):
            spans = [s.index for s in samples if s.phase == phase and s.unit == layer.unit]
            if not spans:
                continue
            what = "K/V" if phase == "forward" else "K/V again and the dK/dV chunks"
            marks.append(
                Mark(
                    min(spans),
                    max(spans),
                    color,
                    f"{layer.module} ({phase}): ring attention receives {what}, {format_bytes(received)} over "
                    f"cp={ring.cp} ({ring.rotate_method} rotation); modelled, not traced",
                )
            )
    return Lane(f"cp ring (modelled, {ring.rotate_method})", tuple(marks))


def _schedule_lanes(
    samples: Sequence[Any],
    actions: Sequence[tuple[str, int, int]],
    spans: Sequence[tuple[int, int]],
    received: Mapping[int, Any],
    sent: Mapping[int, Any],
    last_stage: int,
) -> tuple[Lane, ...]:
    """A traced pipeline rank's schedule (each forward and backward of a
    stage's micro-batch where it ran in the trace) and its point-to-point
    transfers: activations in before a forward and out after it, their
    gradients the other way round a backward. ``actions`` are
    ``(kind, stage, micro-batch)``; ``received``/``sent`` each stage's
    :class:`fsdptx.cli._stage_trace.ActivationMeta` (None at the ends)."""
    from ..core._sizes import format_bytes

    several = len(received) > 1
    marks, p2p = [], []
    for (kind, s, mb), (first, stop) in zip(actions, spans):
        if stop <= first:
            continue
        got = 0 if received[s] is None else received[s].nbytes
        out = 0 if sent[s] is None else sent[s].nbytes
        a, b = samples[first].index, samples[stop - 1].index
        forward = kind == "F"
        where = f" of stage {s}" if several else ""
        marks.append(Mark(a, b, "#9ecae9" if forward else "#fdae6b", f"{'forward' if forward else 'backward'}{where} of micro-batch {mb}"))
        recv = got if forward and s > 0 else out if not forward and s < last_stage else 0
        send = out if forward and s < last_stage else got if not forward and s > 0 else 0
        grad = "" if forward else "gradient of the "
        if recv:
            peer = s - 1 if forward else s + 1
            p2p.append(Mark(a, a, "#3182bd", f"receive the {grad}activations of micro-batch {mb} from stage {peer}: {format_bytes(recv)}"))
        if send:
            peer = s + 1 if forward else s - 1
            p2p.append(Mark(b, b, "#e6550d", f"send the {grad}activations of micro-batch {mb} to stage {peer}: {format_bytes(send)}"))
    return (Lane("schedule", tuple(marks)), Lane("pp p2p", tuple(p2p)))


def render_pipeline_html(data: dict[str, Any], run: Any) -> str:
    """The page of a pipelined dry run: each stage's traced step (its
    schedule's forwards and backwards, P2P transfers and collectives on
    its time axis), or each pipeline rank's where a rank runs several
    stages, the peak first named.

    Args:
        data: the report as :func:`fsdptx.cli._pipeline.pipeline_report` returns it.
        run: the traced :class:`fsdptx.cli._pipeline.PipelineRun`.

    Returns:
        The whole HTML document.
    """
    from ..core._sizes import format_bytes

    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    pipe = data["pipeline"]
    title = html.escape(f"fsdptx plan: {data['model']} on {mesh}")
    top = data["memory"]
    where = "" if top["peak_stage"] is None else f" in stage {top['peak_stage']}"
    body = (
        f"<p>{len(data['stages'])} pipeline stages on {pipe['size']} ranks, schedule {html.escape(pipe['schedule'])}, "
        f"{pipe['microbatches']} micro-batches; the busiest rank (pp rank {top['pp_rank']}) peaks at "
        f"{html.escape(format_bytes(top['peak_bytes']))}{where} ({html.escape(top['peak_at'])}).</p>"
    )
    last = len(data["stages"]) - 1
    if run.ranks:
        for traced, rank in zip(run.ranks, data["ranks"]):
            m = {**rank["memory"]["traced"]}
            stages = ", ".join(map(str, rank["stages"]))
            body += f"<h2>Pipeline rank {rank['rank']} (stages {stages}){' &mdash; the peak' if rank['rank'] == top['pp_rank'] else ''}</h2>"
            body += _intro(m, f"Pipeline rank {rank['rank']}'s step, its stages {stages} in the schedule's order")
            lanes = _schedule_lanes(traced.trace.samples, traced.actions, traced.spans, traced.received, traced.sent, last)
            body += _memory_svg(traced.trace.samples, traced.trace.collectives, m["peak_at"], lanes, key=f"r{rank['rank']}")
            for stage in (s for s in data["stages"] if s["rank"] == rank["rank"]):
                body += f"<h3>Units of stage {stage['index']}</h3>{_table(stage)}"
        return _page(title, body)
    for sr, stage in zip(run.stages, data["stages"]):
        m = stage["memory"]
        t = sr.trace
        body += f"<h2>Stage {stage['index']} (pp rank {stage['rank']}){' &mdash; the peak' if stage['index'] == top['peak_stage'] else ''}</h2>"
        body += _intro(m, f"Stage {stage['index']}'s step on one rank, every micro-batch of it")
        lanes = _schedule_lanes(
            t.trace.samples,
            [(kind, stage["index"], mb) for kind, mb in t.actions],
            t.spans,
            {stage["index"]: t.received},
            {stage["index"]: t.sent},
            last,
        )
        body += _memory_svg(t.trace.samples, t.trace.collectives, m["peak_at"], lanes, key=str(stage["index"]))
        body += f"<h3>Units</h3>{_table(stage)}"
    return _page(title, body)


def write_html(path: str, data: dict[str, Any], run: Any) -> None:
    """Write :func:`render_html` of a dry run that traced its step to ``path``."""
    from ._common import UsageError

    if run.trace is None:
        raise UsageError("--html needs a traced step; this dry run traced none")
    lanes = () if run.trace.ring is None else (cp_lane(run.trace.ring, run.trace.samples),)
    _write(path, render_html(data, run.trace.samples, run.trace.collectives, lanes))


def write_pipeline_html(path: str, data: dict[str, Any], run: Any) -> None:
    """Write :func:`render_pipeline_html` of a pipelined dry run that traced its stages to ``path``."""
    from ._common import UsageError

    if not run.ranks and any(s.trace is None for s in run.stages):
        raise UsageError("--html needs a traced step; this dry run traced none")
    _write(path, render_pipeline_html(data, run))


def _write(path: str, page: str) -> None:
    from ._common import UsageError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise UsageError(f"cannot write --html {path!r}: {e.strerror}; choose a writable path") from None
