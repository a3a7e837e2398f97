"""Calibration speed and memory against onnxruntime, measured in one run.

    python bench/calibrate.py                       # rec (64 lines) and det (16 crops), all methods
    python bench/calibrate.py --models rec --methods minmax,kl --no-ort-quantize

For each PP-OCR model (from the rapidocr-onnxruntime wheel) and each qtool method, a child process
runs ``qtool.calibrate.collect`` and reports the seconds it took (model preparation, session
creation and the pass over the data included) and its peak RSS. The same child first times plain
onnxruntime float inference over the same samples and batch size (default optimizations, best of
2 after a warm-up), so each ratio compares runs made under the same load: on a shared 2-core
machine absolute timings drift by up to 2x within minutes. The median ratio of ``--repeats`` runs
is printed. The note splits each run into its fixed cost (model preparation, session creation, the final
threshold search) and the pass over the data, whose ratio to inference holds as samples grow.
onnxruntime's own ``quantize_static``
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
import json, sys, time
import numpy as np
import onnxruntime as ort
from qtool import calibrate
model, data, method, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
x = np.load(data)["x"]
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
session.run(None, {"x": x[:batch]})
inference = []
for _ in range(2):
    t = time.perf_counter()
    for i in range(0, len(x), batch):
        session.run(None, {"x": x[i:i + batch]})
    inference.append(time.perf_counter() - t)
del session
# the pass over the data: from the first batch handed to onnxruntime to the last statistics folded
marks = []
call, close = calibrate._Updates.__call__, calibrate._Updates.close
def timed_call(self, feeds):
    if not marks:
        marks.append(time.perf_counter())
    return call(self, feeds)
def timed_close(self, check=True):
    close(self, check)
    marks.append(time.perf_counter())
calibrate._Updates.__call__, calibrate._Updates.close = timed_call, timed_close
t = time.perf_counter()
table = calibrate.collect(model, data, method, batch_size=batch, progress=False).table()
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "stream": marks[-1] - marks[0], "inference": min(inference),
                  "tensors": len(table.tensors)}))
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
    parser.add_argument("--samples", type=int, help="samples per model (default: rec 64, det 16)")
    parser.add_argument("--repeats", type=int, default=3, help="qtool runs per method (best time kept)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-") as tmp:
        for key in args.models.split(","):
            kind, n, batch = WORKLOADS[key]
            n = args.samples or n
            model = datasets.model_path(kind)
            data, x = make_data(kind, n, tmp)
            inference_times = [ort_baseline.time_ort_inference(model, x, batch)]
            rows.append((key, "onnxruntime inference", inference_times[0], 1.0, None, "at the start"))
            for method in args.methods.split(","):
                runs = [run_qtool(model, data, method, batch) for _ in range(args.repeats)]
                failed = next((x for x in runs if "error" in x), None)
                if failed:
                    rows.append((key, f"qtool {method}", None, None, None, failed["error"]))
                    continue
                # each run's ratio is against inference timed in the same child just before it
                inference_times += [x["inference"] for x in runs]
                runs.sort(key=lambda x: x["seconds"] / x["inference"])
                r = runs[len(runs) // 2]
                rows.append((key, f"qtool {method}", r["seconds"], r["seconds"] / r["inference"],
                             max(x["peak_rss_mb"] for x in runs),
                             f"{r['tensors']} tensors; inference {r['inference']:.2f} s in that run; "
                             f"fixed {r['seconds'] - r['stream']:.2f} s, pass over the data "
                             f"{r['stream'] / r['inference']:.2f}x"))
            base = float(np.median(inference_times))  # every inference timing of this model
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
                                 seconds / base if seconds else None, r.get("peak_rss_mb"),
                                 note or f"ratio to the median inference, {base:.2f} s"))
    print(f"{'model':<5} {'what':<34} {'seconds':>8} {'x ORT inf.':>10} {'peak RSS MB':>12}  note")
    for key, what, seconds, ratio, rss, note in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{key:<5} {what:<34} {fmt(seconds, '8.2f'):>8} {fmt(ratio, '10.2f'):>10} "
              f"{fmt(rss, '12.0f'):>12}  {note}")


if __name__ == "__main__":
    main()
