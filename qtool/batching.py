"""Default batch sizes, chosen from a memory budget (``--memory``) rather than fixed.

A command estimates what one sample costs from the model and the data: the bytes of every float
activation of one sample (shapes inferred with the data's sizes), times what the command holds
per activation byte, measured on PP-OCRv4 rec as the growth of peak RSS per extra sample in a
batch and rounded up for other models: calibrate ~0.25 (onnxruntime's arena; the statistics are
reduced inside the graph), exec ~0.8 (the live activations and the kernels' temporaries), verify
~3.7 (every float and integer tensor of the batch side by side, and the executor's temporaries). The batch is the largest, up
to a cap beyond which nothing ran faster, whose estimate fits the budget; at least 1. The choice
depends only on the model, the data's shapes and the options, so every run makes the same one:
the float reference (onnxruntime) computes in the last bits differently at different batch
sizes, and tables must not change from run to run.
"""

from __future__ import annotations

from .errors import QtoolError

DEFAULT_MEMORY_MB = 512
EXEC_BATCH_CAP = 8
VERIFY_BATCH_CAP = 8
CALIBRATE_BATCH_CAP = 8
# bytes a command holds per byte of one sample's float activations (see above)
CALIBRATE_FACTOR, EXEC_FACTOR, VERIFY_FACTOR = 0.5, 1.5, 4.0


def check_memory(memory_mb: int) -> None:
    if memory_mb < 1:
        raise QtoolError(f"--memory must be at least 1 MB, got {memory_mb}")


def choose_batch(activation_bytes: int, factor: float, memory_mb: int, cap: int) -> tuple[int, str]:
    """(batch size, a line for the log) for samples of ``activation_bytes`` of float activations."""
    check_memory(memory_mb)
    per_sample = max(1.0, factor * activation_bytes)
    size = max(1, min(cap, int(memory_mb * 2 ** 20 // per_sample)))
    return size, (f"batch size {size} (about {per_sample / 2**20:.0f} MB a sample; "
                  f"--memory {memory_mb})")
