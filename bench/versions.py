"""One qtool command under two versions of qtool, taking turns: times, peak RSS, and whether the
outputs are the same bytes.

    git worktree add /tmp/qtool-old 39d3d21
    python bench/versions.py --old /tmp/qtool-old --repeats 3 -- \\
        quantize MODEL -t table.yaml -o {out} --data calib.npz --json -q

``{out}`` in the command becomes a file of each version's own (``OUT/old.onnx``, ``OUT/new.onnx``,
the suffix kept), and the two are compared byte for byte; so is stdout, as JSON without any
``seconds`` or ``phases`` entries where it parses as JSON (``--json`` reports), else as text.
"new" is the checkout this script belongs to; each run is a whole process (``python -c`` on ``qtool.cli``
with the version's folder first on ``PYTHONPATH``, run from a scratch folder so that the current
directory shadows neither), old and new in turns, so that a host whose speed drifts spreads the
drift over both. Peak RSS comes from ``os.wait4``.

A speed change that should not change results (sharing, caching, a faster kernel) shows both
lines "same" here; this host's whole-process times spread by 15-25% between runs, so give
``--repeats`` 3 or more before reading a 10% difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from steps import timed  # noqa: E402  (bench/ is not a package)

NEW = BENCH.parent
LAUNCH = "import sys; sys.argv = ['qtool'] + sys.argv[1:]; from qtool.cli import main; main()"


def run(folder: Path, argv: list[str], cwd: Path) -> dict:
    """``qtool argv`` with ``folder``'s qtool (``steps.timed``: exit code, stdout, last stderr line,
    seconds, peak MB)."""
    return timed([sys.executable, "-c", LAUNCH, *argv], env={**os.environ, "PYTHONPATH": str(folder)}, cwd=cwd)


TIMES = ("seconds", "phases")  # a step's seconds; the search's seconds per phase


def without_times(value):
    """A JSON value without its ``TIMES`` entries, at any depth."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def report(stdout: str):
    try:
        return without_times(json.loads(stdout))
    except ValueError:
        return stdout


def differences(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ (a few paths)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path or '.'}: {str(a)[:60]} -> {str(b)[:60]}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the other qtool checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each version, in turns")
    parser.add_argument("--out", type=Path, help="folder for the outputs (default: a temporary one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the qtool command; {out}: its output")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not (args.old / "qtool" / "cli.py").is_file():
        parser.error("give --old a qtool checkout and a qtool command after --")
    out_dir = (args.out or Path(tempfile.mkdtemp(prefix="qtool-versions-"))).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = next((Path(a.split("{out}")[1]).suffix for a in command if "{out}" in a), "")
    scratch = Path(tempfile.mkdtemp(prefix="qtool-versions-cwd-"))
    runs = {"old": [], "new": []}
    for _ in range(args.repeats):
        for name, folder in (("old", args.old.resolve()), ("new", NEW)):
            target = out_dir / f"{name}{suffix}"
            argv = [a.replace("{out}", str(target)) for a in command]
            got = run(folder, [str(Path(a).resolve()) if Path(a).exists() else a for a in argv], scratch)
            if got["code"] != 0:
                print(f"{name}: exit {got['code']}: {got['last']}")
                return 1
            got["bytes"] = target.read_bytes() if "{out}" in " ".join(command) else None
            runs[name].append(got)
            print(f"{name}  {got['seconds']:7.2f} s  {got['peak_mb']:6.0f} MB", flush=True)
    for name, done in runs.items():
        times = sorted(r["seconds"] for r in done)
        peaks = sorted(r["peak_mb"] for r in done)
        print(f"{name}: {' / '.join(f'{t:.2f}' for t in times)} s, peak {peaks[0]:.0f}-{peaks[-1]:.0f} MB")
    first = runs["old"][0]
    outputs_same = all(r["bytes"] == first["bytes"] for r in runs["old"] + runs["new"])
    reports_same = all(report(r["stdout"]) == report(first["stdout"]) for r in runs["old"] + runs["new"])
    if "{out}" in " ".join(command):
        print(f"output files: {'same bytes' if outputs_same else 'DIFFER'}")
    print(f"stdout{' (JSON, without seconds)' if isinstance(report(first['stdout']), dict) else ''}: "
          f"{'same' if reports_same else 'DIFFERS'}")
    if not reports_same:
        for line in differences(report(first["stdout"]), report(runs["new"][0]["stdout"]))[:8]:
            print(f"  {line}")
    return 0 if outputs_same and reports_same else 2


if __name__ == "__main__":
    sys.exit(main())
