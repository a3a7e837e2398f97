"""Accuracy of quantized PP-OCR models: float vs qtool vs onnxruntime's quantize_static, one run.

    python bench/quality.py                          # rec, det, cls and the demo; ORT baselines too
    python bench/quality.py --models rec --rec-eval 100 --no-ort
    python bench/quality.py --models det --qtool minmax,percentile --executor-samples 2
    python bench/quality.py --style plain --data-seeds 1  # the original data and single seed

Calibration and evaluation data are disjoint (bench/datasets.py, --style varied by default, or
plain: the original renderings): calibration is seed 0, evaluation is drawn from each seed of
--data-seeds (default 1,2; their strings are disjoint from seed 0's and from each other's). Every
row's metrics are computed on each evaluation seed's set separately (the quantized model is built
once); the table gives each metric's mean over the seeds and, with more than one seed, its range
(min..max); --json writes the per-seed values too. The demo has one fixed held-out set.
- rec: rendered text lines with known strings; metric: exact string after CTC decode with the
  charset from the model's metadata, the same with spaces removed (no_space: PaddleOCR's
  RecMetric default, ignore_space=True), plus SQNR against float of the output and of the logits
  (the Softmax's input; likewise for cls, and det's Sigmoid);
- det: crops of scikit-image photos and rendered text pages; metric: probability-map SQNR, the
  IoU of the p > 0.3 masks against float, and mask_frac (the share of pixels with p > 0.3);
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
executor also runs the first N evaluation samples (of each seed) of each qtool row, and the table
gives its agreement with onnxruntime on the same QDQ model. float_ops and seconds (calibration and
quantization time, not evaluation) belong to the row, not to a seed.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
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
from qtool.search import choose_method, choose_methods, search  # noqa: E402

DEMO = ROOT / "qtool" / "demo"
BATCH = {"rec": 8, "det": 1, "cls": 16, "demo": 64}
SEARCH_SAMPLES = {"rec": 16, "det": 4, "cls": 16, "demo": 16}  # det: 640x640, four crops per run
PIXEL = {"rec": 2 / 255, "det": 2 / 255, "cls": 2 / 255}  # one grey level in input units (std 0.5)


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    noise = float(((ref - got) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref ** 2).sum()) / noise)


def run_model(model, x, batch: int, logits_node: str | None = None):
    """(first output, the input of node ``logits_node`` or None) over ``x``; with a list of arrays,
    a list of such pairs, one per array (one session, each array batched on its own)."""
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
    results = []
    for xi in (x if isinstance(x, list) else [x]):
        runs = [session.run(names, {name: xi[i:i + batch]}) for i in range(0, len(xi), batch)]
        y = np.concatenate([r[0] for r in runs])
        results.append((y, np.concatenate([r[1] for r in runs]) if node is not None else None))
    return results if isinstance(x, list) else results[0]


class EvalSet:
    """One evaluation seed's inputs and ground truth."""

    def __init__(self, seed, x: np.ndarray, strings=None, labels=None):
        self.seed, self.x, self.strings, self.labels = seed, x, strings, labels


def parse_seeds(text: str) -> list[int]:
    """--data-seeds: distinct seeds, none sharing seed 0's string bucket (the calibration set)."""
    seeds = [int(v) for v in str(text).split(",") if v.strip()]
    buckets = [s % datasets.SEED_BUCKETS for s in seeds]
    if not seeds or 0 in buckets or len(set(buckets)) != len(buckets):
        raise ValueError(f"--data-seeds {text!r}: need seeds that differ modulo {datasets.SEED_BUCKETS} "
                         f"and none that is 0 modulo {datasets.SEED_BUCKETS} (calibration is seed 0; "
                         "strings are disjoint only between seeds of different buckets)")
    return seeds


class Workload:
    """Model path, calibration data, the evaluation sets (one per data seed), and the metric.

    ``args`` needs the sizes (rec_calib, rec_eval, ...); ``data_seeds`` (default "1") and ``style``
    (default datasets.DEFAULT_STYLE) are optional. ``x``, ``strings`` and ``labels`` are the first
    evaluation set's, and ``run``/``metrics`` default to it (bench/equalize.py uses them so).
    """

    def __init__(self, kind: str, args, workdir: Path):
        self.kind = kind
        style = getattr(args, "style", None) or datasets.DEFAULT_STYLE
        seeds = parse_seeds(getattr(args, "data_seeds", None) or "1")
        if kind == "demo":
            self.model = DEMO / "digits_cnn.onnx"
            self.calib = DEMO / "digits_calib.npz"
            held = np.load(DEMO / "digits_heldout.npz")
            self.sets = [EvalSet("heldout", held["input"], labels=held["label"])]
        else:
            self.model = Path(datasets.model_path(kind))
            self.calib = workdir / f"{kind}_calib.npz"
            self.sets = []
            if kind == "rec":
                xc, _ = datasets.text_lines(args.rec_calib, seed=0, style=style)
                for seed in seeds:
                    x, strings = datasets.text_lines(args.rec_eval, seed=seed, style=style)
                    self.sets.append(EvalSet(seed, x, strings=strings))
                self.charset = datasets.rec_charset(str(self.model))
            elif kind == "cls":
                xc, _ = datasets.cls_lines(args.cls_calib, seed=0, style=style)
                for seed in seeds:
                    x, labels = datasets.cls_lines(args.cls_eval, seed=seed, style=style)
                    self.sets.append(EvalSet(seed, x, labels=labels))
            else:
                xc = datasets.det_crops(args.det_calib, seed=0, size=args.det_size, style=style)
                for seed in seeds:
                    self.sets.append(EvalSet(seed, datasets.det_crops(args.det_eval, seed=seed, size=args.det_size,
                                                                      style=style)))
            np.savez(self.calib, x=xc)
        self.x, self.strings, self.labels = self.sets[0].x, self.sets[0].strings, self.sets[0].labels

    @functools.cached_property
    def logits_node(self) -> str | None:
        """The final Softmax/Sigmoid, whose input is scored too (probabilities saturate)."""
        node = scored_node(onnx.load(str(self.model)))
        return node.name if node is not None else None

    def run(self, model, x: np.ndarray | None = None):
        return run_model(model, self.x if x is None else x, BATCH[self.kind], self.logits_node)

    def run_sets(self, model) -> list:
        """``run`` on every evaluation set: a list of (output, logits), one per set."""
        return run_model(model, [e.x for e in self.sets], BATCH[self.kind], self.logits_node)

    def metrics(self, outputs, reference, index: int = 0) -> dict:
        """Metrics of ``outputs`` against the float ``reference`` on evaluation set ``index``."""
        (y, logits), (ref, ref_logits) = outputs, reference
        strings, labels = self.sets[index].strings, self.sets[index].labels
        out = {"sqnr_db": sqnr_db(ref, y)}
        if logits is not None and ref_logits is not None and logits.size == ref_logits.size:
            # the opset-13 upgrade puts a Flatten before rec's Softmax: same values, another shape
            out["logit_sqnr_db"] = sqnr_db(ref_logits, logits.reshape(ref_logits.shape))
        if self.kind == "rec":
            pred = datasets.ctc_decode(y, self.charset)
            out["word_acc"] = float(np.mean([p == s for p, s in zip(pred, strings)]))
            # PaddleOCR's RecMetric compares with spaces removed (ignore_space=True by default)
            out["no_space"] = float(np.mean([p.replace(" ", "") == s.replace(" ", "")
                                             for p, s in zip(pred, strings)]))
        elif self.kind == "det":
            a, b = ref > 0.3, y > 0.3
            union = (a | b).sum()  # both masks empty (photos only): the masks agree
            out["iou"] = float((a & b).sum() / union) if union else 1.0
            out["mask_frac"] = float(b.mean())
        elif self.kind == "cls":
            out["agree"] = float(np.mean(y.argmax(1) == ref.argmax(1)))
        else:
            out["top1"] = float(np.mean(y.argmax(1) == labels))
        return out


PERCENT = ("word_acc", "no_space", "agree", "top1", "executor_agree", "mask_frac")
DB = ("sqnr_db", "logit_sqnr_db", "executor_sqnr_db")


def _value(key: str, value) -> str:
    if key in PERCENT:
        return f"{100 * value:.1f}%"
    if key == "iou":
        return f"{value:.4f}"
    if key in DB:
        return f"{value:.1f} dB"
    if isinstance(value, float):
        return f"{value:.1f}"
    return f"{value}"


def _label(key: str) -> str:
    return key.replace("_db", "") if key in DB else key


def fmt(metrics: dict) -> str:
    """One set's metrics (or a row's seed-independent fields) as text."""
    parts = []
    for key, value in metrics.items():
        if key == "iou" or key in PERCENT or key in DB or isinstance(value, float):
            parts.append(f"{_label(key)} {_value(key, value)}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def summary(per_set: list[dict]) -> dict:
    """{metric: {"mean", "min", "max"}} over the sets, for the numeric metrics every set has."""
    out = {}
    for key in per_set[0]:
        values = [m.get(key) for m in per_set]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            values = [float(v) for v in values]
            out[key] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values)}
    return out


def fmt_row(per_set: list[dict], extra: dict | None = None, skip=()) -> str:
    """Each metric's mean over the sets, with (min..max) when there are several; then ``extra``."""
    errors = [m["error"] for m in per_set if "error" in m]
    if errors:
        return f"error {errors[0]}"
    parts = []
    for key, stat in summary(per_set).items():
        if key in skip:
            continue
        text = f"{_label(key)} {_value(key, stat['mean'])}"
        if len(per_set) > 1:
            lo, hi = _value(key, stat["min"]), _value(key, stat["max"])
            unit = " dB" if key in DB else "%" if key in PERCENT else ""
            text += f" ({lo.removesuffix(unit)}..{hi})"
        parts.append(text)
    if extra:
        parts.append(fmt(extra))
    return ", ".join(p for p in parts if p)


class Row:
    """A table row: metrics per evaluation set, and the row's own fields (float_ops, seconds)."""

    def __init__(self, name: str, per_set: list[dict], extra: dict | None = None):
        self.name, self.per_set, self.extra = name, per_set, dict(extra or {})

    def text(self, skip=()) -> str:
        return fmt_row(self.per_set, self.extra, skip)

    def as_json(self, w: Workload, skip=()) -> dict:
        """Per-seed metrics and their summary; an infinite SQNR (identical outputs) as "inf"."""
        def clean(value):
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items() if k not in skip}
            return value if not isinstance(value, float) or math.isfinite(value) else str(value)

        return {"quantizer": self.name,
                "per_seed": {str(e.seed): clean(m) for e, m in zip(w.sets, self.per_set)},
                "summary": clean(summary(self.per_set)), **clean(self.extra)}


def scored(w: Workload, model, refs) -> list[dict]:
    """``model`` run on every evaluation set and scored against that set's float reference."""
    return [w.metrics(out, ref, i) for i, (out, ref) in enumerate(zip(w.run_sets(model), refs))]


def noise_row(w: Workload, refs, pixels: float) -> list[dict]:
    """The float model on inputs with Gaussian noise of ``pixels`` grey levels (std): how much of
    a metric moves under a perturbation far below what int8 activations add."""
    out = []
    for i, (e, ref) in enumerate(zip(w.sets, refs)):
        rng = np.random.default_rng(0)
        noisy = e.x + rng.normal(0, pixels * PIXEL[w.kind], e.x.shape).astype(np.float32)
        out.append(w.metrics(w.run(w.model, noisy), ref, i))
    return out


def qtool_row(w: Workload, method: str, refs, args, workdir: Path, bias: bool = False) -> tuple[list, dict]:
    t = time.perf_counter()
    table = calibrate(w.model, w.calib, method, batch_size=BATCH[w.kind], progress=False)
    if bias:
        qmodel, report, _ = quantize_corrected(w.model, table, QuantizeOptions(), "table", w.calib,
                                               args.bias_samples, BATCH[w.kind], progress=False)
    else:
        qmodel, report = quantize(w.model, table, QuantizeOptions())
    seconds = time.perf_counter() - t
    return measured(w, qmodel, report, refs, args, seconds)


def default_row(w: Workload, refs, args) -> tuple[list, dict]:
    """What `qtool quantize --data` does by default: minmax table, the whole-model method choice
    (percentile, mse; judged on held-out calibration samples), then judged bias correction."""
    t = time.perf_counter()
    table = calibrate(w.model, w.calib, "minmax", batch_size=BATCH[w.kind], progress=False)
    table, pick = choose_method(w.model, table, QuantizeOptions(), "table", w.calib,
                                num_samples=args.bias_samples, batch_size=BATCH[w.kind], progress=False)
    qmodel, report, _ = quantize_corrected(w.model, table, QuantizeOptions(), "table", w.calib,
                                           args.bias_samples, BATCH[w.kind], progress=False)
    print(f"{w.kind} default: method {pick.chosen} (fit {pick.fit_db}, held-out {pick.heldout_table_db} "
          f"-> {pick.heldout_chosen_db})", file=sys.stderr, flush=True)
    return measured(w, qmodel, report, refs, args, time.perf_counter() - t)


def best_row(w: Workload, refs, args) -> tuple[list, dict]:
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
    return measured(w, qmodel, report, refs, args, time.perf_counter() - t)


def measured(w: Workload, qmodel, report, refs, args, seconds: float) -> tuple[list, dict]:
    """(metrics per evaluation set, {float_ops, seconds}) of a quantized model."""
    outs = w.run_sets(qmodel)
    per_set = [w.metrics(out, ref, i) for i, (out, ref) in enumerate(zip(outs, refs))]
    if args.executor_samples:
        n = args.executor_samples
        executor = IntegerExecutor(qmodel)
        name = qmodel.graph.input[0].name
        for e, out, metrics in zip(w.sets, outs, per_set):
            got = np.concatenate([executor.run({name: e.x[i:i + 1]}).outputs[qmodel.graph.output[0].name]
                                  for i in range(min(n, len(e.x)))])
            metrics["executor_sqnr_db"] = sqnr_db(out[0][:len(got)], got)  # against onnxruntime, same model
    return per_set, {"float_ops": len(report.kept_float), "seconds": seconds}


def ort_row(w: Workload, method: str, refs, workdir: Path) -> tuple[list, dict]:
    out = workdir / f"{w.kind}_ort_{method}.onnx"
    res = ort_baseline.run_quantize_static(str(w.model), str(w.calib), method, str(out),
                                           batch_size=BATCH[w.kind], opset=13, prep="ort",
                                           max_memory_gb=20)
    if res.get("error"):
        return [{"error": str(res["error"]).splitlines()[-1][:120]}], {}
    try:
        onnx.checker.check_model(onnx.load(str(out)), full_check=True)
        per_set = scored(w, out, refs)
    except Exception as e:  # an invalid model is a result here, not a crash
        return [{"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}], {}
    return per_set, {"seconds": res["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="rec,det,cls,demo")
    parser.add_argument("--qtool", default="minmax,percentile,kl,mse", help="calibration methods")
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime quantize_static")
    parser.add_argument("--style", choices=datasets.STYLES, default=datasets.DEFAULT_STYLE,
                        help="bench/datasets.py data style (plain: the original renderings)")
    parser.add_argument("--data-seeds", default="1,2",
                        help="evaluation seeds, comma-separated (calibration is seed 0); each row's "
                             "metrics are given as the mean over them and their range")
    parser.add_argument("--json", metavar="PATH", help="also write the rows, with per-seed values, as JSON")
    parser.add_argument("--rec-calib", type=int, default=64)
    parser.add_argument("--rec-eval", type=int, default=200, help="rec lines per evaluation seed")
    parser.add_argument("--cls-calib", type=int, default=64)
    parser.add_argument("--cls-eval", type=int, default=200, help="cls lines per evaluation seed")
    parser.add_argument("--det-calib", type=int, default=16)
    parser.add_argument("--det-eval", type=int, default=8, help="det crops per evaluation seed")
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
    try:
        seeds = parse_seeds(args.data_seeds)
    except ValueError as e:
        parser.error(str(e))
    kinds = args.models.split(",")
    sizes = {"rec": args.rec_eval, "cls": args.cls_eval, "det": args.det_eval}
    header = (f"data: style {args.style}, calibration seed 0, evaluation seeds {','.join(map(str, seeds))} ("
              + ", ".join(f"{k} {sizes[k]}" for k in kinds if k in sizes) + " per seed); metrics: mean"
              + (" (min..max) over the seeds" if len(seeds) > 1 else "") + "; the demo: its held-out set")
    fonts = datasets.varied_fonts() if args.style == "varied" and set(kinds) & {"rec", "cls", "det"} else []
    print(header, file=sys.stderr, flush=True)
    report = {"style": args.style, "data_seeds": seeds, "calibration_seed": 0, "fonts": fonts,
              "sizes": {"rec_calib": args.rec_calib, "rec_eval": args.rec_eval, "cls_calib": args.cls_calib,
                        "cls_eval": args.cls_eval, "det_calib": args.det_calib, "det_eval": args.det_eval,
                        "det_size": args.det_size},
              "rows": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qtool-quality-") as tmp:
        workdir = Path(tmp)
        lines = [header, "", "| model | quantizer | metrics |", "|---|---|---|"]
        for kind in kinds:
            w = Workload(kind, args, workdir)
            refs = w.run_sets(w.model)
            rows = [Row("float", [w.metrics(ref, ref, i) for i, ref in enumerate(refs)])]
            if kind in PIXEL and args.noise:
                rows.append(Row(f"float, input + noise {args.noise:g} grey level", noise_row(w, refs, args.noise)))
            for method in args.qtool.split(","):
                for bias in (False, True) if args.bias_samples else (False,):
                    name = f"qtool {method}" + (" + bias correction" if bias else "")
                    rows.append(Row(name, *qtool_row(w, method, refs, args, workdir, bias)))
                    print(f"{kind} {name}: {rows[-1].text()}", file=sys.stderr, flush=True)
            if args.bias_samples:
                rows.append(Row("qtool default with --data", *default_row(w, refs, args)))
                print(f"{kind} qtool default with --data: {rows[-1].text()}", file=sys.stderr, flush=True)
            if args.best:
                rows.append(Row("qtool best", *best_row(w, refs, args)))
                print(f"{kind} qtool best: {rows[-1].text()}", file=sys.stderr, flush=True)
            if not args.no_ort and kind != "demo":
                for method in ("MinMax", "Entropy"):
                    rows.append(Row(f"ORT {method}", *ort_row(w, method, refs, workdir)))
                    print(f"{kind} ORT {method}: {rows[-1].text()}", file=sys.stderr, flush=True)
            for row in rows:
                skip = ("sqnr_db", "logit_sqnr_db", "iou") if row.name == "float" else ()
                lines.append(f"| {kind} | {row.name} | {row.text(skip)} |")
                report["rows"].append({"model": kind, **row.as_json(w, skip)})
        print("\n".join(lines))
    report["wall_seconds"] = time.perf_counter() - started
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=float) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
