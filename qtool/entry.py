"""The ``qtool`` console script: Ctrl-C and SIGTERM noted from the first instant.

Importing the command line (typer, numpy, onnx, onnxruntime) takes a quarter of a second. A Ctrl-C
then, before ``qtool.cli.main`` installs its handlers, printed a KeyboardInterrupt traceback or
broke an extension's import ("ImportError: initialization failed", exit 3). Here the signals are
only noted while the imports run; ``main`` then stops with its one line (exit 130 or 143).
"""

from __future__ import annotations

import signal

NOTED: list[int] = []  # the signals received before qtool.cli.main took over


def _note(signum, frame) -> None:
    NOTED.append(signum)


def main() -> None:
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) is default:  # not ignored (a background job's SIGINT)
            signal.signal(sig, _note)
    from .cli import main as run

    run()
