"""Default batch sizes, chosen from a memory budget (``--memory``) rather than fixed.

A command estimates what one sample costs from the model and the data: the bytes of every float
activation of one sample (shapes inferred with the data's sizes), times what the command holds
per activation byte, measured on PP-OCRv4 rec as the growth of peak RSS per extra sample in a
batch and rounded up for other models: exec 0.14-0.27 (the executor frees each activation after its last
reader: what grows is the live activations and the kernels' temporaries; PP-OCRv4 rec 0.16, det
at 320 0.27, a ViT-S 0.14, at 512 samples; with 16-bit activations, det 0.45), verify ~3.7
(every float and integer tensor of the batch side by side, and the executor's temporaries).

calibrate counts another way: onnxruntime frees each tensor after its last reader and the
statistics are reduced inside the graph, so what grows with the batch is the working set, the
most activation bytes alive at once in graph order (``sizing.live_peak_bytes``), times 4.5. That
held on every model measured without onnxruntime's layout optimizations (peak RSS growth per
extra sample over that working set: PP-OCRv4 rec 1.8, det 2.6, PP-OCRv6 rec 2.1, det 2.8, PP-LCNet
4.1, YOLOv8n 3.4, ResNet-50 1.8, VGG16 2.1), where a factor of the sum of all activations ranged
from 0.06 (rec) to 0.63 (PP-LCNet). The model counts 4 times (``fixed_bytes``), as verify's: a
VGG16 of 65 MB peaked at 492 MB at batch 1 and 905 MB at the batch of 8 the sum's estimate had
chosen for --memory 512. The
batch is the largest, up to a cap beyond which nothing ran faster, whose estimate fits the
budget; at least 1. The choice
depends only on the model, the data's shapes and the options, so every run makes the same one:
the float reference (onnxruntime) computes in the last bits differently at different batch
sizes, and tables must not change from run to run.

What does not grow with the batch counts too (``fixed_bytes``): the process with its libraries
(~150 MB), and the models. verify holds the float model about 4 times over (its proto, the
onnxruntime session, what loading and preparing it left behind) and the quantized model about 5
times (its proto, the executor's integer weights and their float32 copies for the fast matrix
products); exec only the latter. Measured on MiniLM (90 MB float, 26 MB int8; verify at batch 1
peaks at 610 MB, of which ~40 MB is the sample) and PP-OCRv4 rec (11 MB / 4 MB: 170 MB before
the first sample). When the models alone exceed the budget the batch is 1 and the log says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os

from .errors import QtoolError

_libc = None

# the cores this process may run on (its affinity, where the OS tells it)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
DEFAULT_MEMORY_MB = 512
EXEC_BATCH_CAP = 8
VERIFY_BATCH_CAP = 8
CALIBRATE_BATCH_CAP = 8
# bytes a command holds per byte of one sample's float activations (see above)
# the samples whose tensors verify compares by default, in whole batches spread over the data
# (the outputs are compared on every sample): a per-tensor figure settles within a few batches
DEFAULT_LAYERS = 16
EXEC_FACTOR, VERIFY_FACTOR = 0.5, 4.0
CALIBRATE_FACTOR = 4.5  # of the working set (live_peak_bytes), not of every activation (see above)
EXEC_FACTOR_WIDE = 1.0  # exec of a model with 16-bit activations (int64 sums, wider temporaries)
PROCESS_BYTES = 150 << 20  # python, numpy, onnx, onnxruntime and qtool imported
FLOAT_MODEL_COPIES, INTEGER_MODEL_COPIES = 4, 5


def fixed_bytes(float_model_bytes: int = 0, integer_model_bytes: int = 0) -> int:
    """What a command holds whatever the batch: the process, and its models' copies (above)."""
    return PROCESS_BYTES + FLOAT_MODEL_COPIES * float_model_bytes + INTEGER_MODEL_COPIES * integer_model_bytes


def release_freed() -> None:
    """Give the heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing). Loading
    and preparing a model frees hundreds of MB of copies that glibc otherwise keeps: MiniLM's
    verify held 87 MB of them through its peak."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


class OneAtATime(Exception):
    """The first batch of a batch size the command chose (above 1) failed: the command starts
    again one sample at a time (a model whose input says N but that runs only one sample: a
    Reshape to a fixed leading 1). ``note`` is the line for the log."""

    def __init__(self, size: int, error: Exception, note: str = ""):
        reason = str(error).split(" (on a batch of ")[0]
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        super().__init__(note or f"batch size 1: the model failed on a batch of {size} samples and runs "
                                 f"one sample at a time ({reason})")
        self.note = str(self)


def run_or_one_at_a_time(run, batch_size: int | None, log=None):
    """``run(batch_size)``; when its first batch asks for it (``OneAtATime``), said to ``log`` and
    ``run(1)``: a whole command started again one sample at a time."""
    try:
        return run(batch_size)
    except OneAtATime as retry:
        if log is not None:
            log(retry.note)
        return run(1)


# of verify's bytes per activation byte, the float reference's share: the tensors onnxruntime
# returns and its copies of them while returning (a ViT-S sample: 230 MB returned, +307 MB)
REFERENCE_FACTOR = 2.0
REFERENCE_PARTS_MAX = 8  # the float model in at most this many segments
REFERENCE_PART_MIN = 32 << 20  # bytes of a batch's reference below which a part saves nothing
# the reference is split only when the estimate passes --memory by more than this share: a
# split costs sessions and moves onnxruntime's last bits (a cosine's 6th digit on PP-OCRv4 rec,
# whose estimate passes 512 MB by 13% while its peak stays below it)
REFERENCE_SPLIT_FROM = 1.25


def reference_parts(sizes: list[int], batch: int, memory_mb: int, fixed: int = 0) -> list[int]:
    """Where verify splits a compared batch's float reference: ``sizes`` are the bytes per sample
    of the tensors it compares, in the order the executor computes them. The start of each part
    (``[0]``: the whole reference at once, when it fits ``memory_mb`` beside ``fixed`` and the
    rest of the batch, with ``REFERENCE_SPLIT_FROM``'s margin); else as many parts of about
    equal bytes as fit ``memory_mb``, at most ``REFERENCE_PARTS_MAX``, and fewer when the
    tensors come to less than ``REFERENCE_PART_MIN`` a part (MiniLM's 8 MB a sample in 8 parts
    peaked 13 MB higher than whole)."""
    total = sum(sizes)
    rest = batch * (VERIFY_FACTOR - REFERENCE_FACTOR) * total

    def room(mb: float) -> float:  # reference bytes a sample that fit beside the rest
        return (mb * 2 ** 20 - fixed - rest) / (batch * REFERENCE_FACTOR)

    if total <= room(memory_mb * REFERENCE_SPLIT_FROM):
        return [0]
    count = min(REFERENCE_PARTS_MAX, math.ceil(total / max(room(memory_mb), REFERENCE_PART_MIN / batch)))
    if count < 2:
        return [0]
    starts, part, held = [0], 0, 0
    for i, size in enumerate(sizes):  # a part ends where the running sum passes its share
        share = min(count - 1, int(held * count // total))
        if share > part and i > starts[-1]:
            starts.append(i)
            part = share
        held += size
    return starts


def split_peak(sizes: list[int], starts: list[int], batch: int, fixed: int = 0) -> int:
    """verify's estimate for a batch whose float reference runs in the parts ``starts`` gives
    (``reference_parts``): ``fixed``, the rest of the batch, and the largest part's reference."""
    ends = [*starts[1:], len(sizes)]
    largest = max(sum(sizes[a:b]) for a, b in zip(starts, ends)) if sizes else 0
    return int(fixed + batch * ((VERIFY_FACTOR - REFERENCE_FACTOR) * sum(sizes) + REFERENCE_FACTOR * largest))


def check_memory(memory_mb: int) -> None:
    if memory_mb < 1:
        raise QtoolError(f"--memory must be at least 1 MB, got {memory_mb}")


def choose_batch(activation_bytes: int, factor: float, memory_mb: int, cap: int,
                 fixed: int = 0) -> tuple[int, str]:
    """(batch size, a line for the log) for samples of ``activation_bytes`` of float activations,
    beside ``fixed`` bytes that do not grow with the batch."""
    check_memory(memory_mb)
    per_sample = max(1.0, factor * activation_bytes)
    left = memory_mb * 2 ** 20 - fixed
    size = max(1, min(cap, int(left // per_sample)))
    beside = f" beside about {fixed / 2**20:.0f} MB for the process and its models" if fixed else ""
    over = ("; the models alone take more than --memory: raise it, or expect a larger peak" if left <= 0
            else "; one sample beside them takes more than --memory: raise it, or expect a larger peak"
            if left < per_sample and fixed else "")
    return size, (f"batch size {size} (about {per_sample / 2**20:.0f} MB a sample{beside}; "
                  f"--memory {memory_mb}{over})")
