"""Does cross-layer weight equalization help qtool on PP-OCR? A measurement, not a feature.

    python bench/equalize.py --models det,rec,cls

Cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight Equalization and
Bias Correction", 2019): for a conv A whose output only feeds conv B, directly or through a Relu
(f(x/s) = f(x)/s for s > 0), output channel c of A (weights and bias) is divided by s_c and input
channel c of B multiplied by it, with s_c = sqrt(r_A[c] / r_B[c]) (r: the largest |weight| of the
channel), so both ranges become sqrt(r_A[c] * r_B[c]). The float function is unchanged. B must be
an ordinary conv (group 1) or depthwise (one input channel per group).

The equalized model is calibrated (minmax) and quantized with qtool's defaults, as is the
original; both are scored by onnxruntime on disjoint evaluation data against the original float
model: full QDQ and weights-only (every activation fence removed) SQNR, and each model's metric.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import quality  # noqa: E402

from qtool.analyze import QdqModel  # noqa: E402
from qtool.calibrate import calibrate  # noqa: E402
from qtool.model import load_model, prepare  # noqa: E402
from qtool.quantize import quantize  # noqa: E402


def _attr(node, name, default):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def conv_pairs(model: onnx.ModelProto, through: tuple[str, ...] = ("Relu",)):
    """Each (a, b): Conv ``a`` whose output only Conv ``b`` reads, as its input, directly or
    through one op of ``through`` that only ``b`` reads (f(x/s) = f(x)/s for s > 0), no graph
    output on the way: the pairs a rescaling of a's output channels leaves exact."""
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    for a in model.graph.node:
        if a.op_type != "Conv":
            continue
        tensor = a.output[0]
        users = consumers.get(tensor, [])
        if len(users) == 1 and users[0].op_type in through and tensor not in outputs:
            tensor = users[0].output[0]
            users = consumers.get(tensor, [])
        if len(users) == 1 and users[0].op_type == "Conv" and tensor not in outputs and users[0].input[0] == tensor:
            yield a, users[0]


def equalize(model: onnx.ModelProto) -> int:
    """Equalize every eligible conv pair of ``model`` in place; returns how many."""
    inits = {i.name: i for i in model.graph.initializer}
    pairs = 0
    for a, b in list(conv_pairs(model)):
        if a.input[1] not in inits or b.input[1] not in inits:
            continue
        wa = numpy_helper.to_array(inits[a.input[1]]).astype(np.float64)
        wb = numpy_helper.to_array(inits[b.input[1]]).astype(np.float64)
        channels, group_b = wa.shape[0], _attr(b, "group", 1)
        if group_b == 1 and wb.shape[1] == channels:
            rb = np.abs(wb).max(axis=(0, 2, 3))
        elif group_b == channels and wb.shape[0] == channels and wb.shape[1] == 1:
            rb = np.abs(wb).reshape(channels, -1).max(axis=1)
        else:
            continue
        ra = np.abs(wa).reshape(channels, -1).max(axis=1)
        ok = (ra > 0) & (rb > 0)
        s = np.ones(channels)
        s[ok] = np.sqrt(ra[ok] / rb[ok])
        wa /= s.reshape(-1, 1, 1, 1)
        if group_b == 1:
            wb *= s.reshape(1, -1, 1, 1)
        else:
            wb *= s.reshape(-1, 1, 1, 1)
        inits[a.input[1]].CopyFrom(numpy_helper.from_array(wa.astype(np.float32), a.input[1]))
        inits[b.input[1]].CopyFrom(numpy_helper.from_array(wb.astype(np.float32), b.input[1]))
        if len(a.input) > 2 and a.input[2] in inits:
            bias = numpy_helper.to_array(inits[a.input[2]]).astype(np.float64) / s
            inits[a.input[2]].CopyFrom(numpy_helper.from_array(bias.astype(np.float32), a.input[2]))
        pairs += 1
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="det,rec,cls")
    args = parser.parse_args()
    sizes = argparse.Namespace(rec_calib=64, rec_eval=200, cls_calib=64, cls_eval=200, det_calib=16,
                               det_eval=8, det_size=640)
    with tempfile.TemporaryDirectory(prefix="qtool-equalize-") as tmp:
        print("| model | variant | pairs | float model vs original | full QDQ | weights only |")
        print("|---|---|---|---|---|---|")
        for kind in args.models.split(","):
            w = quality.Workload(kind, sizes, Path(tmp))
            ref = w.run(w.model)
            prepared = prepare(load_model(w.model))
            equalized = onnx.ModelProto()
            equalized.CopyFrom(prepared)
            pairs = equalize(equalized)
            for name, float_model, count in (("original", prepared, 0), ("equalized", equalized, pairs)):
                path = Path(tmp) / f"{kind}_{name}.onnx"
                onnx.save(float_model, path)
                table = calibrate(path, w.calib, "minmax", batch_size=quality.BATCH[kind], progress=False)
                qmodel, _ = quantize(path, table)
                qdq = QdqModel(qmodel, prepare(load_model(path)))
                same = quality.sqnr_db(ref[0], w.run(float_model)[0])
                full = w.metrics(w.run(qmodel), ref)
                weights = w.metrics(w.run(qdq.ablated(qdq.all_tensors(), ())), ref)
                print(f"| {kind} | {name} | {count} | {same:.1f} dB | {quality.fmt(full)} | "
                      f"{quality.fmt(weights)} |", flush=True)


if __name__ == "__main__":
    main()
