"""``qtool verify --report`` (the HTML page), ``--ort`` (onnxruntime on the quantized model) and
``--analyze`` (the per-op sensitivity ranking of ``qtool analyze``).

Expected figures are computed here with numpy and onnxruntime from the input files, or read from
the JSON report of the same run, never from the HTML under test.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import sys
from html import unescape
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from PIL import Image
from typer.testing import CliRunner

from qtool.analyze import Analysis, OpSensitivity
from qtool.cli import app
from qtool.executor import IntegerExecutor
from qtool.html_report import NO_PLOT, render_html
from qtool.qparams import QParams
from qtool.quantize import QuantizeOptions, quantize
from qtool.verify import ANALYSIS_TOP, Comparison, OrtCheck, VerifyReport

runner = CliRunner()
SAMPLES = 540  # images in qtool/demo/digits_heldout.npz
PNG = "<img src=\"data:image/png;base64,"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_model, qmodel, demo_heldout) -> dict:
    """One ``verify --ort --report --json`` over the held-out set: its JSON, page and folder."""
    folder = tmp_path_factory.mktemp("report")
    page = folder / "report.html"
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--labels", "label",
                    "--ort", "--report", page, "--json", "-q")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 0, result.output
    return {"json": json.loads(result.stdout), "html": page.read_text(encoding="utf-8"),
            "folder": folder, "page": page}


def table_rows(html: str, heading: str = "Tensors in graph order") -> list[list[str]]:
    """The cells (tags stripped, entities decoded) of every body row of the table under
    ``heading`` (the per-tensor table by default)."""
    section = html.split(f"<h2>{heading}</h2>")[1].split("</table>")[0]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", section.split("<tbody>")[1], re.S)
    return [[unescape(re.sub(r"<[^>]+>", "", cell)).strip()
             for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)] for row in rows]


def cosine_sqnr(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    ref, got = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    cosine = ref @ got / np.sqrt((ref @ ref) * (got @ got))
    return float(cosine), float(10 * np.log10((ref @ ref) / ((ref - got) @ (ref - got))))


# -- the HTML page -----------------------------------------------------------------------------------

def test_page_is_written_whole_and_self_contained(run, demo_model, qmodel):
    assert [p.name for p in run["folder"].iterdir()] == ["report.html"]  # no temporary file left
    html = run["html"]
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", html, re.S)
    assert len(scripts) == 1 and "<script>" in html  # one inline script: the table's sort and filter
    assert "fetch" not in scripts[0] and "http" not in scripts[0] and "import" not in scripts[0]
    assert not re.search(r"""(src|href)=["'](?!data:)""", html)  # nothing fetched from elsewhere
    assert "<style>" in html
    header = html.split("<h2>")[0]
    assert demo_model.name in header and qmodel.name in header
    assert re.search(rf"<dt>samples</dt><dd>{SAMPLES}</dd>", header)
    assert "output cosine &gt;= 0.99" in header
    assert "badge pass\">PASS<" in header
    # how the quantized model was made, from its metadata
    assert re.search(r"<dt>activation type</dt><dd><span class=\"name\">uint8</span></dd>", header) or \
        re.search(r"<dt>activation type</dt><dd><span class=\"name\">int8</span></dd>", header), header
    assert "<dt>rounding</dt>" in header and "<dt>target</dt>" in header
    assert '<table id="tensors">' in html and 'id="tensor-filter"' in html


def test_tensor_table_matches_the_json_report(run):
    report = run["json"]
    rows = table_rows(run["html"])
    assert len(rows) == len(report["tensors"]) > 10
    for i, (row, tensor) in enumerate(zip(rows, report["tensors"])):  # graph order, as in the JSON
        index, name, op_type, ran, cosine, sqnr, max_lsb = row
        assert int(index) == i
        assert name.removesuffix(" worst") == tensor["name"]
        assert op_type.startswith(tensor["op_type"]) and ran == tensor["ran"]
        assert float(cosine) == pytest.approx(tensor["cosine"], abs=1e-6)
        assert float(sqnr) == pytest.approx(tensor["sqnr_db"], abs=0.006)
        assert float(max_lsb) == pytest.approx(tensor["max_diff_lsb"], abs=0.006)
    assert {"input", "bn1_out", "block_add_out", "flatten_out"} <= {r[1].split()[0] for r in rows}


def test_worst_layers_are_marked(run):
    worst = run["json"]["worst"]
    assert len(worst) == 3
    marked = re.findall(r"<tr class=\"worst\">.*?<td class=\"name\">([^< ]+)", run["html"])
    assert marked == [t["name"] for t in run["json"]["tensors"] if t["name"] in worst]
    assert sum(row[1].endswith(" worst") for row in table_rows(run["html"])) == 3


def test_page_embeds_the_sqnr_plot(run):
    html = run["html"]
    assert PNG in html and NO_PLOT not in html
    data = base64.b64decode(html.split(PNG)[1].split('"')[0], validate=True)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(data)) as image:
        assert image.width >= 800 and image.height >= 300


def test_page_shows_outputs_and_onnxruntime_figures(run):
    html, report = run["html"], run["json"]
    output, checked = report["outputs"][0], report["ort"][0]
    row = f"<td class=\"name\">logits</td><td class=\"num\">{output['cosine']:.6f}</td>"
    assert row in html.split("<h2>Outputs: float model vs integer executor</h2>")[1]
    ort_section = html.split("<h2>onnxruntime on the quantized model</h2>")[1].split("</table>")[0]
    assert f"{checked['cosine']:.6f}" in ort_section
    assert f"{100 * checked['vs_executor']['equal_fraction']:.2f}%" in ort_section
    assert "LSB" in ort_section
    assert "None: every node ran on integer kernels." in html  # the demo has no float node


def test_page_without_matplotlib(tmp_path, monkeypatch, demo_model, qmodel, demo_heldout):
    loaded = [m for m in sys.modules if m.startswith("matplotlib.")]
    for name in ["matplotlib", *loaded]:
        monkeypatch.setitem(sys.modules, name, None)  # every `import matplotlib...` now fails
    page = tmp_path / "report.html"
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "32",
                    "--report", page, "-q")
    assert result.exit_code == 0, result.output
    html = page.read_text(encoding="utf-8")
    assert "data:image/png" not in html
    assert f"<p class=\"note\">{NO_PLOT}</p>" in html.replace("&#x27;", "'")
    assert len(table_rows(html)) > 10  # the tables are all there


def test_page_is_written_when_verification_fails(tmp_path, demo_model, qmodel, demo_heldout):
    page = tmp_path / "report.html"
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "32",
                    "--tolerance", "1.0,200", "--report", page, "-q")
    assert result.exit_code == 1
    html = page.read_text(encoding="utf-8")
    assert "badge fail\">FAIL<" in html
    assert "output &#x27;logits&#x27; SQNR" in html and "&lt; 200.0 dB" in html


def _comparison(name: str, ref, got, ran: str = "integer") -> Comparison:
    c = Comparison(name, "Conv", ran, QParams(0.05, 0))
    c.update(np.asarray(ref, np.float32), np.asarray(got, np.float32))
    return c


def test_infinite_sqnr_and_markup_in_names():
    ref = np.linspace(-1, 1, 50)
    tensors = [_comparison("input", ref, ref + 0.001, "input"),
               _comparison("exact", ref, ref),  # SQNR +inf
               _comparison("zero_ref", np.zeros(50), np.full(50, 0.05)),  # SQNR -inf
               _comparison("<b>&amp;\"x\"", ref, ref + 0.01, "float")]
    assert tensors[1].sqnr == float("inf") and tensors[2].sqnr == float("-inf")
    outputs = [_comparison("y", ref, ref)]
    report = VerifyReport(4, (0.99, 30.0), outputs, tensors, [("Resize", "up<1>", "mode 'cubic'")])
    html = render_html(report, "m<1>.onnx", "q.onnx")
    assert PNG in html  # the plot copes with +-inf
    cells = {row[1].removesuffix(" worst"): row for row in table_rows(html)}
    assert cells["exact"][5] == "\u221e (exact)"
    assert cells["zero_ref"][5] == "\u2212\u221e" and cells["zero_ref"][1].endswith(" worst")
    assert cells["<b>&amp;\"x\""][3] == "float"
    assert "<b>" not in html and "&lt;b&gt;&amp;amp;&quot;x&quot;" in html
    assert "m&lt;1&gt;.onnx" in html and "up&lt;1&gt;" in html


def test_text_report_columns_stay_aligned_for_long_names():
    """Exporters' tensor names pass the 32 columns a name had: the figures stay under their
    headings in the output, tensor and onnxruntime tables."""
    from qtool.verify import format_report

    ref = np.linspace(-1, 1, 50)
    long = "/model/backbone/stage_one/block_three/conv_two/Conv_output_0"
    tensors = [_comparison("short", ref, ref + 0.01), _comparison(long, ref, ref + 0.02)]
    outputs = [_comparison(long + "/logits", ref, ref + 0.01), _comparison("y", ref, ref + 0.01)]
    ort_checks = [OrtCheck(_comparison(c.name, ref, ref + 0.01), None, 0.0, 50, 50) for c in outputs]
    report = VerifyReport(4, (0.99, 30.0), outputs, tensors, [], ort=ort_checks)
    lines = format_report(report).splitlines()
    for heading in ("output ", "tensor "):
        for at in [i for i, line in enumerate(lines) if line.startswith(heading)]:
            end = lines[at].index("SQNR dB") + len("SQNR dB")
            rows = lines[at + 1:at + 3]
            assert all(row[end - 1].isdigit() and row[end:end + 1] in ("", " ") for row in rows), \
                "\n".join(lines[at:at + 3])


# -- --ort -------------------------------------------------------------------------------------------

def test_ort_figures_are_sane(run, demo_model, qmodel, demo_heldout):
    report = run["json"]
    assert [c["name"] for c in report["ort"]] == ["logits"]
    checked = report["ort"][0]
    agreement = checked["vs_executor"]
    assert agreement["unit"] == "lsb"  # logits are dequantized from int8
    assert 0.0 <= agreement["equal_fraction"] <= 1.0
    assert agreement["equal_fraction"] >= 0.9
    assert 0.0 <= agreement["max_diff"] <= 4  # a few LSB of rounding, not a different model

    held = np.load(demo_heldout)["input"]
    reference = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"]).run(
        None, {"input": held})[0]
    got = ort.InferenceSession(str(qmodel), providers=["CPUExecutionProvider"]).run(
        None, {"input": held})[0]
    cosine, sqnr = cosine_sqnr(reference, got)
    assert checked["cosine"] == pytest.approx(cosine, abs=2e-6)
    assert checked["sqnr_db"] == pytest.approx(sqnr, abs=2e-3)
    assert sqnr > 25

    executor = IntegerExecutor(onnx.load(str(qmodel))).run({"input": held}).outputs["logits"]
    assert agreement["equal_fraction"] == pytest.approx(float(np.mean(executor == got)), abs=1e-6)
    scale = next(numpy_helper.to_array(i) for i in onnx.load(str(qmodel)).graph.initializer
                 if i.name == "logits_scale")
    assert agreement["max_diff"] == pytest.approx(np.abs(executor - got).max() / scale, abs=1e-3)


def test_ort_in_text_report(demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "64",
                    "--ort", "-q")
    assert result.exit_code == 0, result.output
    assert "onnxruntime on the quantized model" in result.stdout
    match = re.search(r"^logits\s+(0\.\d{6})\s+(\d+\.\d\d)\s+(\d+\.\d\d) LSB\s+(\d+\.\d\d)%$",
                      result.stdout, re.MULTILINE)
    assert match, result.stdout
    assert float(match.group(1)) > 0.99 and 90.0 <= float(match.group(4)) <= 100.0


def test_ort_is_off_by_default(demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "16",
                    "--json", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ort"] is None
    text = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "16", "-q")
    assert "onnxruntime on the quantized model" not in text.stdout


def test_ort_check_counts_exact_elements():
    check = OrtCheck(Comparison("y"), QParams(0.5, 0))
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    check.update(ref, np.array([1.0, 2.0, 3.5, 4.0]), np.array([1.0, 2.0, 3.0, 5.0]))
    assert (check.equal, check.count, check.equal_fraction) == (2, 4, 0.5)
    assert check.max_diff == 2.0  # |5.0 - 4.0| / 0.5
    assert check.to_dict()["vs_executor"] == {"max_diff": 2.0, "unit": "lsb", "equal_fraction": 0.5}


# -- errors ------------------------------------------------------------------------------------------

def assert_user_error(result, *fragments: str) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def no_verify_run(monkeypatch):
    """Fails the test if the long work (the verify run itself) starts."""
    def run(*args, **kwargs):
        raise AssertionError("verify ran before the --report path was checked")

    monkeypatch.setattr("qtool.verify.verify", run)


def test_unwritable_report_path(tmp_path, demo_model, qmodel, demo_heldout, no_verify_run):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where a folder is needed\n")
    page = blocker / "report.html"
    before = sorted(tmp_path.rglob("*"))
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--report", page)
    assert_user_error(result, f"cannot write '{page}'", f"'{blocker}' is not a directory")
    assert sorted(tmp_path.rglob("*")) == before


def test_report_path_is_a_directory(tmp_path, demo_model, qmodel, demo_heldout, no_verify_run):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--report", tmp_path)
    assert_user_error(result, f"cannot write '{tmp_path}'", "is a directory")
    assert list(tmp_path.iterdir()) == []


# -- --analyze ---------------------------------------------------------------------------------------

ANALYSIS = "Sensitivity (qtool analyze)"


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory, demo_model, qmodel, demo_heldout) -> dict:
    """One ``verify --analyze --report --json`` over 64 samples: its JSON and page."""
    page = tmp_path_factory.mktemp("analyzed") / "report.html"
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "64",
                    "--analyze", "--report", page, "--json", "-q")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 0, result.output
    return {"json": json.loads(result.stdout), "html": page.read_text(encoding="utf-8")}


def test_analysis_in_json_is_ranked_by_gain(analyzed):
    report = analyzed["json"]
    analysis = report["analysis"]
    assert report["samples"] == 64 and analysis["samples"] == 16  # --analyze-samples' default
    ops = analysis["ops"]
    assert len(ops) == 13 and len({o["node"] for o in ops}) == 13  # every integer op of the demo
    gains = [o["gain_db"] for o in ops]
    assert gains == sorted(gains, reverse=True)
    for o in ops:  # each figure rounded to 0.001 dB
        assert o["gain_db"] == pytest.approx(o["only_float_db"] - analysis["quantized_db"], abs=0.002)
        assert o["only_quantized_db"] > analysis["quantized_db"]
    assert gains[0] > 0  # some op gains when left float


def test_analysis_section_in_page(analyzed):
    html, analysis = analyzed["html"], analyzed["json"]["analysis"]
    sections = re.findall(r"<h2>(.*?)</h2>", html)
    assert sections.index(ANALYSIS) == sections.index("SQNR along the graph") - 1
    section = html.split(f"<h2>{ANALYSIS}</h2>")[1].split("<h2>")[0]
    assert f"fully quantized <b>{analysis['quantized_db']:.2f} dB</b>" in section
    assert f"weights only {analysis['weights_only_db']:.2f} dB" in section
    assert f"activations only {analysis['activations_only_db']:.2f} dB" in section
    assert f"<td class=\"name\">{analysis['ops'][0]['node']}</td>" in section
    rows = table_rows(html, ANALYSIS)
    assert len(rows) == ANALYSIS_TOP < len(analysis["ops"])
    for rank, (row, op) in enumerate(zip(rows, analysis["ops"]), 1):
        assert row[:3] == [str(rank), op["node"], op["op_type"]]
        assert [float(v) for v in row[3:]] == pytest.approx(
            [op["only_quantized_db"], op["only_float_db"], op["gain_db"]], abs=0.006)
    assert f"{len(analysis['ops']) - ANALYSIS_TOP} more ops in the --json report" in section


def test_analysis_in_text_report(demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "64",
                    "--analyze", "--analyze-samples", "8", "-q")
    assert result.exit_code == 0, result.output
    block = result.stdout.split("most sensitive ops")[1]
    assert "analyze: 8 samples; SQNR of output 'logits' against float: fully quantized" in block
    ranks = re.findall(r"^ +(\d+)  \w+ +\w+ +-?\d+\.\d\d dB +-?\d+\.\d\d dB +[+-]\d+\.\d\d$", block,
                       re.MULTILINE)
    assert ranks == [str(r) for r in range(1, ANALYSIS_TOP + 1)]
    assert "... 3 more (--json for all)" in block and "--top" not in block
    assert result.stdout.rstrip().endswith("PASS (output cosine >= 0.99, SQNR >= 20.0 dB)")


def test_analysis_scores_at_most_the_compared_samples(demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "4",
                    "--analyze", "--json", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["analysis"]["samples"] == 4


def test_no_analysis_without_the_option(run, demo_model, qmodel, demo_heldout):
    assert ANALYSIS not in run["html"] and "qtool analyze" not in run["html"]
    assert "analysis" not in run["json"]
    text = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--num-samples", "16", "-q")
    assert text.exit_code == 0 and "most sensitive ops" not in text.stdout


def test_analysis_section_escapes_names_and_infinities():
    ops = [OpSensitivity("Conv", "<b>conv&1</b>", 50.0, math.inf, math.inf),
           OpSensitivity("Relu", "relu", 60.0, 30.0, -0.5)]
    ref = np.linspace(-1, 1, 50)
    report = VerifyReport(4, (0.99, None), [_comparison("y", ref, ref)], [_comparison("t", ref, ref + 0.01)],
                          [], analysis=Analysis(4, 30.5, 40.0, math.inf, ops))
    html = render_html(report, "m.onnx", "q.onnx")
    assert "<b>conv" not in html and "&lt;b&gt;conv&amp;1&lt;/b&gt;" in html
    assert "activations only &infin; (exact) dB" in html
    rows = table_rows(html, ANALYSIS)
    assert rows[0][4:] == ["\u221e (exact)", "+\u221e"] and rows[1][5] == "-0.50"
    assert "more ops in the --json report" not in html  # all of them are shown
    assert report.to_dict()["analysis"]["ops"][0]["gain_db"] == "inf"


def test_analyze_rejects_a_qoperator_model(tmp_path, demo_model, demo_table, demo_heldout):
    model, _ = quantize(demo_model, demo_table, QuantizeOptions(format="qoperator"))
    path = tmp_path / "digits.qop.onnx"
    onnx.save(model, str(path))
    page = tmp_path / "report.html"
    result = invoke("verify", demo_model, path, "--data", demo_heldout, "--analyze", "--report", page)
    assert_user_error(result, "the quantized model has no QuantizeLinear/DequantizeLinear fences",
                      "analyze reads QDQ models: quantize with --format qdq")
    assert not page.exists()


def test_analyze_samples_needs_analyze(demo_model, qmodel, demo_heldout, no_verify_run):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--analyze-samples", "8")
    assert_user_error(result, "--analyze-samples", "--analyze")


def test_analyze_samples_must_be_positive(demo_model, qmodel, demo_heldout):
    result = invoke("verify", demo_model, qmodel, "--data", demo_heldout, "--analyze",
                    "--analyze-samples", "0")
    assert_user_error(result, "number of samples must be >= 1, got 0")


def test_an_output_declared_with_another_shape_is_written_as_computed(tmp_path):
    """A model declaring an output's shape other than it computes (plcmos_v2: a scalar for [3];
    onnxruntime only warns): quantize's full ONNX check refused what it wrote (an internal error,
    exit 3); it now declares the output as inferred, and verify --ort runs both forms."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from test_cli import invoke

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
         helper.make_node("ReduceSum", ["m", "axes"], ["y"], keepdims=0, name="sum")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],  # declared a scalar: it is [N]
        [numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32))
    assert invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "d.npz", "-o", tmp_path / "t.yaml", "-q").exit_code == 0
    quantized = invoke("quantize", tmp_path / "m.onnx", "-t", tmp_path / "t.yaml", "-o", tmp_path / "q.onnx", "-q")
    assert quantized.exit_code == 0, quantized.output
    qmodel = onnx.load(tmp_path / "q.onnx")
    assert len(qmodel.graph.output[0].type.tensor_type.shape.dim) == 1
    qmodel.graph.output[0].type.tensor_type.shape.ClearField("dim")  # declared a scalar again, as plcmos_v2's
    onnx.save(qmodel, tmp_path / "q_declared.onnx")
    for q in ("q.onnx", "q_declared.onnx"):
        result = invoke("verify", tmp_path / "m.onnx", tmp_path / q, "-d", tmp_path / "d.npz", "--ort", "-q")
        assert result.exit_code == 0, result.output
