"""The speed-up of ``--cluster local:2`` over ``local:1`` (and over no cluster) on calibrate and verify.

    python bench/cluster.py                       # the demo CNN, 512 samples
    python bench/cluster.py --model cls           # PP-OCR's direction classifier (rapidocr wheel)
    python bench/cluster.py --samples 2048 --repeat 3

Each figure is the wall time of a whole ``qtool`` process (python start, cluster start, model and
data reading, the work, writing), the fastest of ``--repeat`` runs: what a user waits for. The
ratios: local:1 / local:2 (two workers against one) and none / local:2 (against no cluster). The
outputs of every run are compared byte for byte with the run without a cluster.

Needs: pip install -e '.[dask]'; --model cls also '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
DEMO = ROOT / "qtool" / "demo"
CLUSTERS = (None, "local:1", "local:2")


def _data(model: str, samples: int, folder: Path) -> tuple[Path, Path]:
    """(float model, .npz of ``samples`` samples keyed by its input)."""
    path = folder / "data.npz"
    if model == "digits":
        images = np.load(DEMO / "digits_heldout.npz")["input"]
        np.savez(path, input=np.resize(images, (samples, *images.shape[1:])))  # repeats past 540
        return DEMO / "digits_cnn.onnx", path
    import datasets
    import onnx

    onnx_path = Path(datasets.model_path(model))
    # the "plain" lines: the varied style needs scikit-image
    x = (datasets.cls_lines(samples, 0, style="plain") if model == "cls"
         else datasets.text_lines(samples, 0, style="plain"))[0]
    name = onnx.load(str(onnx_path), load_external_data=False).graph.input[0].name
    np.savez(path, **{name: x})
    return onnx_path, path


def _qtool(*args) -> tuple[float, str]:
    """(wall seconds, standard output) of ``qtool ARGS``."""
    start = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "qtool"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"qtool {' '.join(map(str, args))} failed:\n{done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("digits", "cls", "rec"), default="digits")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, data = _data(args.model, args.samples, folder)
        table, qmodel = folder / "table.yaml", folder / "q.onnx"
        _qtool("calibrate", model, "-d", data, "-o", table, "-q")
        _qtool("quantize", model, "-t", table, "-o", qmodel)
        commands = {  # what is compared: calibrate's table (to stdout), verify's JSON report
            "calibrate": ("calibrate", model, "-d", data, "-o", "-", "-q"),
            "verify": ("verify", model, qmodel, "-d", data, "--json", "-q"),
        }
        print(f"{args.model}: {args.samples} samples, {os.cpu_count()} cores, "
              f"best of {args.repeat}; whole-process seconds")
        print(f"{'command':<10} {'no cluster':>10} {'local:1':>8} {'local:2':>8} "
              f"{'1 / 2 workers':>14} {'none / 2':>9}")
        for name, command in commands.items():
            times, outputs = {}, {}
            for where in CLUSTERS:
                runs = [_qtool(*command, *(("--cluster", where) if where else ()))
                        for _ in range(args.repeat)]
                times[where] = min(seconds for seconds, _ in runs)
                outputs[where] = runs[0][1]
            same = all(o == outputs[None] for o in outputs.values())
            print(f"{name:<10} {times[None]:>10.2f} {times['local:1']:>8.2f} {times['local:2']:>8.2f} "
                  f"{times['local:1'] / times['local:2']:>13.2f}x {times[None] / times['local:2']:>8.2f}x"
                  f"{'' if same else '  OUTPUTS DIFFER'}")


if __name__ == "__main__":
    main()
