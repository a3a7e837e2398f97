"""What each judged step of `quantize --data` gains on the zoo, all-int8, beside onnxruntime.

    python bench/zoo.py --work /tmp/zoo --only layout,yolov8n    # first: models, splits, tables
    python bench/steps.py --work /tmp/zoo --only layout,yolov8n [--json steps.json]
    python bench/steps.py --work /tmp/zoo --only layout --no-ort --quantize-args=--no-channel-scales

For each model, on the split bench/zoo.py wrote under WORK/runs/KEY/ (16 calibration samples,
seed 1, and 16 evaluation samples, seed 2; the table is `qtool calibrate`'s minmax on the
calibration samples), each command a process of its own as a user types it:

    qtool quantize MODEL -t table.yaml -o data.q.onnx --data calib.npz --json
    qtool verify MODEL data.q.onnx --data eval.npz --json --tolerance 0

The quantize report gives each step's held-out figures (the half of calib.npz each step is judged
on: method choice, per-channel scales, weight rounding, bias correction) and its seconds; verify
gives the worst output's SQNR on eval.npz, which no step saw (an output that concatenates parts,
a detector's boxes and class scores, counts part by part). Beside it, onnxruntime's
`quantize_static` (MinMax, QDQ, per-channel weights; bench/ort_baseline.py) on calib.npz, its
model run by onnxruntime on eval.npz (worst output SQNR against the float model). Wall time and
peak RSS are the quantize process's own (os.wait4).
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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import zoo  # noqa: E402

STEPS = (("method_pick", "method", "heldout_table_sqnr_db", "heldout_chosen_sqnr_db"),
         ("channel_scales_step", "scales", "heldout_per_tensor_sqnr_db", "heldout_per_channel_sqnr_db"),
         ("weight_rounding", "rounding", "heldout_nearest_sqnr_db", "heldout_fitted_sqnr_db"),
         ("bias_correction", "bias", "heldout_plain_sqnr_db", "heldout_best_sqnr_db"))


def timed(argv: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run ``argv`` (in ``env`` and ``cwd`` where given); its exit code, stdout, last stderr line,
    wall seconds and peak RSS (MB)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = stderr.strip().splitlines()
    return {"code": os.waitstatus_to_exitcode(status), "stdout": stdout, "last": lines[-1] if lines else "",
            "seconds": round(wall, 1), "peak_mb": round(usage.ru_maxrss / 1024)}


def worst_sqnr(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    worst = np.inf
    for r, g in zip(reference, got):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        noise = float(np.sum((r - g) ** 2))
        worst = min(worst, np.inf if noise == 0 else 10 * np.log10(float(np.sum(r * r)) / noise))
    return float(worst)


def ort_static(model: Path, folder: Path) -> dict:
    """onnxruntime quantize_static (MinMax) on calib.npz, run by onnxruntime on eval.npz."""
    import onnxruntime as ort
    from ort_baseline import run_quantize_static

    out = folder / "ort_static.onnx"
    calib = np.load(folder / "calib.npz")
    if len(calib.files) != 1:
        return {"error": "more than one input: bench/ort_baseline.py's reader takes one"}
    result = run_quantize_static(str(model), str(folder / "calib.npz"), "MinMax", str(out), batch_size=1)
    if result["returncode"] != 0:
        return {"error": str(result.get("error", ""))[:200]}
    evaluation = dict(np.load(folder / "eval.npz"))
    try:
        float_outputs, quant_outputs = ([], [])
        for path, bucket in ((model, float_outputs), (out, quant_outputs)):
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            name = session.get_inputs()[0].name
            x = evaluation[next(iter(evaluation))]
            runs = [session.run(None, {name: x[i:i + 1]}) for i in range(x.shape[0])]
            bucket.extend(np.concatenate([r[k] for r in runs]) for k in range(len(runs[0])))
    except Exception as e:  # onnxruntime cannot run its own output: recorded as its failure
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {"sqnr_db": round(worst_sqnr(float_outputs, quant_outputs), 2), "seconds": result["wall_seconds"]}


def bench(entry, work: Path, qtool: str, with_ort: bool, extra: list[str] = ()) -> dict:
    folder = work / "runs" / entry.key
    model = zoo.fetch(entry, work)
    table = folder / "table.yaml"
    row = {"key": entry.key, "family": entry.family}
    if not table.exists():
        return {**row, "error": f"no {table}: run bench/zoo.py --only {entry.key} first"}
    qmodel = folder / "data.q.onnx"
    quantize = timed([qtool, "quantize", str(model), "-t", str(table), "-o", str(qmodel), "--data",
                      str(folder / "calib.npz"), "--json", *entry.quantize, *extra])
    if quantize["code"] != 0:
        return {**row, "error": f"quantize exit {quantize['code']}: {quantize['last']}"}
    report = json.loads(quantize["stdout"])
    row.update(seconds=quantize["seconds"], peak_mb=quantize["peak_mb"], steps={})
    for key, short, before, after in STEPS:
        step = report.get(key)
        if step is None:
            continue
        if key == "bias_correction":  # held-out SQNR per factor: none, 0.5, 1.0
            scores = step.get("heldout_sqnr_db", {})
            applied = "none" if not step.get("applied") else str(step["applied"])
            step = {**step, "heldout_plain_sqnr_db": scores.get("none"), "heldout_best_sqnr_db": scores.get(applied),
                    "kept": bool(step.get("applied"))}
        kept = step.get("kept", step.get("changed"))
        row["steps"][short] = {"before": step.get(before), "after": step.get(after), "kept": bool(kept),
                               "seconds": step.get("seconds"), "reason": step.get("reason", "")}
    row["float_nodes"] = len([k for k in report.get("kept_float", [])])
    verify = timed([qtool, "verify", str(model), str(qmodel), "--data", str(folder / "eval.npz"), "--json", "-q",
                    "--tolerance", "0"])
    if verify["code"] not in (0, 1):
        return {**row, "error": f"verify exit {verify['code']}: {verify['last']}"}
    outputs = json.loads(verify["stdout"])["outputs"]
    # an output that concatenates parts (a detector's boxes and class scores) counts part by part
    scored = [part for o in outputs for part in (o.get("parts") or {}).get("parts", [o])]
    row["worst_output_db"] = round(min(o["sqnr_db"] for o in scored), 2)
    row["outputs_db"] = [round(o["sqnr_db"], 2) for o in scored]
    if with_ort:
        row["ort_static"] = ort_static(model, folder)
    return row


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['key']:<12} {r['error']}")
            continue
        steps = "; ".join(f"{name} {s['before']} -> {s['after']}{'' if s['kept'] else ' (not kept)'} "
                          f"{s['seconds']} s" for name, s in r["steps"].items())
        ort_row = r.get("ort_static", {})
        ort_text = ort_row.get("error") or (f"{ort_row['sqnr_db']} dB" if ort_row else "-")
        print(f"{r['key']:<12} worst {r['worst_output_db']:>6} dB (outputs {r['outputs_db']}); quantize "
              f"{r['seconds']} s, {r['peak_mb']} MB; float ops {r['float_nodes']}; ort static {ort_text}\n"
              f"{'':<12} {steps}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="bench/zoo.py's work folder")
    parser.add_argument("--only", help="comma-separated keys: " + ",".join(e.key for e in zoo.ZOO))
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime's quantize_static")
    parser.add_argument("--quantize-args", default="", help="more quantize options, e.g. "
                        "'--no-channel-scales' (the figures without that step)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    keys = args.only.split(",") if args.only else [e.key for e in zoo.ZOO]
    entries = {e.key: e for e in zoo.ZOO}
    unknown = [k for k in keys if k not in entries]
    if unknown:
        parser.error(f"unknown key {unknown[0]!r}")
    qtool = zoo.qtool_exe()
    rows = []
    for key in keys:
        print(f"[{key}]", file=sys.stderr, flush=True)
        rows.append(bench(entries[key], args.work.resolve(), qtool, not args.no_ort, args.quantize_args.split()))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
