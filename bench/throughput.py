"""qtool commands as whole processes against onnxruntime float inference, measured in one run.

    python bench/throughput.py                             # rec and det, 64 and 512 samples, every command
    python bench/throughput.py --models rec --samples 64 --commands exec,verify
    python bench/throughput.py --work /tmp/qtool-throughput --repeats 3 --json out.json

What a user waits for and how much memory the machine needs: each qtool command runs as its own
process, exactly as typed in a shell (the ``qtool`` console script beside this Python), and is
timed from its start to its exit (interpreter start-up, imports, model loading and preparation,
the pass over the data and writing the output all included), with its peak RSS (``ru_maxrss``
from ``os.wait4``). The yardstick is the least a user would do to run the float model over the
same file: a child process of this script (``--ort-child``) that imports onnxruntime and numpy,
loads the whole .npz, creates a default CPU InferenceSession and runs it batch by batch (8 lines
for rec, 1 image for det), discarding the outputs. It runs right before each group of commands on
one model and sample count and once more after it, and each ratio divides by the mean of the two,
so ratios compare runs made under the same load (on a shared 2-core machine absolute timings drift
by up to 2x within minutes); with ``--repeats R`` the group runs R times between R+1 baselines
and the median is kept.

Commands (``--commands``), qtool's defaults otherwise:
- calibrate-minmax  qtool calibrate MODEL --data data.npz -o t.yaml -q
- calibrate-kl      the same with --method kl
- exec              qtool exec q.onnx --input data.npz -o y.npz -q
- exec-int16        the same on q16.onnx (quantize --activation-type int16: every op int16)
- verify            qtool verify MODEL q.onnx --data data.npz -q --tolerance 0   (exit 1 accepted)
- quantize-data     qtool quantize MODEL -t table.yaml -o q.onnx --data calib.npz
                    (bias correction; once per model, on the 64-sample calibration file, which
                    also has its own baseline pair)
- quantize-search   the same with --target-sqnr 25 (int16 activations for the fewest ops that
                    reach 25 dB; on the calibration file like quantize-data)
q.onnx, q16.onnx and table.yaml are made once per model, untimed, from the calibration file (64 samples,
seed 12; the timed data uses seed 11, the first k samples shared by every sample count).

Data: PP-OCRv4 rec lines (3x48x320) and det crops (3xSxS, ``--det-size``, default 320) from
bench/datasets.py, one uncompressed .npz per model and sample count. det runs at 320 by default
because at 640 the 512-sample group takes too long on a 2-core machine; pass --det-size 640 for
rapidocr's own size. With ``--work DIR`` the data files are kept there and reused by later runs;
by default everything goes to a temporary folder that is removed at the end.

Needs: pip install -e '.[bench]' and rapidocr-onnxruntime --no-deps.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
# `import datasets` (Pillow, scikit-image) happens only in child processes (make_data, model_path):
# the --ort-child baseline runs this file too and must import no more than onnxruntime and numpy,
# and the parent stays small (its resident set is every child's floor of peak RSS).

MODELS = ("rec", "det")
COMMANDS = ("calibrate-minmax", "calibrate-kl", "exec", "exec-int16", "verify", "quantize-data", "quantize-search")
ON_CALIBRATION = ("quantize-data", "quantize-search")  # run once per model, on the calibration file
SEARCH_TARGET_DB = 25.0
ORT_BATCH = {"rec": 8, "det": 1}  # samples per onnxruntime run in the baseline
INPUT = "x"  # the input name of both PP-OCRv4 models, and the array name in every .npz
DATA_SEED, CALIB_SEED, CALIB_SAMPLES = 11, 12, 64
STDERR_TAIL = 20  # lines of a failed child's stderr shown


@dataclass
class Run:
    argv: list[str]
    seconds: float
    rss_mb: float
    returncode: int
    stdout: str


@dataclass
class Row:
    model: str
    samples: int
    data: str  # "data" (seed 11) or "calib" (the 64-sample calibration file)
    command: str  # a COMMANDS entry or "ort-float"
    seconds: float
    ratio: float
    rss_mb: float
    note: str = ""
    runs: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- the onnxruntime baseline child

def ort_child(model: str, data: str, batch: int) -> None:
    """Float inference over DATA in batches of BATCH; prints its inner timings as one JSON line."""
    import onnxruntime as ort

    start = time.perf_counter()
    x = np.load(data)[INPUT]
    loaded = time.perf_counter()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    created = time.perf_counter()
    for i in range(0, len(x), batch):
        session.run(None, {name: x[i:i + batch]})
    done = time.perf_counter()
    print(json.dumps({"samples": len(x), "batch": batch, "load_s": loaded - start,
                      "session_s": created - loaded, "inference_s": done - created}))


# ---------------------------------------------------------------- processes

def qtool_exe() -> str:
    """The qtool console script installed beside this interpreter (not resolved: a venv's bin)."""
    exe = Path(sys.executable).parent / "qtool"
    if not exe.exists():
        sys.exit(f"no qtool script beside {sys.executable}: pip install -e '.[bench]' in that environment")
    return str(exe)


def run_process(argv: list[str], logs: Path, ok: tuple[int, ...] = (0,)) -> Run:
    """Run argv to completion: wall seconds (perf_counter around it) and peak RSS (os.wait4).

    stdout and stderr go to files in LOGS, not pipes: a chatty child can never block on a full
    pipe while we wait for it. An exit code outside OK prints the command and its stderr tail
    and ends this script.
    """
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / "stdout.txt", logs / "stderr.txt"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = code = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen quiet
    if code not in ok:
        tail = err_path.read_text(errors="replace").rstrip().splitlines()[-STDERR_TAIL:]
        print(f"\nFAILED (exit {code}): {shlex.join(argv)}\n" + "\n".join(tail), file=sys.stderr)
        sys.exit(1)
    return Run(argv, seconds, usage.ru_maxrss / 1024, code, out_path.read_text(errors="replace"))


def run_baseline(model: str, data: Path, batch: int, logs: Path) -> tuple[Run, dict]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--ort-child", model, str(data), str(batch)]
    run = run_process(argv, logs)
    return run, json.loads(run.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- data and preparation

def _samples(kind: str, n: int, seed: int, det_size: int) -> np.ndarray:
    import datasets

    if kind == "rec":
        return datasets.text_lines(n, seed=seed)[0]
    return datasets.det_crops(n, seed=seed, size=det_size)


def _data_path(work: Path, kind: str, n: int, seed: int, det_size: int) -> Path:
    stem = kind if kind == "rec" else f"{kind}{det_size}"
    return work / "data" / f"{stem}_n{n}_s{seed}.npz"


def write_data(kind: str, seed: int, det_size: int, paths: list[str]) -> None:
    """(``--make-data``, in a child process) Generate max(n) samples once and write the first n of
    them to each ``PATH`` named ..._n{n}_...: a builder's first k samples do not depend on n."""
    counts = [int(Path(p).stem.split("_n")[1].split("_")[0]) for p in paths]
    x = _samples(kind, max(counts), seed, det_size)
    for n, path in zip(counts, paths):
        np.savez(path, **{INPUT: x[:n]})


def make_data(work: Path, kind: str, samples: list[int], det_size: int) -> tuple[dict[int, Path], Path]:
    """The timed data files (one per sample count) and the calibration file, reusing those in WORK.

    They are generated in a child process: Linux counts the parent's resident set at fork as the
    floor of every child's peak RSS (ru_maxrss survives fork and exec), so the parent must never
    hold the arrays.
    """
    paths = {n: _data_path(work, kind, n, DATA_SEED, det_size) for n in samples}
    calib = _data_path(work, kind, CALIB_SAMPLES, CALIB_SEED, det_size)
    calib.parent.mkdir(parents=True, exist_ok=True)
    missing = [n for n, p in paths.items() if not p.exists()]
    jobs = [(DATA_SEED, [paths[n] for n in missing])] if missing else []
    if not calib.exists():
        jobs.append((CALIB_SEED, [calib]))
    for seed, targets in jobs:
        print(f"[{kind}] generating {', '.join(p.name for p in targets)}", file=sys.stderr)
        subprocess.run([sys.executable, __file__, "--make-data", kind, str(seed), str(det_size),
                        *map(str, targets)], check=True)
    return paths, calib


def prepare(qtool: str, model: str, calib: Path, folder: Path) -> tuple[Path, Path, list[str]]:
    """Untimed: the minmax table and the quantized models (int8, and int16 beside it as q16.onnx)
    every timed command reads."""
    table, qmodel = folder / "table.yaml", folder / "q.onnx"
    argvs = [[qtool, "calibrate", model, "--data", str(calib), "-o", str(table), "-q"],
             [qtool, "quantize", model, "-t", str(table), "-o", str(qmodel)],
             [qtool, "quantize", model, "-t", str(table), "-o", str(qmodel.with_name("q16.onnx")),
              "--activation-type", "int16"]]
    for i, argv in enumerate(argvs):
        run_process(argv, folder / "logs" / f"prepare{i}")
    return table, qmodel, [shlex.join(a) for a in argvs]


def command_argv(command: str, qtool: str, model: str, qmodel: Path, table: Path, data: Path,
                 out: Path) -> tuple[list[str], Path]:
    """The qtool command line for COMMAND, and the output file it writes."""
    if command in ("calibrate-minmax", "calibrate-kl"):
        path = out / f"{command}.yaml"
        argv = [qtool, "calibrate", model, "--data", str(data), "-o", str(path), "-q"]
        return argv + (["--method", "kl"] if command == "calibrate-kl" else []), path
    if command in ("exec", "exec-int16"):
        path = out / f"{command}.npz"
        source = qmodel if command == "exec" else qmodel.with_name("q16.onnx")
        return [qtool, "exec", str(source), "--input", str(data), "-o", str(path), "-q"], path
    if command == "verify":
        return [qtool, "verify", model, str(qmodel), "--data", str(data), "-q", "--tolerance", "0"], out / "-"
    if command in ON_CALIBRATION:
        path = out / f"{command}.onnx"
        argv = [qtool, "quantize", model, "-t", str(table), "-o", str(path), "--data", str(data)]
        return argv + (["--target-sqnr", f"{SEARCH_TARGET_DB:g}"] if command == "quantize-search" else []), path
    raise ValueError(f"unknown command {command!r}")


# ---------------------------------------------------------------- one group: baselines around commands

def bench_group(kind: str, model: str, n: int, data_label: str, data: Path, commands: list[str],
                repeats: int, qtool: str, qmodel: Path, table: Path, folder: Path,
                log: list[str]) -> list[Row]:
    """Baseline, then COMMANDS, then baseline, REPEATS times (each baseline ends one round and
    starts the next). Each command's ratio is to the mean of the baselines around its round."""
    batch = ORT_BATCH[kind]
    tag = f"[{kind} n={n} {data_label}]"

    def baseline(i: int) -> tuple[Run, dict]:
        run, inner = run_baseline(model, data, batch, folder / "logs" / f"ort{i}")
        print(f"{tag} onnxruntime float, batch {batch}: {run.seconds:.2f} s, {run.rss_mb:.0f} MB", file=sys.stderr)
        return run, inner

    base = [baseline(0)]
    done: dict[str, list[Run]] = {c: [] for c in commands}
    for r in range(repeats):
        for command in commands:
            argv, output = command_argv(command, qtool, model, qmodel, table, data, folder / "out")
            output.parent.mkdir(parents=True, exist_ok=True)
            run = run_process(argv, folder / "logs" / f"{command}{r}", ok=(0, 1) if command == "verify" else (0,))
            output.unlink(missing_ok=True)  # exec outputs run to hundreds of MB
            done[command].append(run)
            if r == 0:
                log.append(f"{tag} {shlex.join(argv)}")
            print(f"{tag} {command}: {run.seconds:.2f} s, {run.rss_mb:.0f} MB", file=sys.stderr)
        base.append(baseline(r + 1))

    base_seconds = [run.seconds for run, _ in base]
    inner = statistics.median(i["inference_s"] for _, i in base)
    setup = statistics.median(i["load_s"] + i["session_s"] for _, i in base)
    rows = [Row(kind, n, data_label, "ort-float", statistics.mean(base_seconds), 1.0,
                max(run.rss_mb for run, _ in base),
                f"batch {batch}; runs " + " ".join(f"{s:.2f}" for s in base_seconds)
                + f" s; inside: load+session {setup:.2f} s, inference {inner:.2f} s", base_seconds)]
    for command, runs in done.items():
        seconds = [run.seconds for run in runs]
        ratios = [s / statistics.mean(base_seconds[r:r + 2]) for r, s in enumerate(seconds)]
        over = statistics.median(s - statistics.mean(base_seconds[r:r + 2]) for r, s in enumerate(seconds))
        notes = [f"{over:+.2f} s against onnxruntime"]
        if len(runs) > 1:
            notes.append(f"runs {min(seconds):.2f}-{max(seconds):.2f} s")
        failed = sum(run.returncode == 1 for run in runs)
        if failed:
            notes.append(f"exit 1 (tolerance missed) in {failed}/{len(runs)}")
        if command in ON_CALIBRATION:
            notes.append("bias correction on the calibration file")
        rows.append(Row(kind, n, data_label, command, statistics.median(seconds), statistics.median(ratios),
                        max(run.rss_mb for run in runs), "; ".join(notes), seconds))
    return rows


# ---------------------------------------------------------------- report

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_state() -> str:
    try:
        out = subprocess.run(["git", "-C", str(BENCH.parent), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine_info() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "cpus_usable": usable,
            "python": platform.python_version(),
            "onnxruntime": importlib.metadata.version("onnxruntime"), "numpy": np.__version__,
            "qtool": f"{importlib.metadata.version('qtool')} (git {_git_state()})"}


def print_report(info: dict, settings: dict, rows: list[Row], commands: list[str]) -> None:
    print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs ({info['cpus_usable']} usable); "
          f"python {info['python']}, onnxruntime {info['onnxruntime']}, numpy {info['numpy']}, "
          f"qtool {info['qtool']}")
    print(f"settings: det size {settings['det_size']}, repeats {settings['repeats']}, "
          f"onnxruntime batch {ORT_BATCH}, work {settings['work']}")
    print()
    print(f"{'model':<5} {'samples':>7} {'data':<5} {'command':<16} {'seconds':>8} {'x ORT':>7} "
          f"{'peak RSS MB':>11}  note")
    for r in rows:
        print(f"{r.model:<5} {r.samples:>7} {r.data:<5} {r.command:<16} {r.seconds:8.2f} {r.ratio:7.2f} "
              f"{r.rss_mb:11.0f}  {r.note}")
    print("\nx ORT: seconds over the mean of the onnxruntime float runs (ort-float) just before and "
          "after, same model and data file.")
    print("\ncommands:")
    for line in commands:
        print(f"  {line}")


# ---------------------------------------------------------------- main

def _list(value: str, allowed: tuple[str, ...], what: str, parser: argparse.ArgumentParser) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        parser.error(f"{what}: unknown {unknown or value!r}; choose from {','.join(allowed)}")
    return items


def model_path(kind: str) -> str:
    """bench/datasets.py's model_path, asked of a child process (see make_data)."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import datasets; print(datasets.model_path({kind!r}))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def compile_sources() -> None:
    """Byte-compile qtool's sources as ``pip install`` does for an installed package: an editable
    install under PYTHONDONTWRITEBYTECODE would otherwise compile them again in every process
    (about 0.15 s each), which no user's installed qtool pays."""
    import compileall
    import qtool

    compileall.compile_dir(str(Path(qtool.__file__).parent), quiet=1)


def run_bench(args, models: list[str], samples: list[int], commands: list[str], work: Path) -> None:
    qtool = qtool_exe()
    compile_sources()
    rows: list[Row] = []
    log: list[str] = []
    for kind in models:
        model = model_path(kind)
        per_n = [c for c in commands if c not in ON_CALIBRATION]
        paths, calib = make_data(work, kind, samples if per_n else [], args.det_size)
        folder = work / "runs" / kind
        table, qmodel, prep = prepare(qtool, model, calib, folder / "prepare")
        log += [f"[{kind} prepare] {line}" for line in prep]
        once = [c for c in commands if c in ON_CALIBRATION]
        if once:
            rows += bench_group(kind, model, CALIB_SAMPLES, "calib", calib, once, args.repeats,
                                qtool, qmodel, table, folder / "calib", log)
        if per_n:
            for n in samples:
                rows += bench_group(kind, model, n, "data", paths[n], per_n, args.repeats,
                                    qtool, qmodel, table, folder / f"n{n}", log)
    info = machine_info()
    settings = {"models": models, "samples": samples, "commands": commands, "det_size": args.det_size,
                "repeats": args.repeats, "work": str(work), "ort_batch": ORT_BATCH}
    print_report(info, settings, rows, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "settings": settings, "commands": log,
                       "rows": [vars(r) for r in rows]}, f, indent=1)
        print(f"\nwrote {args.json}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="rec, det or both (default both)")
    parser.add_argument("--samples", default="64,512", help="sample counts, comma-separated")
    parser.add_argument("--det-size", type=int, default=320, help="det input side, a multiple of 32")
    parser.add_argument("--commands", default=",".join(COMMANDS), help=f"subset of {','.join(COMMANDS)}")
    parser.add_argument("--work", type=Path, help="folder for data (reused when present), models and logs "
                                                  "(default: a temporary folder, removed at the end)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every command (median kept)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--ort-child", nargs=3, metavar=("MODEL", "DATA", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--make-data", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_data:
        kind, seed, det_size, *paths = args.make_data
        write_data(kind, int(seed), int(det_size), paths)
        return
    if args.ort_child:
        model, data, batch = args.ort_child
        ort_child(model, data, int(batch))
        return
    models = _list(args.models, MODELS, "--models", parser)
    commands = _list(args.commands, COMMANDS, "--commands", parser)
    try:
        samples = [int(v) for v in args.samples.split(",")]
    except ValueError:
        parser.error(f"--samples: expected comma-separated integers, got {args.samples!r}")
    if min(samples) < 1 or args.repeats < 1 or args.det_size % 32:
        parser.error("--samples and --repeats must be positive, --det-size a multiple of 32")
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        run_bench(args, models, samples, commands, args.work.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="qtool-bench-throughput-") as tmp:
            run_bench(args, models, samples, commands, Path(tmp))


if __name__ == "__main__":
    main()
