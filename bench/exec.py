"""Integer executor latency against onnxruntime float inference, measured in one run.

    python bench/exec.py                  # PP-OCRv4 rec (1x3x48x320) and det (1x3x640x640)
    python bench/exec.py --models rec --runs 20
    python bench/exec.py --no-compiled    # as installed without the 'fast' extra (numba)

For each model: calibrate (minmax) on rendered lines or image crops (bench/datasets.py), quantize
in both formats, then time, one sample at a time and in the same process:
- onnxruntime on the float model (default session options: every core, all graph optimizations);
- qtool's integer executor (``IntegerExecutor.run``) on the QDQ and on the QOperator model;
- onnxruntime on the QOperator model, for reference.
Each figure is the median of ``--runs`` runs, taken in five rounds in which the four take turns,
each running its share back to back after an untimed run (``_median_seconds``); ratios divide by
the float median.
The last column is the executor's agreement with onnxruntime on the same QOperator model, on the
model output: the fraction of elements exactly equal and the largest difference in output LSB.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import functools
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


def _median_seconds(runners: dict, runs: int, rounds: int = 5) -> dict:
    """The median time of each runner over ``runs`` runs, taken in ``rounds`` blocks: within a
    round each runner runs once untimed and then its share of the runs back to back (its steady
    state: onnxruntime's thread pool stays awake between its own runs, as in a serving loop), and
    the runners take turns from round to round, so a change in the machine's load reaches every
    figure alike and the ratios stay comparable. A pause before each block lets the threads an
    onnxruntime session keeps spinning after its runs stop taking the cores from the next one."""
    times = {name: [] for name in runners}
    for round_ in range(rounds):
        share = runs // rounds + (round_ < runs % rounds)
        for name, run in runners.items():
            time.sleep(0.2)  # the previous runner's spinning onnxruntime threads go back to sleep
            run()  # warm-up: sessions, specialised parameters, compiled loops, caches, threads
            for _ in range(share):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


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
    runners = {"float": lambda: session.run(None, feeds)}
    notes = {}
    for fmt in ("qdq", "qoperator"):
        qmodel, _ = quantize(model, table, QuantizeOptions(format=fmt))
        executor = IntegerExecutor(qmodel)
        runners[fmt] = functools.partial(executor.run, feeds)
        if fmt == "qoperator":
            qsession = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
            runners["ort qoperator"] = functools.partial(qsession.run, None, feeds)
            got = executor.run(feeds).outputs[qmodel.graph.output[0].name]
            want = qsession.run(None, feeds)[0]
            scale = _output_scale(qmodel)
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            lsb = f"{diff.max() / scale:.2f} LSB" if scale else f"{diff.max():.3g} abs"
            notes[fmt] = f"output vs onnxruntime on this model: {np.mean(diff == 0):.4%} equal, max {lsb}"
    seconds = _median_seconds(runners, runs)
    base = seconds["float"]
    labels = {"float": "onnxruntime, float model", "qdq": "qtool exec, qdq model",
              "ort qoperator": "onnxruntime, QOperator model", "qoperator": "qtool exec, qoperator model"}
    return [(kind, labels[name], seconds[name], seconds[name] / base, notes.get(name, "")) for name in labels]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="rec,det")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per figure (median kept)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="requantize in numpy, as an install without numba does (qtool/ops/compiled.py)")
    args = parser.parse_args(argv)
    if args.no_compiled:
        from qtool.ops import compiled

        compiled.ENABLED = False
    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-exec-") as tmp:
        for kind in args.models.split(","):
            rows += bench(kind, args.runs, Path(tmp))
    print(f"{'model':<5} {'what':<30} {'ms':>9} {'x ORT float':>12}  note")
    for kind, what, seconds, ratio, note in rows:
        print(f"{kind:<5} {what:<30} {1000 * seconds:9.1f} {ratio:12.2f}  {note}")


if __name__ == "__main__":
    main()
