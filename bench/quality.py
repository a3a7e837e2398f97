"""Accuracy of quantized PP-OCR models: float vs qtool vs onnxruntime's quantize_static, one run.

    python bench/quality.py                          # rec, det, cls and the demo; ORT baselines too
    python bench/quality.py --models rec --rec-eval 100 --no-ort
    python bench/quality.py --models det --qtool minmax,percentile --executor-samples 2

Calibration and evaluation data are disjoint (bench/datasets.py, different seeds):
- rec: rendered text lines with known strings; metric: exact string after CTC decode with the
  charset from the model's metadata, the same with spaces removed (no_space: PaddleOCR's
  RecMetric default, ignore_space=True), plus SQNR against float of the output and of the logits
  (the Softmax's input; likewise for cls, and det's Sigmoid);
- det: crops of scikit-image photos and rendered text pages; metric: probability-map SQNR and the
  IoU of the p > 0.3 masks against float;
- cls: rendered lines, half rotated by 180 degrees; metric: top-1 agreement with float;
- demo: the shipped digits CNN on its held-out set; metric: top-1 accuracy.

Rows: float; the float model on inputs with half a grey level of Gaussian noise (--noise: how
fragile the metric is); qtool with each --qtool method (asymmetric int8 activations, per-channel
weights, 32-bit multipliers), without and with bias correction on the first --bias-samples
calibration samples, run by onnxruntime on the QDQ model; qtool best (minmax, bias correction and
the fewest ops float that reach --best-target dB on the first --search-samples calibration
samples: quantize --data --target-sqnr); onnxruntime quantize_static MinMax and
Entropy (per-channel QDQ, opset upgraded to 13 and quant_pre_process, bench/ort_baseline.py: the
settings it needs to write a valid model here). With --executor-samples N, qtool's integer
executor also runs the first N evaluation samples of each qtool row, and the table gives its
agreement with onnxruntime on the same QDQ model.

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
import ort_baseline  # noqa: E402

from qtool.analyze import scored_node  # noqa: E402
from qtool.bias_correction import quantize_corrected  # noqa: E402
from qtool.calibrate import calibrate  # noqa: E402
from qtool.executor import IntegerExecutor  # noqa: E402
from qtool.quantize import QuantizeOptions, quantize  # noqa: E402
from qtool.search import choose_methods, search  # noqa: E402

DEMO = ROOT / "qtool" / "demo"
BATCH = {"rec": 8, "det": 1, "cls": 16, "demo": 64}
SEARCH_SAMPLES = {"rec": 16, "det": 4, "cls": 16, "demo": 16}  # det: 640x640, four crops per run
PIXEL = {"rec": 2 / 255, "det": 2 / 255, "cls": 2 / 255}  # one grey level in input units (std 0.5)


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    noise = float(((ref - got) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref ** 2).sum()) / noise)


def run_model(model, x: np.ndarray, batch: int, logits_node: str | None = None):
    """(first output, the input of node ``logits_node`` or None) over ``x``."""
    model = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    names = [model.graph.output[0].name]
    node = next((n for n in model.graph.node if n.name == logits_node), None) if logits_node else None
    if node is not None:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.append(onnx.helper.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT,
                                                                     None))
        names.append(node.input[0])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    runs = [session.run(names, {name: x[i:i + batch]}) for i in range(0, len(x), batch)]
    y = np.concatenate([r[0] for r in runs])
    return y, (np.concatenate([r[1] for r in runs]) if node is not None else None)


class Workload:
    """Model path, calibration and evaluation data, and the metric."""

    def __init__(self, kind: str, args, workdir: Path):
        self.kind = kind
        self.labels = self.strings = None
        if kind == "demo":
            self.model = DEMO / "digits_cnn.onnx"
            self.calib = DEMO / "digits_calib.npz"
            held = np.load(DEMO / "digits_heldout.npz")
            self.x, self.labels = held["input"], held["label"]
            return
        self.model = Path(datasets.model_path(kind))
        self.calib = workdir / f"{kind}_calib.npz"
        if kind == "rec":
            xc, _ = datasets.text_lines(args.rec_calib, seed=0)
            self.x, self.strings = datasets.text_lines(args.rec_eval, seed=1)
            self.charset = datasets.rec_charset(str(self.model))
        elif kind == "cls":
            xc, _ = datasets.cls_lines(args.cls_calib, seed=0)
            self.x, _ = datasets.cls_lines(args.cls_eval, seed=1)
        else:
            xc = datasets.det_crops(args.det_calib, seed=0, size=args.det_size)
            self.x = datasets.det_crops(args.det_eval, seed=1, size=args.det_size)
        np.savez(self.calib, x=xc)

    @functools.cached_property
    def logits_node(self) -> str | None:
        """The final Softmax/Sigmoid, whose input is scored too (probabilities saturate)."""
        node = scored_node(onnx.load(str(self.model)))
        return node.name if node is not None else None

    def run(self, model, x: np.ndarray | None = None):
        return run_model(model, self.x if x is None else x, BATCH[self.kind], self.logits_node)

    def metrics(self, outputs, reference) -> dict:
        (y, logits), (ref, ref_logits) = outputs, reference
        out = {"sqnr_db": sqnr_db(ref, y)}
        if logits is not None and ref_logits is not None and logits.size == ref_logits.size:
            # the opset-13 upgrade puts a Flatten before rec's Softmax: same values, another shape
            out["logit_sqnr_db"] = sqnr_db(ref_logits, logits.reshape(ref_logits.shape))
        if self.kind == "rec":
            pred = datasets.ctc_decode(y, self.charset)
            out["word_acc"] = float(np.mean([p == s for p, s in zip(pred, self.strings)]))
            # PaddleOCR's RecMetric compares with spaces removed (ignore_space=True by default)
            out["no_space"] = float(np.mean([p.replace(" ", "") == s.replace(" ", "")
                                             for p, s in zip(pred, self.strings)]))
        elif self.kind == "det":
            a, b = ref > 0.3, y > 0.3
            out["iou"] = float((a & b).sum() / max(1, (a | b).sum()))
        elif self.kind == "cls":
            out["agree"] = float(np.mean(y.argmax(1) == ref.argmax(1)))
        else:
            out["top1"] = float(np.mean(y.argmax(1) == self.labels))
        return out


def fmt(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        if key in ("word_acc", "no_space", "agree", "top1", "iou", "executor_agree"):
            parts.append(f"{key} {100 * value:.1f}%" if key != "iou" else f"iou {value:.4f}")
        elif key in ("sqnr_db", "logit_sqnr_db", "executor_sqnr_db"):
            parts.append(f"{key.replace('_db', '')} {value:.1f} dB")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.1f}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def noise_row(w: Workload, ref: np.ndarray, pixels: float) -> dict:
    """The float model on inputs with Gaussian noise of ``pixels`` grey levels (std): how much of
    a metric moves under a perturbation far below what int8 activations add."""
    rng = np.random.default_rng(0)
    noisy = w.x + rng.normal(0, pixels * PIXEL[w.kind], w.x.shape).astype(np.float32)
    return w.metrics(w.run(w.model, noisy), ref)


def qtool_row(w: Workload, method: str, ref: np.ndarray, args, workdir: Path, bias: bool = False) -> dict:
    t = time.perf_counter()
    table = calibrate(w.model, w.calib, method, batch_size=BATCH[w.kind], progress=False)
    if bias:
        qmodel, report, _ = quantize_corrected(w.model, table, QuantizeOptions(), "table", w.calib,
                                               args.bias_samples, BATCH[w.kind], progress=False)
    else:
        qmodel, report = quantize(w.model, table, QuantizeOptions())
    seconds = time.perf_counter() - t
    return measured(w, qmodel, report, ref, args, seconds)


def best_row(w: Workload, ref, args) -> dict:
    """minmax, then (with --best-methods) each tensor's best method among them, then bias
    correction and the float-op search for --best-target dB (at most --best-max-float ops)."""
    t = time.perf_counter()
    samples = args.search_samples or SEARCH_SAMPLES[w.kind]
    table = calibrate(w.model, w.calib, "minmax", batch_size=BATCH[w.kind], progress=False)
    if args.best_methods:
        table, _ = choose_methods(w.model, table, args.best_methods.split(","), QuantizeOptions(), "table",
                                  w.calib, samples, BATCH[w.kind], progress=False,
                                  calibrate_batch=BATCH[w.kind])
    if args.best_max_float or args.best_target is not None:
        qmodel, report, _ = search(w.model, table, QuantizeOptions(), "table", w.calib, args.best_target,
                                   args.best_max_float or None, samples, BATCH[w.kind], progress=False)
    else:
        qmodel, report, _ = quantize_corrected(w.model, table, QuantizeOptions(), "table", w.calib,
                                               args.bias_samples, BATCH[w.kind], progress=False)
    return measured(w, qmodel, report, ref, args, time.perf_counter() - t)


def measured(w: Workload, qmodel, report, ref, args, seconds: float) -> dict:
    out = w.run(qmodel)
    y = out[0]
    metrics = w.metrics(out, ref)
    metrics["float_ops"] = len(report.kept_float)
    metrics["seconds"] = seconds
    if args.executor_samples:
        n = args.executor_samples
        executor = IntegerExecutor(qmodel)
        name = qmodel.graph.input[0].name
        got = np.concatenate([executor.run({name: w.x[i:i + 1]}).outputs[qmodel.graph.output[0].name]
                              for i in range(n)])
        metrics["executor_sqnr_db"] = sqnr_db(y[:n], got)  # against onnxruntime on the same model
    return metrics


def ort_row(w: Workload, method: str, ref: np.ndarray, workdir: Path) -> dict:
    out = workdir / f"{w.kind}_ort_{method}.onnx"
    res = ort_baseline.run_quantize_static(str(w.model), str(w.calib), method, str(out),
                                           batch_size=BATCH[w.kind], opset=13, prep="ort",
                                           max_memory_gb=20)
    if res.get("error"):
        return {"error": str(res["error"]).splitlines()[-1][:120]}
    try:
        onnx.checker.check_model(onnx.load(str(out)), full_check=True)
        outputs = w.run(out)
    except Exception as e:  # an invalid model is a result here, not a crash
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    metrics = w.metrics(outputs, ref)
    metrics["seconds"] = res["wall_seconds"]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="rec,det,cls,demo")
    parser.add_argument("--qtool", default="minmax,percentile,kl,mse", help="calibration methods")
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime quantize_static")
    parser.add_argument("--rec-calib", type=int, default=64)
    parser.add_argument("--rec-eval", type=int, default=200)
    parser.add_argument("--cls-calib", type=int, default=64)
    parser.add_argument("--cls-eval", type=int, default=200)
    parser.add_argument("--det-calib", type=int, default=16)
    parser.add_argument("--det-eval", type=int, default=8)
    parser.add_argument("--det-size", type=int, default=640)
    parser.add_argument("--executor-samples", type=int, default=0)
    parser.add_argument("--bias-samples", type=int, default=16,
                        help="calibration samples for the bias-corrected rows (0: no such rows)")
    parser.add_argument("--no-best", dest="best", action="store_false", help="skip the qtool best row")
    parser.add_argument("--best-methods", default="",
                        help="qtool best: methods tried per tensor against minmax, e.g. percentile,mse,kl "
                             "(default none: on PP-OCR the choice does not carry over to held-out data)")
    parser.add_argument("--best-max-float", type=int, default=0, help="qtool best: at most N ops float")
    parser.add_argument("--best-target", type=float, default=25.0,
                        help="qtool best: target SQNR in dB (of the logits under a final Softmax/Sigmoid)")
    parser.add_argument("--search-samples", type=int, default=0,
                        help="calibration samples the qtool best searches score on (0: per model, "
                             f"{SEARCH_SAMPLES})")
    parser.add_argument("--noise", type=float, default=0.5,
                        help="grey levels (std) of input noise for the float reference row (0: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qtool-quality-") as tmp:
        workdir = Path(tmp)
        lines = ["| model | quantizer | metrics |", "|---|---|---|"]
        for kind in args.models.split(","):
            w = Workload(kind, args, workdir)
            ref = w.run(w.model)
            rows = [("float", w.metrics(ref, ref))]
            if kind in PIXEL and args.noise:
                rows.append((f"float, input + noise {args.noise:g} grey level",
                             noise_row(w, ref, args.noise)))
            for method in args.qtool.split(","):
                for bias in (False, True) if args.bias_samples else (False,):
                    name = f"qtool {method}" + (" + bias correction" if bias else "")
                    rows.append((name, qtool_row(w, method, ref, args, workdir, bias)))
                    print(f"{kind} {name}: {fmt(rows[-1][1])}", file=sys.stderr, flush=True)
            if args.best:
                rows.append(("qtool best", best_row(w, ref, args)))
                print(f"{kind} qtool best: {fmt(rows[-1][1])}", file=sys.stderr, flush=True)
            if not args.no_ort and kind != "demo":
                for method in ("MinMax", "Entropy"):
                    rows.append((f"ORT {method}", ort_row(w, method, ref, workdir)))
                    print(f"{kind} ORT {method}: {fmt(rows[-1][1])}", file=sys.stderr, flush=True)
            for name, metrics in rows:
                if name == "float":
                    metrics = {k: v for k, v in metrics.items() if k not in ("sqnr_db", "logit_sqnr_db", "iou")}
                lines.append(f"| {kind} | {name} | {fmt(metrics)} |")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
