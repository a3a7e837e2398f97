"""How much could activation equalization give an all-int8 model? An upper bound, measured.

    python bench/zoo.py --work /tmp/zoo --only layout,yolov8n      # first: models, splits, tables
    python bench/headroom.py --work /tmp/zoo --only layout,yolov8n

Activation equalization (SmoothQuant, and cross-layer equalization through a ReLU) moves
per-channel factors from a layer's input into its weights, so that one int8 scale serves channels
of unlike ranges. Whatever factors it picks, it cannot do better on the activation side than
giving that input a scale of its own per channel, with the weights left as they are. This script
builds that model and scores it:

* the model `qtool quantize MODEL -t table.yaml -o headroom.q.onnx --data calib.npz
  --no-bias-correction` writes (WORK/runs/KEY/), all-int8: bias correction is left out, as the
  biases it fits cancel the mean errors of per-tensor steps, which per-channel steps no longer make;
  `--bias-correction` keeps it (the recommended pipeline's model);
* the same model with every activation that a Conv (group 1), MatMul or Gemm reads quantized per
  channel: QuantizeLinear and its DequantizeLinears with `axis` set to the channel axis and each
  channel's own min/max, measured with onnxruntime float on calib.npz, within the tensor's range
  as quantize wrote it (the calibration method's clipping stays) and at least 1/16 of the
  tensor's width (so that a channel idle on the calibration samples is not cut to nothing). No integer kernel runs such a model: both run in onnxruntime as written
  (`session.disable_quant_qdq`), so the difference is the per-channel activation steps alone;
* the same with each channel's range measured on calib.npz and eval.npz together ("ranges
  seen"): an oracle that no channel of the scored samples exceeds, the bound without the risk
  that ranges fitted on few samples cut a channel's rare large values.

It also counts the Conv pairs that cross-layer equalization could rescale exactly (through
identity, Relu, LeakyRelu or PRelu; "CLE pairs", of the model's Convs).

Both are scored as `quantize --data` judges its steps (``qtool.analyze.Evaluator``: the worst
output, an output that concatenates parts part by part, a Softmax/Sigmoid output on its input)
on eval.npz, which no step saw. A gain near zero says that no equalization can lift the model:
its int8 loss is not in the spread of channel ranges at the inputs of its weighted layers.

Two more columns say where the loss is: "weights only" is the model with every activation fence
removed (its weights and biases as quantized, activations float), "activations only" the model
with every quantized constant back to its float original (activations as quantized). Where
"activations only" is below a target, no change to the weights (rounding, equalization's
weight side) can reach it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import equalize  # noqa: E402
import zoo  # noqa: E402

from qtool.analyze import Evaluator, QdqModel, split_batches  # noqa: E402
from qtool.model import prepare_file  # noqa: E402

WEIGHTED = ("Conv", "MatMul", "Gemm")
FLOOR = 1 / 16  # a channel's range is at least this part of its tensor's


def weighted_inputs(qmodel: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The QuantizeLinear nodes (one scale) whose DequantizeLinears feed a weighted layer's first
    input: a Conv of group 1, a MatMul or a Gemm."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in qmodel.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    inits = {t.name: t for t in qmodel.graph.initializer}

    def reads(node: onnx.NodeProto, name: str) -> bool:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        return node.op_type in WEIGHTED and node.input[0] == name and group == 1

    found = []
    for q in qmodel.graph.node:
        if q.op_type != "QuantizeLinear" or q.input[1] not in inits or len(q.input) < 3:
            continue
        if numpy_helper.to_array(inits[q.input[1]]).size != 1:
            continue
        dqs = [d for d in consumers.get(q.output[0], []) if d.op_type == "DequantizeLinear"]
        if any(reads(c, d.output[0]) for d in dqs for c in consumers.get(d.output[0], [])):
            found.append(q)
    return found


def equalizable_pairs(float_model: onnx.ModelProto) -> int:
    """The Conv pairs that cross-layer equalization can rescale exactly (bench/equalize.py's,
    also through LeakyRelu and PRelu). SiLU, HardSwish, GELU and the like do not commute with a
    scale."""
    return sum(1 for _ in equalize.conv_pairs(float_model, ("Relu", "LeakyRelu", "PRelu")))


def channel_ranges(float_model: onnx.ModelProto, names: list[str], path: Path) -> dict[str, tuple]:
    """Each tensor's per-channel (min, max, axis) over the samples of ``path``, onnxruntime float,
    one sample a run."""
    probe = onnx.ModelProto()
    probe.CopyFrom(float_model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    data = dict(np.load(path))
    wanted = {i.name for i in session.get_inputs()}
    count = len(next(iter(data.values())))
    ranges: dict[str, tuple] = {}
    for i in range(count):
        outputs = session.run(names, {k: v[i:i + 1] for k, v in data.items() if k in wanted})
        for name, value in zip(names, outputs):
            axis = 1 if value.ndim == 4 else value.ndim - 1  # NCHW, or the last of [.., T, C]
            reduce = tuple(a for a in range(value.ndim) if a != axis)
            lo, hi = value.min(axis=reduce), value.max(axis=reduce)
            if name in ranges:
                lo, hi = np.minimum(ranges[name][0], lo), np.maximum(ranges[name][1], hi)
            ranges[name] = (lo, hi, axis)
    return ranges


def per_channel(qmodel: onnx.ModelProto, targets: list[onnx.NodeProto], ranges: dict) -> onnx.ModelProto:
    """``qmodel`` with each target QuantizeLinear and its DequantizeLinears per channel."""
    out = onnx.ModelProto()
    out.CopyFrom(qmodel)
    inits = {t.name: t for t in out.graph.initializer}
    by_output = {n.output[0]: n for n in out.graph.node}
    for target in targets:
        q = by_output[target.output[0]]
        lo, hi, axis = ranges[q.input[0]]
        zero_point = numpy_helper.to_array(inits[q.input[2]])
        zero_type, step = zero_point.dtype, float(numpy_helper.to_array(inits[q.input[1]]))
        low = -128 if zero_type == np.int8 else 0
        # within the tensor's own range, so that the calibration method's clipping stays
        first, last = (low - float(zero_point)) * step, (low + 255 - float(zero_point)) * step
        lo, hi = np.clip(lo, first, last), np.clip(hi, first, last)
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
        width = float((hi - lo).max())
        hi = np.maximum(hi, lo + FLOOR * width)  # an idle channel: a floor on its width
        scale = np.maximum((hi - lo) / 255.0, 1e-12).astype(np.float32)
        zero = np.clip(np.round(low - lo / scale), low, low + 255).astype(zero_type)
        names = (q.input[1] + "/per_channel", q.input[2] + "/per_channel")
        out.graph.initializer.extend([numpy_helper.from_array(scale, names[0]),
                                      numpy_helper.from_array(zero, names[1])])
        readers = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]]
        for node in [q, *readers]:
            node.input[1], node.input[2] = names
            kept = [a for a in node.attribute if a.name != "axis"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("axis", axis)])
    return out


def bench(entry, work: Path, bias_correction: bool) -> dict:
    folder = work / "runs" / entry.key
    table = folder / "table.yaml"
    if not table.exists():
        return {"key": entry.key, "error": f"no {table}: run bench/zoo.py --only {entry.key} first"}
    model = zoo.fetch(entry, work)
    qpath = folder / "headroom.q.onnx"
    argv = [zoo.qtool_exe(), "quantize", str(model), "-t", str(table), "-o", str(qpath), "--data",
            str(folder / "calib.npz"), "-q", *entry.quantize, *([] if bias_correction else ["--no-bias-correction"])]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return {"key": entry.key, "error": f"quantize exit {done.returncode}: {done.stderr.strip()[-200:]}"}
    float_model = prepare_file(model)
    qmodel = onnx.load(qpath)
    targets = weighted_inputs(qmodel)
    names = sorted({q.input[0] for q in targets})
    fitted = channel_ranges(float_model, names, folder / "calib.npz")
    scored = channel_ranges(float_model, names, folder / "eval.npz")
    seen = {name: (np.minimum(lo, scored[name][0]), np.maximum(hi, scored[name][1]), axis)
            for name, (lo, hi, axis) in fitted.items()}  # calib.npz and eval.npz together
    samples = len(next(iter(np.load(folder / "eval.npz").values())))
    batches, _ = split_batches(float_model, folder / "eval.npz", samples, 0, 1)
    evaluator = Evaluator(float_model, batches)
    base, wide, oracle = evaluator.sqnrs(qmodel, per_channel(qmodel, targets, fitted),
                                         per_channel(qmodel, targets, seen))
    # where the loss is: the same model with float activations (its weights and biases as
    # quantized), and with float weights and biases (its activations as quantized)
    qdq = QdqModel(qmodel, float_model)
    weights_only = evaluator.sqnr(qdq.ablated(qdq.all_tensors(), ()))
    activations_only = evaluator.sqnr(qdq.ablated((), qdq.all_weights()))
    return {"key": entry.key, "cle_pairs": equalizable_pairs(float_model), "convs": sum(
                n.op_type == "Conv" for n in float_model.graph.node), "tensors": len(targets), "as_written_db": round(base, 2),
            "per_channel_db": round(wide, 2), "per_channel_seen_db": round(oracle, 2),
            "weights_only_db": round(weights_only, 2), "activations_only_db": round(activations_only, 2),
            "scored": evaluator.scored}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--work", type=Path, required=True, help="bench/zoo.py's work folder")
    parser.add_argument("--only", required=True, help="zoo keys, comma-separated")
    parser.add_argument("--bias-correction", action="store_true", help="keep quantize --data's bias correction")
    args = parser.parse_args(argv)
    entries = {e.key: e for e in zoo.ZOO}
    unknown = [k for k in args.only.split(",") if k not in entries]
    if unknown:
        parser.error(f"unknown zoo keys: {', '.join(unknown)}")
    print(f"{'model':14s} {'CLE pairs':>11s} {'tensors':>7s} {'as written':>11s} {'per channel':>12s} {'ranges seen':>12s}"
          f" {'weights only':>13s} {'activations only':>17s}  (worst output, dB, eval.npz)")
    for key in args.only.split(","):
        row = bench(entries[key], args.work.resolve(), args.bias_correction)
        if "error" in row:
            print(f"{key:14s} {row['error']}")
            continue
        print(f"{key:14s} {row['cle_pairs']:4d} of {row['convs']:3d} {row['tensors']:7d} {row['as_written_db']:11.2f} {row['per_channel_db']:12.2f} "
              f"{row['per_channel_seen_db']:12.2f} {row['weights_only_db']:13.2f} {row['activations_only_db']:17.2f}")


if __name__ == "__main__":
    main()
