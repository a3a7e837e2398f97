"""onnxruntime baselines for the benchmark: float inference time and `quantize_static` cost.

Library (import with bench/ on sys.path, or run this file):

    time_ort_inference(model_path, x, batch_size, repeats=3) -> seconds
        one pass over x with a plain CPU InferenceSession (default graph optimizations),
        one warm-up pass first, best of `repeats` passes.
    run_quantize_static(model, data, method, out, batch_size=8, opset=None, prep="none",
                        entropy_bins=None, timeout=None, max_memory_gb=None) -> dict
        runs onnxruntime.quantization.quantize_static in a fresh child process (this file's
        `_worker` command) and returns wall_seconds, peak_rss_mb (the child's ru_maxrss from
        os.wait4), quantize_seconds (inside the child), returncode, error, warnings.
    validate_quantized(float_model, q_model, x, batch_size=8, strings=None) -> dict
        onnx.checker, onnxruntime load + run of the quantized model, agreement with the float
        model (cosine; det: IoU of p>0.3 maps; rec with `strings`: exact-string accuracy).
    constants_to_initializers(model_proto)   Constant nodes -> graph initializers
    NpzDataReader(npz, input_name, batch_size)  CalibrationDataReader over an .npz

quantize_static settings (its defaults unless noted): QuantFormat.QDQ, per_channel=True (not the
default), activation_type=QInt8, weight_type=QInt8, reduce_range=False, all op types, extra_options
None (so ActivationSymmetric=False, WeightSymmetric=True; the calibrators keep every batch's
intermediate outputs in memory because CalibMaxIntermediateOutputs is unset).

What the PP-OCR models need (onnxruntime 1.31):
- they hold every weight in a Constant node (no initializers), so quantize_static sees no weights:
  it treats them as activations (per-tensor, calibrated), ignores per_channel and leaves biases
  float. `--prep constants` or `--prep ort` (quant_pre_process) turn them into initializers;
- they are opset 12, where DequantizeLinear has no `axis`: with initializers, per-channel QDQ
  writes an invalid model ("Unrecognized attribute: axis for operator DequantizeLinear");
  `--opset 13` converts the model first with onnx.version_converter;
- quantize_static's Entropy uses 128 histogram bins and 128 quantized bins, which leaves the KL
  search one candidate (the whole range): its models are byte-identical to MinMax's.
  `--entropy-bins 2048` calibrates with more bins through a calibration cache.

Command line (python bench/ort_baseline.py CMD --help):

    make-data rec|det|cls --n 64 --seed 0 --out D.npz     build a dataset with bench/datasets.py
    time --model M --data D.npz --batch-size 1,8,16       float inference seconds per batch size
    quantize_static --model M --data D.npz --method MinMax|Entropy|Percentile|Distribution
                    --out Q.onnx [--batch-size 8] [--opset 13] [--prep none|constants|ort]
                    [--entropy-bins N] [--max-memory-gb G] [--timeout S] [--eval D2.npz]
        quantize in a child process; print its cost as one JSON line, then (with --eval) the
        validation of the written model on D2.npz as another.

`--model` takes a path or rec/det/cls (the models in the rapidocr-onnxruntime wheel).
Example (the recommended baseline for PP-OCRv4 rec):

    python bench/ort_baseline.py make-data rec --n 64 --seed 0 --out /tmp/rec_cal.npz
    python bench/ort_baseline.py make-data rec --n 64 --seed 1 --out /tmp/rec_eval.npz
    python bench/ort_baseline.py quantize_static --model rec --data /tmp/rec_cal.npz \
        --method MinMax --opset 13 --prep ort --out /tmp/rec.q.onnx --eval /tmp/rec_eval.npz
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datasets  # noqa: E402

METHODS = ("MinMax", "Entropy", "Percentile", "Distribution")


def _resolve_model(model: str) -> str:
    return datasets.model_path(model) if model in ("rec", "det", "cls") else model


def _session(model_path: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # the PP-OCR exports warn about every unused constant
    return ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])


def _run_batches(sess, x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    name = sess.get_inputs()[0].name
    return [sess.run(None, {name: x[i:i + batch_size]})[0] for i in range(0, len(x), batch_size)]


def time_ort_inference(model_path: str, x: np.ndarray, batch_size: int, repeats: int = 3) -> float:
    """Seconds for one pass over x in batches: warm-up pass, then best of `repeats` passes."""
    sess = _session(_resolve_model(model_path))
    _run_batches(sess, x, batch_size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _run_batches(sess, x, batch_size)
        best = min(best, time.perf_counter() - start)
    return best


def _load_npz_input(path: str, input_name: str | None = None) -> np.ndarray:
    with np.load(path) as z:
        if input_name and input_name in z.files:
            return z[input_name]
        floats = [k for k in z.files if z[k].dtype == np.float32]
        if len(floats) != 1:
            raise ValueError(f"{path}: expected one float32 array or one named {input_name!r}, "
                             f"found {z.files}")
        return z[floats[0]]


@functools.lru_cache(maxsize=None)
def _calibration_reader_class():
    from onnxruntime.quantization import CalibrationDataReader

    class NpzDataReader(CalibrationDataReader):
        """Feeds an .npz's input array in batches of batch_size (the last one may be smaller)."""

        def __init__(self, npz: str, input_name: str, batch_size: int = 8):
            self.x = _load_npz_input(npz, input_name)
            self.input_name, self.batch_size, self.pos = input_name, batch_size, 0

        def get_next(self):
            if self.pos >= len(self.x):
                return None
            batch = self.x[self.pos:self.pos + self.batch_size]
            self.pos += self.batch_size
            return {self.input_name: batch}

        def rewind(self):
            self.pos = 0

    return NpzDataReader


def __getattr__(name):  # NpzDataReader without importing onnxruntime.quantization at import time
    if name == "NpzDataReader":
        return _calibration_reader_class()
    raise AttributeError(name)


def constants_to_initializers(proto):
    """Move every main-graph Constant node's value into graph.initializer (same name), in place.

    The PP-OCR exports (paddle2onnx) hold all weights and biases in Constant nodes and have no
    initializers, so quantize_static sees no weights: it quantizes them like activations
    (per-tensor, calibrated ranges), ignores per_channel and leaves biases float.
    """
    from onnx import helper, numpy_helper

    dtypes = {"value_float": np.float32, "value_floats": np.float32,
              "value_int": np.int64, "value_ints": np.int64}
    keep = []
    for node in proto.graph.node:
        attr = node.attribute[0] if node.op_type == "Constant" and node.attribute else None
        if attr is None or attr.name not in ("value", *dtypes):
            keep.append(node)  # not a Constant, or a sparse / string one: leave it
            continue
        if attr.name == "value":
            tensor = attr.t
        else:
            value = np.array(helper.get_attribute_value(attr), dtype=dtypes[attr.name])
            tensor = numpy_helper.from_array(value)
        tensor.name = node.output[0]
        proto.graph.initializer.append(tensor)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
    return proto


PREPS = ("none", "constants", "ort")


def _quantize_in_this_process(model: str, data: str, method: str, out: str, batch_size: int,
                              opset: int | None, prep: str = "none",
                              entropy_bins: int | None = None) -> dict:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    proto = onnx.load(model)
    input_name = proto.graph.input[0].name
    result = {"opset_in": max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
              "prep": prep}
    if opset is not None:
        from onnx import version_converter

        start = time.perf_counter()
        proto = version_converter.convert_version(proto, opset)
        result["convert_seconds"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    if prep == "constants":
        proto = constants_to_initializers(proto)
    elif prep == "ort":
        from onnxruntime.quantization.shape_inference import quant_pre_process

        # Give it a file: on a ModelProto without initializers (these models) onnxruntime 1.31's
        # quant_pre_process fails inside extract_raw_data_from_model, logs the error and goes
        # on with the unoptimized model. Symbolic shape inference would need sympy: skipped.
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "prep.onnx")
            onnx.save(proto, src)
            quant_pre_process(src, dst, skip_symbolic_shape=True)
            proto = onnx.load(dst)
    result["prep_seconds"] = round(time.perf_counter() - start, 2)
    result["initializers"] = len(proto.graph.initializer)
    reader = _calibration_reader_class()(data, input_name, batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cache = None
        if entropy_bins is not None:
            if method != "Entropy":
                raise ValueError(f"--entropy-bins needs --method Entropy, not {method}")
            cache = os.path.join(tmp, "ranges.json")
            _entropy_ranges(proto, reader, entropy_bins, tmp, cache)
            result["entropy_bins"] = entropy_bins
        quantize_static(proto, out, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        calibrate_method=getattr(CalibrationMethod, method),
                        calibration_cache_path=cache)
        result["quantize_seconds"] = round(time.perf_counter() - start, 2)
    return result


def _entropy_ranges(proto, reader, num_bins: int, tmp: str, cache: str) -> None:
    """Entropy calibration with num_bins histogram bins, written as a quantize_static cache.

    quantize_static builds its EntropyCalibrater with num_bins = num_quantized_bins = 128 and
    passes no option to change them; with equal counts the KL search has a single candidate,
    the whole histogram, so its "Entropy" ranges equal MinMax's (the written models are
    byte-identical). Here we build the calibrator ourselves (num_quantized_bins stays 128).
    """
    import onnx
    from onnxruntime.quantization.calibrate import (CalibrationMethod, create_calibrator,
                                                    save_tensors_data)

    path = os.path.join(tmp, "calib_input.onnx")
    onnx.save(proto, path)
    calibrator = create_calibrator(path, augmented_model_path=os.path.join(tmp, "augmented.onnx"),
                                   calibrate_method=CalibrationMethod.Entropy,
                                   extra_options={"num_bins": num_bins, "num_quantized_bins": 128})
    calibrator.collect_data(reader)
    save_tensors_data(calibrator.compute_data(), cache)


def run_quantize_static(model: str, data: str, method: str, out: str, batch_size: int = 8,
                        opset: int | None = None, prep: str = "none",
                        entropy_bins: int | None = None, timeout: float | None = None,
                        max_memory_gb: float | None = None) -> dict:
    """quantize_static in a fresh child process; returns its cost and outcome.

    Keys: wall_seconds (spawn to exit, includes interpreter start and imports),
    quantize_seconds (inside quantize_static, from the child), peak_rss_mb (the child's
    ru_maxrss from os.wait4; a negative returncode is the signal that killed it), error (the
    exception, or the last lines of the child's stderr), out, warnings (distinct
    quantizer warnings with counts). max_memory_gb caps the child's address space
    (RLIMIT_AS), so an oversized calibration fails with MemoryError instead of taking the machine.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    cmd = [sys.executable, os.path.abspath(__file__), "_worker", "--model", _resolve_model(model),
           "--data", data, "--method", method, "--out", out, "--batch-size", str(batch_size)]
    if opset is not None:
        cmd += ["--opset", str(opset)]
    if prep not in PREPS:
        raise ValueError(f"unknown prep {prep!r}; expected one of {PREPS}")
    cmd += ["--prep", prep]
    if entropy_bins is not None:
        cmd += ["--entropy-bins", str(entropy_bins)]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True,
                                preexec_fn=_address_space_limit(max_memory_gb))
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer:
            timer.start()
        # wait4 gives this child's own rusage, also when it was killed (e.g. by the OOM killer)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if timer:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0), err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    result = {"model": model, "method": method, "batch_size": batch_size, "opset": opset,
              "prep": prep, "out": out, "wall_seconds": round(wall, 2), "returncode": proc.returncode,
              "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "error": None}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if lines:
        result.update({k: v for k, v in json.loads(lines[-1]).items() if k != "peak_rss_mb"})
    warnings: dict[str, int] = {}
    for ln in stderr.splitlines():
        if ln.startswith("WARNING:"):
            key = re.sub(r"'[^']*'", "'*'", ln[8:])[:160]
            warnings[key] = warnings.get(key, 0) + 1
    result["warnings"] = warnings
    if proc.returncode != 0 or result.get("error"):
        tail = [ln for ln in stderr.strip().splitlines()
                if ln.strip() and "CleanUnusedInitializers" not in ln][-6:]
        result["error"] = result.get("error") or "\n".join(tail) or f"exit {proc.returncode}"
    return result


def _address_space_limit(gb: float | None):
    if gb is None:
        return None

    def limit():
        import resource

        size = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    return limit


def _worker(args) -> int:
    result, code = {}, 0
    try:
        result = _quantize_in_this_process(args.model, args.data, args.method, args.out,
                                           args.batch_size, args.opset, args.prep,
                                           args.entropy_bins)
    except Exception as exc:  # report what quantize_static did, whatever it is
        result["error"] = f"{type(exc).__name__}: {exc}"
        code = 3
    print(json.dumps(result), flush=True)
    return code


def validate_quantized(float_model: str, q_model: str, x: np.ndarray, batch_size: int = 8,
                       strings: list[str] | None = None) -> dict:
    """Check the written model: onnx.checker, onnxruntime load and run, agreement with float.

    Returns checker / ort_load / ort_run (None when fine, else the error), and when it ran:
    cosine similarity and max abs difference of the outputs, op counts, and for rec (`strings`
    given) the exact-string accuracy of both models.
    """
    import onnx

    out = {"checker": None, "ort_load": None, "ort_run": None}
    proto = onnx.load(q_model)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        out["checker"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    ops = [n.op_type for n in proto.graph.node]
    out["quantize_linear"], out["dequantize_linear"] = (ops.count("QuantizeLinear"),
                                                        ops.count("DequantizeLinear"))
    out["opset"] = max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    try:
        qsess = _session(q_model)
    except Exception as exc:
        out["ort_load"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out
    try:
        yq = np.concatenate(_run_batches(qsess, x, batch_size))
    except Exception as exc:
        out["ort_run"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out
    yf = np.concatenate(_run_batches(_session(_resolve_model(float_model)), x, batch_size))
    a, b = yf.ravel().astype(np.float64), yq.ravel().astype(np.float64)
    out["cosine"] = round(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)), 5)
    out["max_abs_diff"] = round(float(np.abs(a - b).max()), 5)
    if yf.ndim == 4 and yf.shape[1] == 1:  # det probability map: rapidocr binarises at 0.3
        bf, bq = yf > 0.3, yq > 0.3
        out["iou_p>0.3"] = round(float((bf & bq).sum() / max(1, (bf | bq).sum())), 4)
    if strings is not None:
        charset = datasets.rec_charset()
        for tag, y in (("float", yf), ("quant", yq)):
            pred = datasets.ctc_decode(y, charset)
            out[f"{tag}_exact_acc"] = round(float(np.mean([p == s for p, s in zip(pred, strings)])), 4)
    return out


# ---------------------------------------------------------------- command line

def _make_data(args) -> None:
    if args.kind == "rec":
        x, strings = datasets.text_lines(args.n, args.seed, width=args.width or 320)
        np.savez(args.out, x=x, strings=np.array(strings))
    elif args.kind == "cls":
        x, labels = datasets.cls_lines(args.n, args.seed)
        np.savez(args.out, x=x, labels=labels)
    else:
        x = datasets.det_crops(args.n, args.seed, size=args.width or 640)
        np.savez(args.out, x=x)
    print(f"wrote {args.out}: x {x.shape} {x.dtype}")


def _time(args) -> None:
    x = _load_npz_input(args.data, "x")
    for bs in [int(b) for b in args.batch_size.split(",")]:
        seconds = time_ort_inference(args.model, x, bs, repeats=args.repeats)
        print(json.dumps({"model": args.model, "n": len(x), "shape": list(x.shape[1:]),
                          "batch_size": bs, "seconds": round(seconds, 3),
                          "ms_per_sample": round(1000 * seconds / len(x), 2)}), flush=True)


def _quantize(args) -> int:
    result = run_quantize_static(args.model, args.data, args.method, args.out, args.batch_size,
                                 args.opset, args.prep, args.entropy_bins, args.timeout,
                                 args.max_memory_gb)
    print(json.dumps(result), flush=True)
    if args.eval and result["returncode"] == 0 and os.path.exists(args.out):
        with np.load(args.eval) as z:
            x = z["x"] if "x" in z.files else _load_npz_input(args.eval)
            strings = list(z["strings"]) if "strings" in z.files else None
        print(json.dumps(validate_quantized(args.model, args.out, x, args.batch_size, strings)))
    return 0 if result["returncode"] == 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-data", help="build an .npz with bench/datasets.py")
    p.add_argument("kind", choices=["rec", "det", "cls"])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=None, help="rec line width / det size")
    p.add_argument("--out", required=True)
    p = sub.add_parser("time", help="float onnxruntime inference time")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", default="8", help="comma-separated list")
    p.add_argument("--repeats", type=int, default=3)
    for name in ("quantize_static", "_worker"):
        p = sub.add_parser(name, help="onnxruntime quantize_static in a child process"
                           if name == "quantize_static" else "internal: the child's side")
        p.add_argument("--model", required=True)
        p.add_argument("--data", required=True)
        p.add_argument("--method", choices=METHODS, default="MinMax")
        p.add_argument("--out", required=True)
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--opset", type=int, default=None,
                       help="first convert the model with onnx.version_converter")
        p.add_argument("--prep", choices=PREPS, default="none",
                       help="before quantizing: none; constants = Constant nodes to initializers; "
                            "ort = onnxruntime's quant_pre_process (also does that)")
        p.add_argument("--entropy-bins", type=int, default=None,
                       help="Entropy only: calibrate with this many histogram bins (e.g. 2048) "
                            "instead of quantize_static's 128, which makes Entropy equal MinMax")
        if name == "quantize_static":
            p.add_argument("--timeout", type=float, default=None, help="kill the child after")
            p.add_argument("--max-memory-gb", type=float, default=None,
                           help="cap the child's address space (RLIMIT_AS)")
            p.add_argument("--eval", default=None, help=".npz to validate the quantized model on")
    args = ap.parse_args(argv)
    if args.cmd == "make-data":
        _make_data(args)
    elif args.cmd == "time":
        _time(args)
    elif args.cmd == "_worker":
        return _worker(args)
    else:
        return _quantize(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
