"""``qtool verify --report``: the verify report as one self-contained HTML page.

Inline CSS and a few lines of inline script (the tensor table sorts by a click on its header and
filters by name or op type), no external asset; the per-layer SQNR plot is a PNG in a data: URI,
drawn with matplotlib when it is installed (the ``report`` extra) and replaced by a note when it
is not.
"""

from __future__ import annotations

import base64
import io
import math
from html import escape

from . import __version__
from .analyze import Analysis
from .verify import ANALYSIS_TOP, VerifyReport, format_diff, tolerance_rule

NO_PLOT = "No plot: matplotlib is not installed (pip install 'qtool[report]')."

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       max-width: 1180px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 12px; }
h2 { font-size: 17px; margin: 30px 0 8px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
.badge { display: inline-block; padding: 1px 12px; border-radius: 12px; color: #fff; font-size: 15px;
         font-weight: 600; vertical-align: 2px; margin-left: 8px; }
.pass { background: #1a7f37; } .fail { background: #cf222e; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; margin: 0; }
dt { color: #59636e; } dd { margin: 0; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eaeef2; text-align: left; white-space: nowrap; }
th { background: #f6f8fa; border-bottom: 1px solid #d0d7de; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.name { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
td.reason { white-space: normal; }
tr.worst td { background: #ffebe9; }
.tag { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px; font-weight: 600;
       background: #cf222e; color: #fff; }
.ran-float { color: #bc4c00; font-weight: 600; } .ran-input { color: #59636e; }
.note { color: #59636e; font-size: 13px; }
ul.failures { color: #cf222e; margin: 6px 0 0; }
img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
footer { margin: 32px 0 8px; color: #59636e; font-size: 12px; }
#tensors th { cursor: pointer; } #tensors th:hover { text-decoration: underline; }
input.filter { font: inherit; padding: 2px 6px; margin: 0 0 6px; width: 320px; }
"""

# sort the tensor table by a click on a column's header (again: the other way), filter its rows by
# the text typed (tensor name or op type); numbers sort as numbers
_SCRIPT = """
const table = document.getElementById("tensors");
const rows = () => Array.from(table.tBodies[0].rows);
table.tHead.addEventListener("click", (event) => {
  const th = event.target.closest("th"); if (!th) return;
  const col = th.cellIndex, up = th.dataset.up !== "1"; th.dataset.up = up ? "1" : "0";
  const key = (r) => { const t = r.cells[col].textContent, v = parseFloat(t); return isNaN(v) ? t : v; };
  const sorted = rows().sort((a, b) => { const x = key(a), y = key(b);
    return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1); });
  sorted.forEach((r) => table.tBodies[0].appendChild(r));
});
document.getElementById("tensor-filter").addEventListener("input", (event) => {
  const text = event.target.value.toLowerCase();
  rows().forEach((r) => { r.hidden = !(r.cells[1].textContent + " " + r.cells[2].textContent)
    .toLowerCase().includes(text); });
});
"""

# how the plot shows each kind of tensor: (label, colour, marker)
_KINDS = {"integer": ("integer kernel", "#0969da", "o"),
          "float": ("float, then quantized", "#e16f24", "s"),
          "input": ("model input", "#6e7781", "D")}


def render_html(report: VerifyReport, model: str, qmodel: str) -> str:
    """The whole page for ``report``; ``model`` and ``qmodel`` are the file names for the header."""
    status = "PASS" if report.passed else "FAIL"
    badge = f"<span class=\"badge {status.lower()}\">{status}</span>"
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             f"<title>qtool verify: {escape(qmodel)} {status}</title>\n<style>{_CSS}</style>\n"
             f"</head>\n<body>\n<h1>qtool verify {badge}</h1>",
             _header(report, model, qmodel),
             "<h2>Outputs: float model vs integer executor</h2>", _outputs_table(report)]
    if report.ort is not None:
        parts += ["<h2>onnxruntime on the quantized model</h2>", _ort_table(report)]
    if report.analysis is not None:
        parts += ["<h2>Sensitivity (qtool analyze)</h2>", _analysis_block(report.analysis)]
    parts += ["<h2>SQNR along the graph</h2>", _plot_block(report),
              "<h2>Tensors in graph order</h2>", _layer_samples(report) + _tensor_table(report),
              "<h2>Nodes that ran in float</h2>", _float_nodes(report.float_nodes),
              f"<footer>qtool {escape(__version__)}</footer>\n<script>{_SCRIPT}</script>\n</body>\n</html>\n"]
    return "\n".join(parts)


def _header(report: VerifyReport, model: str, qmodel: str) -> str:
    rows = [("float model", f"<span class=\"name\">{escape(model)}</span> (onnxruntime)"),
            ("quantized model", f"<span class=\"name\">{escape(qmodel)}</span> (integer executor)"),
            ("samples", str(report.samples)),
            ("tolerance", escape(tolerance_rule(report.tolerance, bool(report.parts))))]
    if report.accuracy:
        a = report.accuracy
        rows.append((f"top-1 on '{escape(a['labels'])}'",
                     f"float {a['float']:.2f}%, integer {a['integer']:.2f}% "
                     f"({a['integer'] - a['float']:+.2f} points)"))
    worst = report.worst()
    if worst:
        names = ", ".join(f"<span class=\"name\">{escape(n)}</span>" for n in worst)
        rows.append(("worst layers", names))
    for key, value in sorted(report.made.items()):  # how the quantized model was made
        rows.append((escape(key.removeprefix("qtool.").replace("_", " ")), f"<span class=\"name\">{escape(value)}</span>"))
    text = "<dl>\n" + "\n".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "\n</dl>"
    if report.failures:
        items = "".join(f"<li>{escape(f)}</li>" for f in report.failures)
        text += f"\n<ul class=\"failures\">{items}</ul>"
    return text


def _outputs_table(report: VerifyReport) -> str:
    """Each output, then the parts of the Concat it joins (each scored where its values land)."""
    rows = []
    for c in report.outputs:
        shown = [(escape(c.name), c)]
        joined = report.parts.get(c.name)
        if joined is not None and not joined.unplaced:
            shown += [(f"&nbsp;&nbsp;part {escape(p.name)} (Concat {escape(joined.join.node)})", p)
                      for p in joined.parts]
        rows += [f"<tr><td class=\"name\">{label}</td><td class=\"num\">{x.cosine:.6f}</td>"
                 f"<td class=\"num\">{_db(x.sqnr)}</td></tr>" for label, x in shown]
    return _table(["output", ("cosine", "num"), ("SQNR dB", "num")], rows)


def _ort_table(report: VerifyReport) -> str:
    rows = []
    for c in report.ort:
        rows.append(f"<tr><td class=\"name\">{escape(c.name)}</td>"
                    f"<td class=\"num\">{c.vs_float.cosine:.6f}</td>"
                    f"<td class=\"num\">{_db(c.vs_float.sqnr)}</td>"
                    f"<td class=\"num\">{escape(format_diff(c))}</td>"
                    f"<td class=\"num\">{100 * c.equal_fraction:.2f}%</td></tr>")
    head = ["output", ("cosine vs float", "num"), ("SQNR dB vs float", "num"),
            ("max |diff| vs executor", "num"), ("equal elements", "num")]
    return (_table(head, rows) + "\n<p class=\"note\">The same samples through onnxruntime on the "
            "quantized model (default optimizations, which fuse QDQ groups into its own integer "
            "kernels): against the float model, and element by element against the integer "
            "executor's outputs.</p>")


def _analysis_block(analysis: Analysis) -> str:
    summary = (f"<p>SQNR of {escape(analysis.scored)} against the float model on {analysis.samples} "
               f"samples: fully "
               f"quantized <b>{_db(analysis.quantized_db)} dB</b>, weights only "
               f"{_db(analysis.weights_only_db)} dB, activations only "
               f"{_db(analysis.activations_only_db)} dB.</p>")
    rows = [f"<tr><td class=\"num\">{rank}</td><td class=\"name\">{escape(o.node)}</td>"
            f"<td>{escape(o.op_type)}</td><td class=\"num\">{_db(o.only_quantized_db)}</td>"
            f"<td class=\"num\">{_db(o.only_float_db)}</td><td class=\"num\">{_gain(o.gain_db)}</td></tr>"
            for rank, o in enumerate(analysis.ops[:ANALYSIS_TOP], 1)]
    head = [("rank", "num"), "node", "op type", ("SQNR dB, only this op quantized", "num"),
            ("SQNR dB, only this op float", "num"), ("gain dB", "num")]
    note = ("Gain: the output SQNR with only that op left float minus the fully quantized SQNR; the "
            "first ops are the ones to keep float (qtool quantize --keep-float) or give finer steps. "
            "Measured by onnxruntime on variants of the QDQ model, graph optimizations off.")
    more = len(analysis.ops) - ANALYSIS_TOP
    if more > 0:
        note += f" {more} more ops in the --json report."
    if analysis.skipped:
        expanded = sum(g.count for g in analysis.groups if g.expanded)
        note += (f" Scored one by one: the {expanded} ops of the groups of consecutive ops that gained most "
                 f"left float together; {analysis.skipped} other ops were not (qtool analyze --all-ops).")
    return f"{summary}\n{_table(head, rows)}\n<p class=\"note\">{escape(note)}</p>"


def _layer_samples(report: VerifyReport) -> str:
    """Says on how many samples the tensors were compared, when not on all of them."""
    if report.layer_samples is None or report.layer_samples >= report.samples:
        return ""
    return (f"<p class=\"note\">Compared on {report.layer_samples} of the {report.samples} samples, in "
            f"batches spread over them (the outputs on every sample; qtool verify --layers all: every "
            f"sample).</p>\n")


def _tensor_table(report: VerifyReport) -> str:
    worst = set(report.worst())
    rows = []
    for i, c in enumerate(report.tensors):
        op = c.op_type + ("+Relu" if c.clamped else "")
        marked = c.name in worst
        tag = " <span class=\"tag\">worst</span>" if marked else ""
        row_class = ' class="worst"' if marked else ""
        rows.append(f"<tr{row_class}><td class=\"num\">{i}</td>"
                    f"<td class=\"name\">{escape(c.name)}{tag}</td><td>{escape(op)}</td>"
                    f"<td class=\"ran-{escape(c.ran)}\">{escape(c.ran)}</td>"
                    f"<td class=\"num\">{c.cosine:.6f}</td><td class=\"num\">{_db(c.sqnr)}</td>"
                    f"<td class=\"num\">{c.max_lsb:.2f}</td></tr>")
    head = [("#", "num"), "tensor", "op type", "ran", ("cosine", "num"), ("SQNR dB", "num"),
            ("max |diff| LSB", "num")]
    text = ("<input class=\"filter\" id=\"tensor-filter\" placeholder=\"filter by tensor or op type\">\n"
            + _table(head, rows, "tensors")
            + "\n<p class=\"note\">Click a column's header to sort by it.</p>")
    if any(c.clamped for c in report.tensors):
        text += ("\n<p class=\"note\">+Relu: quantized with the range of the Relu that reads it, "
                 "so compared after it.</p>")
    return text


def _float_nodes(nodes: list[tuple[str, str, str]]) -> str:
    if not nodes:
        return "<p>None: every node ran on integer kernels.</p>"
    rows = [f"<tr><td>{escape(op_type)}</td><td class=\"name\">{escape(name)}</td>"
            f"<td class=\"reason\">{escape(reason)}</td></tr>" for op_type, name, reason in nodes]
    return _table(["op type", "node", "reason"], rows)


def _table(head: list, rows: list[str], table_id: str | None = None) -> str:
    cells = "".join(f"<th class=\"{h[1]}\">{escape(h[0])}</th>" if isinstance(h, tuple)
                    else f"<th>{escape(h)}</th>" for h in head)
    body = "\n".join(rows)
    opening = f"<table id=\"{table_id}\">" if table_id else "<table>"
    return f"{opening}\n<thead><tr>{cells}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"


def _db(x: float) -> str:
    if math.isfinite(x):
        return f"{x:.2f}"
    return "&infin; (exact)" if x > 0 else "&minus;&infin;"


def _gain(x: float) -> str:
    if math.isfinite(x):
        return f"{x:+.2f}"
    return "+&infin;" if x > 0 else "&minus;&infin;"


def _plot_block(report: VerifyReport) -> str:
    png = sqnr_plot(report)
    if png is None:
        return f"<p class=\"note\">{escape(NO_PLOT)}</p>"
    data = base64.b64encode(png).decode("ascii")
    note = "x: the tensor's # in the table below; the worst layers are named."
    if any(math.isinf(c.sqnr) for c in report.tensors):
        note += (" An exact match (infinite SQNR) is drawn as a triangle at the top edge, a zero "
                 "reference with a nonzero error (minus infinity) at the bottom.")
    return (f"<img src=\"data:image/png;base64,{data}\" alt=\"SQNR in dB of each tensor, in graph "
            f"order\">\n<p class=\"note\">{escape(note)}</p>")


def sqnr_plot(report: VerifyReport) -> bytes | None:
    """Per-tensor SQNR along the graph as PNG bytes, or None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    tensors = report.tensors
    sqnr = [c.sqnr for c in tensors]
    finite = [v for v in sqnr if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 60.0)
    margin = max(3.0, 0.08 * (high - low))
    top, bottom = high + margin, low - margin  # where +inf and -inf are drawn
    y = [top if v == math.inf else bottom if v == -math.inf else v for v in sqnr]
    size = 28 if len(y) <= 80 else 10

    figure = Figure(figsize=(11, 3.8), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.plot(range(len(y)), y, color="#afb8c1", linewidth=1, zorder=1)
    for kind, (label, colour, marker) in _KINDS.items():
        shown = [i for i, c in enumerate(tensors) if c.ran == kind and math.isfinite(sqnr[i])]
        if shown:
            ax.scatter(shown, [y[i] for i in shown], s=size, color=colour, marker=marker, label=label,
                       zorder=3)
    for value, where, marker, label in ((math.inf, top, "^", "exact (SQNR \u221e)"),
                                        (-math.inf, bottom, "v", "zero reference (\u2212\u221e)")):
        shown = [i for i, v in enumerate(sqnr) if v == value]
        if shown:
            ax.scatter(shown, [where] * len(shown), s=size + 16, marker=marker, facecolor="white",
                       edgecolor="#1f2328", label=label, zorder=3)
    index = {c.name: i for i, c in enumerate(tensors)}
    worst = [index[name] for name in report.worst()]
    # one height per label, above the worst points; rightward labels (leftward near the right
    # edge) stacked so that their leader lines do not cross
    rightward = sorted((i for i in worst if i <= 0.75 * len(y)), reverse=True)
    leftward = sorted(i for i in worst if i > 0.75 * len(y))
    span = top - bottom
    base = max((y[i] for i in worst), default=top) + 0.15 * span
    label_top = top
    for level, i in enumerate(rightward + leftward):
        ax.scatter([i], [y[i]], s=size * 4.5, facecolor="none", edgecolor="#cf222e", linewidth=1.6,
                   zorder=4)
        left = i in leftward
        height = base + 0.09 * span * level
        label_top = max(label_top, height)
        label = ax.annotate(f"#{i} {_short(tensors[i].name)}", (i, y[i]),
                            xytext=(i + (-0.02 if left else 0.02) * len(y), height),
                            ha="right" if left else "left", va="center", fontsize=9, color="#cf222e",
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white",
                                  "edgecolor": "none", "alpha": 0.75},
                            arrowprops={"arrowstyle": "-", "color": "#cf222e", "linewidth": 0.8})
        label.set_in_layout(False)
    ax.set_ylim(bottom - margin, max(top, label_top) + margin)
    ax.set_xlim(-0.5, max(len(y), 1) - 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tensor # (graph order)")
    ax.set_ylabel("SQNR (dB)")
    ax.grid(True, color="#eaeef2", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncols=5, fontsize=9, frameon=False,
              borderaxespad=0, handletextpad=0.3, columnspacing=1.5)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _short(name: str, limit: int = 36) -> str:
    """Long names keep their end, which usually tells layers apart (``.../conv/Conv_output_0``)."""
    return name if len(name) <= limit else "\u2026" + name[-(limit - 1):]
