"""Does qtool give the same bytes on another CPU? Each command runs on this host and under
``qemu-x86_64 -cpu MODEL`` (user-mode emulation of another x86 CPU, default an AVX2-only AMD EPYC
Rome), and the two outputs are compared byte for byte.

    python bench/cpus.py                                  # the demo model, every row
    python bench/cpus.py --model M.onnx --data D.npz --samples 4 --rows tensors,calibrate
    python bench/cpus.py --cpu Haswell --work /tmp/cpus

A user quantizes on one machine and deploys on others, and CI runs on whatever CPU it gets:
onnxruntime's kernels pick their code by the CPU's instruction set, and some of them add in an
order that depends on it (its blocked NCHWc convolutions add in blocks of the vector width: 16
channels with AVX-512, 8 with AVX2). Whatever decides what a quantized model holds (calibration
ranges, per-channel ranges, the inputs weight rounding is fitted to, the judges' scores) must
come out the same on each, and so must the integer executor's outputs.

Rows (``--rows``):
- tensors       the float tensors read by every Conv, Gemm and MatMul, from onnxruntime with its
                layout optimizations (``FloatRunner(layouts=True)``) and without them (False,
                what qtool uses where a result goes into the model); counts of tensors that differ
- calibrate     qtool calibrate MODEL --data DATA -o table.yaml (the table's bytes)
- quantize      qtool quantize MODEL -t table.yaml -o q.onnx (from the native table)
- quantize-data the same with --data DATA (the judged steps: method, channels, rounding, bias)
- exec          qtool exec q.onnx --input DATA -o y.npz (the executor's outputs, from the native model)

Emulation is slow (20-50x): the demo model takes a minute or two for every row; a ResNet-50 on 4
samples takes about 30 s for ``tensors`` alone. Needs ``qemu-x86_64`` (Debian/Ubuntu:
qemu-user); without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS = ("tensors", "calibrate", "quantize", "quantize-data", "exec")
LAUNCH = "import sys; sys.argv = ['qtool'] + sys.argv[1:]; from qtool.cli import main; main()"


def tensors_child(model: str, data: str, samples: int, out: str) -> None:
    """(run under each CPU) The inputs of every Conv, Gemm and MatMul, with and without
    onnxruntime's layout optimizations, saved to ``out``."""
    from qtool.model import FloatRunner, prepare_file

    m = prepare_file(model)
    graph_inputs = {i.name for i in m.graph.input}
    names = sorted({n.input[0] for n in m.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")} - graph_inputs)
    arrays = np.load(data)
    feeds = {k: v[:samples] for k, v in arrays.items() if k in graph_inputs}  # not a labels array
    saved = {}
    for layouts in (True, False):
        got = FloatRunner(m, names, layouts=layouts).run(feeds, names)
        saved.update({f"{layouts}/{n}": got[n] for n in names})
    np.savez(out, **saved)


def run(argv: list[str], emulate: list[str] | None, log: Path) -> float:
    """``python argv`` natively or under the emulator; its output goes to ``log``; the seconds taken."""
    command = (emulate or []) + [sys.executable, *argv]
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
    if code not in (0, 1):  # 1: verify-style failures are not expected here, but not a crash
        sys.exit(f"failed ({code}): {' '.join(command)}; see {log}")
    return time.perf_counter() - start


def same_npz(a: Path, b: Path) -> tuple[int, int]:
    """(arrays that differ, arrays) between two .npz files."""
    x, y = np.load(a), np.load(b)
    keys = sorted(set(x) | set(y))
    return sum(1 for k in keys if k not in x or k not in y or not np.array_equal(x[k], y[k])), len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="float ONNX model (default: qtool's demo digits CNN)")
    parser.add_argument("--data", help=".npz keyed by input name (default: the demo's calibration file)")
    parser.add_argument("--samples", type=int, default=16, help="samples each command reads (default 16)")
    parser.add_argument("--cpu", default="EPYC-Rome", help="qemu's CPU model for the other CPU")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--work", help="keep the outputs here (default: a temporary folder)")
    parser.add_argument("--tensors-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tensors_child:
        model, data, samples, out = args.tensors_child
        tensors_child(model, data, int(samples), out)
        return
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        print("qemu-x86_64 not found (Debian/Ubuntu: apt install qemu-user)", file=sys.stderr)
        sys.exit(2)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    demo = Path(__file__).resolve().parent.parent / "qtool" / "demo"
    model = Path(args.model or demo / "digits_cnn.onnx").resolve()
    data_given = Path(args.data or demo / "digits_calib.npz").resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="qtool-cpus-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.npz"  # the first --samples samples, so that every command reads the same
    arrays = dict(np.load(data_given))
    np.savez(data, **{k: v[:args.samples] if v.ndim else v for k, v in arrays.items()})
    emulate = [qemu, "-cpu", args.cpu]
    sides = {"native": None, args.cpu: emulate}
    os.environ.setdefault("QEMU_LOG_FILENAME", os.devnull)
    print(f"model {model.name}, {args.samples} samples; this host vs qemu -cpu {args.cpu}; outputs in {work}")
    print(f"{'row':<14} {'result':<44} {'native s':>9} {'emulated s':>11}")
    qtool = ["-c", LAUNCH]
    for row in rows:
        out, seconds = {}, {}
        for side, emu in sides.items():
            folder = work / side.lower()
            folder.mkdir(exist_ok=True)
            log = folder / f"{row}.log"
            native_dir = work / "native"
            if row == "tensors":
                out[side] = folder / "tensors.npz"
                argv = [__file__, "--tensors-child", str(model), str(data), str(min(args.samples, 2)), str(out[side])]
            elif row == "calibrate":
                out[side] = folder / "table.yaml"
                argv = qtool + ["calibrate", str(model), "-d", str(data), "-o", str(out[side]), "-q"]
            elif row in ("quantize", "quantize-data"):
                out[side] = folder / f"{row}.onnx"
                table = native_dir / "table.yaml"
                if not table.is_file():
                    run(qtool + ["calibrate", str(model), "-d", str(data), "-o", str(table), "-q"], None,
                        native_dir / "table.log")
                argv = qtool + ["quantize", str(model), "-t", str(table), "-o", str(out[side]), "-q"]
                if row == "quantize-data":
                    argv += ["--data", str(data)]
            else:  # exec, on the native quantized model
                qmodel = native_dir / "quantize.onnx"
                if not qmodel.is_file():
                    sys.exit("exec compares the executor on the native quantize row's model: run that row too")
                out[side] = folder / "exec.npz"
                argv = qtool + ["exec", str(qmodel), "--input", str(data), "-o", str(out[side]), "-q"]
            seconds[side] = run(argv, emu, log)
        a, b = out.values()
        if row == "tensors":
            x, y = np.load(a), np.load(b)
            parts = []
            for layouts in ("True", "False"):
                keys = [k for k in x if k.startswith(layouts + "/")]
                differ = sum(1 for k in keys if not np.array_equal(x[k], y[k]))
                parts.append(f"layouts {'on' if layouts == 'True' else 'off'}: {differ} of {len(keys)} differ")
            result = "; ".join(parts)
        elif row == "exec":
            differ, total = same_npz(a, b)
            result = "same outputs" if not differ else f"{differ} of {total} outputs differ"
        else:
            result = "same bytes" if a.read_bytes() == b.read_bytes() else "DIFFERENT bytes"
        native_s, emulated_s = seconds.values()
        print(f"{row:<14} {result:<44} {native_s:>9.1f} {emulated_s:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
