"""Where a quantized PP-OCR model loses accuracy: ablations on qtool's QDQ model, run by onnxruntime.

    python bench/ablate.py --model rec                      # full, weights only, activations only
    python bench/ablate.py --model rec --tensor p2o.Add.3   # plus that one tensor alone, and noise

The model is calibrated (minmax) and quantized with qtool's defaults; evaluation data is disjoint
from calibration (bench/datasets.py, seed 1). Rows:
- full: the QDQ model as written;
- weights only: every activation Q/DQ pair removed (activations stay float);
- activations only: every quantized weight, bias and constant replaced by its float original;
- with --tensor T: only T quantized (its Q/DQ pair on the float model, with the table's range),
  and Gaussian noise of the same RMS as T's rounding error (step^2 / 12) instead.
Metrics: output SQNR against float; rec word accuracy; det IoU of the p > 0.3 masks. onnxruntime
runs with graph optimizations off (as in qtool analyze): its optimizers change the arithmetic of
the mixed variants.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import datasets  # noqa: E402

from qtool.analyze import QdqModel  # noqa: E402
from qtool.calibrate import calibrate  # noqa: E402
from qtool.model import load_model, prepare  # noqa: E402
from qtool.quantize import QuantizeOptions, quantize  # noqa: E402

BATCH = {"rec": 8, "det": 1}


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10((ref ** 2).sum() / ((ref - got) ** 2).sum()))


def run(model: onnx.ModelProto, x: np.ndarray, batch: int) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as qtool analyze
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])


def one_tensor(model: onnx.ModelProto, name: str, lo: float, hi: float, noise: bool) -> onnx.ModelProto:
    """The float model with only ``name`` quantized (asymmetric int8 over [lo, hi]), or with
    Gaussian noise of the same RMS as that rounding."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255
    zero = int(np.clip(np.round(-128 - lo / scale), -128, 127))
    if noise:
        new = [helper.make_node("RandomNormalLike", [name], [name + "_noise"], scale=scale / np.sqrt(12),
                                dtype=TensorProto.FLOAT, seed=1.0),
               helper.make_node("Add", [name, name + "_noise"], [name + "_perturbed"])]
    else:
        out.graph.initializer.extend([numpy_helper.from_array(np.float32(scale), name + "_s"),
                                      numpy_helper.from_array(np.int8(zero), name + "_z")])
        new = [helper.make_node("QuantizeLinear", [name, name + "_s", name + "_z"], [name + "_q"]),
               helper.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_z"],
                                [name + "_perturbed"])]
    nodes = list(out.graph.node)
    for node in nodes:
        for i, value in enumerate(node.input):
            if value == name:
                node.input[i] = name + "_perturbed"
    at = next(i for i, n in enumerate(nodes) if name in n.output) + 1
    del out.graph.node[:]
    out.graph.node.extend(nodes[:at] + new + nodes[at:])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("rec", "det"), default="rec")
    parser.add_argument("--tensor", help="also quantize only this tensor, and add noise instead")
    parser.add_argument("--eval", type=int, help="evaluation samples (default: rec 50, det 4)")
    args = parser.parse_args(argv)
    kind = args.model
    path = datasets.model_path(kind)
    if kind == "rec":
        calib, _ = datasets.text_lines(64, seed=0)
        x, strings = datasets.text_lines(args.eval or 50, seed=1)
        charset = datasets.rec_charset(path)
    else:
        calib = datasets.det_crops(16, seed=0)
        x = datasets.det_crops(args.eval or 4, seed=1)
    with tempfile.TemporaryDirectory(prefix="qtool-ablate-") as tmp:
        np.savez(Path(tmp) / "calib.npz", x=calib)
        table = calibrate(path, Path(tmp) / "calib.npz", "minmax", batch_size=BATCH[kind], progress=False)
    qmodel, _ = quantize(path, table, QuantizeOptions())
    float_model = prepare(load_model(path))
    ref = run(float_model, x, BATCH[kind])

    def metric(y):
        if kind == "rec":
            words = np.mean([p == s for p, s in zip(datasets.ctc_decode(y, charset), strings)])
            return f"word accuracy {100 * words:.1f}%"
        a, b = ref > 0.3, y > 0.3
        return f"IoU {(a & b).sum() / max(1, (a | b).sum()):.3f}"

    qdq = QdqModel(qmodel, float_model)
    rows = [("full", qmodel), ("weights only", qdq.ablated(qdq.all_tensors(), ())),
            ("activations only", qdq.ablated((), qdq.all_weights()))]
    if args.tensor:
        e = table.tensors[args.tensor]
        rows += [(f"only {args.tensor}", one_tensor(float_model, args.tensor, e.min, e.max, False)),
                 (f"noise on {args.tensor}", one_tensor(float_model, args.tensor, e.min, e.max, True))]
    print(f"{kind}: {len(x)} evaluation samples; float: {metric(ref)}")
    for label, model in rows:
        y = run(model, x, BATCH[kind])
        print(f"{label:<32} SQNR {sqnr_db(ref, y):6.2f} dB  {metric(y)}")


if __name__ == "__main__":
    main()
