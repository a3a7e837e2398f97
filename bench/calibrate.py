"""Calibration speed and memory against onnxruntime, measured in one run.

    python bench/calibrate.py                       # rec (64 lines) and det (16 crops), all methods
    python bench/calibrate.py --models rec --methods minmax,kl --no-ort-quantize

For each PP-OCR model (from the rapidocr-onnxruntime wheel) and each qtool method, a child process
runs ``qtool.calibrate.collect`` and reports the seconds it took (model preparation, session
creation and the pass over the data included) and its peak RSS; the best of ``--repeats`` runs is
kept, as for onnxruntime, because timings on a shared 2-core machine vary by up to 2x. The ratio divides those seconds by
plain onnxruntime float inference over the same samples and batch size (default optimizations,
best of 3 after a warm-up), measured in this same run. onnxruntime's own ``quantize_static``
(MinMax and Entropy) runs beside, also in a child process, for its wall time and peak RSS, with
the settings it needs to write a valid model here: the model upgraded to opset 13 and passed
through ``quant_pre_process`` (see bench/ort_baseline.py).

Needs: pip install -e '.[bench]' (Pillow, scikit-image) and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import datasets  # noqa: E402
import ort_baseline  # noqa: E402

METHODS = ("minmax", "kl", "percentile", "mse", "aciq_gauss", "aciq_laplace")
WORKLOADS = {  # model, samples, batch size
    "rec": ("rec", 64, 4),
    "det": ("det", 16, 1),
}

_CHILD = """
import json, resource, sys, time
from qtool.calibrate import collect
t = time.perf_counter()
stats = collect(sys.argv[1], sys.argv[2], sys.argv[3], batch_size=int(sys.argv[4]), progress=False)
table = stats.table()
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "tensors": len(table.tensors)}))
"""


def _child_peak_rss_mb(usage) -> float:
    return usage.ru_maxrss / 1024  # Linux reports KiB


def run_qtool(model: str, data: str, method: str, batch_size: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, model, data, method, str(batch_size)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        return {"error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = _child_peak_rss_mb(usage)
    return result


def make_data(kind: str, n: int, folder: str) -> tuple[str, np.ndarray]:
    if kind == "rec":
        x, _ = datasets.text_lines(n, seed=0)
    else:
        x = datasets.det_crops(n, seed=0)
    path = os.path.join(folder, f"{kind}.npz")
    np.savez(path, x=x)
    return path, x


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="rec,det")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ort-methods", default="MinMax,Entropy")
    parser.add_argument("--no-ort-quantize", action="store_true", help="skip quantize_static")
    parser.add_argument("--repeats", type=int, default=3, help="qtool runs per method (best time kept)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-") as tmp:
        for key in args.models.split(","):
            kind, n, batch = WORKLOADS[key]
            model = datasets.model_path(kind)
            data, x = make_data(kind, n, tmp)
            base = ort_baseline.time_ort_inference(model, x, batch)
            rows.append((key, "onnxruntime inference", base, 1.0, None, ""))
            for method in args.methods.split(","):
                runs = [run_qtool(model, data, method, batch) for _ in range(args.repeats)]
                r = next((x for x in runs if "error" in x), None) or min(runs, key=lambda x: x["seconds"])
                if "error" not in r:
                    r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
                if "error" in r:
                    rows.append((key, f"qtool {method}", None, None, None, r["error"]))
                else:
                    rows.append((key, f"qtool {method}", r["seconds"], r["seconds"] / base,
                                 r["peak_rss_mb"], f"{r['tensors']} tensors"))
            if not args.no_ort_quantize:
                for method in args.ort_methods.split(","):
                    # opset 13 and quant_pre_process: without them quantize_static writes an
                    # invalid (opset 12) or silently poor (weights as Constant nodes) model
                    r = ort_baseline.run_quantize_static(model, data, method,
                                                         os.path.join(tmp, f"{key}.{method}.onnx"), batch,
                                                         opset=13, prep="ort")
                    seconds = r.get("quantize_seconds") or r.get("wall_seconds")
                    note = (r.get("error") or "").strip().splitlines()[-1][:70] if r.get("error") else ""
                    rows.append((key, f"ORT quantize_static {method}", seconds,
                                 seconds / base if seconds else None, r.get("peak_rss_mb"), note))
    print(f"{'model':<5} {'what':<34} {'seconds':>8} {'x ORT inf.':>10} {'peak RSS MB':>12}  note")
    for key, what, seconds, ratio, rss, note in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{key:<5} {what:<34} {fmt(seconds, '8.2f'):>8} {fmt(ratio, '10.2f'):>10} "
              f"{fmt(rss, '12.0f'):>12}  {note}")


if __name__ == "__main__":
    main()
