"""Integer executor latency against onnxruntime float inference, measured in one run.

    python bench/exec.py                  # PP-OCRv4 rec (1x3x48x320) and det (1x3x640x640)
    python bench/exec.py --models rec --runs 20

For each model: calibrate (minmax) on rendered lines or image crops (bench/datasets.py), quantize
in both formats, then time, one sample at a time and in the same process:
- onnxruntime on the float model (default session options: every core, all graph optimizations);
- qtool's integer executor (``IntegerExecutor.run``) on the QDQ and on the QOperator model;
- onnxruntime on the QOperator model, for reference.
Each figure is the median of ``--runs`` runs after a warm-up; ratios divide by the float median.
The last column is the executor's agreement with onnxruntime on the same QOperator model, on the
model output: the fraction of elements exactly equal and the largest difference in output LSB.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import datasets  # noqa: E402

from qtool.calibrate import calibrate  # noqa: E402
from qtool.executor import IntegerExecutor  # noqa: E402
from qtool.quantize import QuantizeOptions, quantize  # noqa: E402

CALIBRATION = {"rec": 32, "det": 8}


def _median_seconds(run, runs: int) -> float:
    run()  # warm-up: sessions, specialised parameters, caches
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _data(kind: str):
    if kind == "rec":
        calib, _ = datasets.text_lines(CALIBRATION[kind], seed=0)
        sample, _ = datasets.text_lines(1, seed=1)
    else:
        calib = datasets.det_crops(CALIBRATION[kind], seed=0)
        sample = datasets.det_crops(1, seed=1)
    return calib, sample


def _output_scale(qmodel: onnx.ModelProto) -> float | None:
    """The scale of the DequantizeLinear that writes the model output, if one does."""
    out = qmodel.graph.output[0].name
    inits = {i.name: i for i in qmodel.graph.initializer}
    for node in qmodel.graph.node:
        if node.op_type == "DequantizeLinear" and out in node.output and node.input[1] in inits:
            return float(onnx.numpy_helper.to_array(inits[node.input[1]]).reshape(-1)[0])
    return None


def bench(kind: str, runs: int, workdir: Path) -> list[tuple]:
    model = datasets.model_path(kind)
    calib, x = _data(kind)
    np.savez(workdir / f"{kind}.npz", x=calib)
    table = calibrate(model, workdir / f"{kind}.npz", "minmax", batch_size=4, progress=False)
    name = onnx.load(model).graph.input[0].name
    feeds = {name: x}
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    base = _median_seconds(lambda: session.run(None, feeds), runs)
    rows = [(kind, "onnxruntime, float model", base, 1.0, "")]
    for fmt in ("qdq", "qoperator"):
        qmodel, _ = quantize(model, table, QuantizeOptions(format=fmt))
        executor = IntegerExecutor(qmodel)
        seconds = _median_seconds(lambda: executor.run(feeds), runs)
        note = ""
        if fmt == "qoperator":
            qsession = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
            ort_seconds = _median_seconds(lambda: qsession.run(None, feeds), runs)
            got = executor.run(feeds).outputs[qmodel.graph.output[0].name]
            want = qsession.run(None, feeds)[0]
            scale = _output_scale(qmodel)
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            lsb = f"{diff.max() / scale:.2f} LSB" if scale else f"{diff.max():.3g} abs"
            note = f"output vs onnxruntime on this model: {np.mean(diff == 0):.4%} equal, max {lsb}"
            rows.append((kind, "onnxruntime, QOperator model", ort_seconds, ort_seconds / base, ""))
        rows.append((kind, f"qtool exec, {fmt} model", seconds, seconds / base, note))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="rec,det")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per figure (median kept)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-exec-") as tmp:
        for kind in args.models.split(","):
            rows += bench(kind, args.runs, Path(tmp))
    print(f"{'model':<5} {'what':<30} {'ms':>9} {'x ORT float':>12}  note")
    for kind, what, seconds, ratio, note in rows:
        print(f"{kind:<5} {what:<30} {1000 * seconds:9.1f} {ratio:12.2f}  {note}")


if __name__ == "__main__":
    main()
