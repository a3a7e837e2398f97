"""A Conv's integer sums computed by onnxruntime's ConvInteger or float32 Conv (MLAS), where they are exact.

When a ``ConvPlan`` has proven float32 exact for an input type (every partial sum an integer
below 2**24, see ``ConvPlan``), any algorithm that only multiplies and adds the operands gives the
exact sum, in any order and with or without fused multiply-add. MLAS's float convolutions are of
that kind (direct NCHWc kernels, depthwise kernels, im2col or implicit GEMM; no Winograd or FFT
transform), and they are about 2x faster than numpy's BLAS on a 1x1 conv and 4x faster than
numpy's tap-by-tap depthwise loops. This is a float BLAS path like ``int_matmul``'s, not a
quantized kernel: the requantization stays in the executor's own integer code.

The session runs ``Cast(int8/uint8 -> float) -> Conv`` with the node's strides, dilations and
groups, and zero padding; padding with ``Z_x`` is restored after it by adding, on the border
bands only, ``Z_x * sum(w)`` over the taps that fell on padding (integers inside the same bound):
in numpy, or inside the compiled requantizing loop (qtool/ops/_loops.py).
Each engine checks itself once when it is built: its sums on a seeded input of extreme values
must equal the numpy path's; if they do not, or onnxruntime cannot build or run the sessions, the
plan keeps the numpy path (``ENABLED`` switches the engine off, for tests).

A dense conv also gets an engine on onnxruntime's ConvInteger, on uint8 operands (``build``): it
sums in int32, so its sums are exact by the same proof, and the same self-check holds it to the
numpy path; the faster of the two on this host is kept.
"""

from __future__ import annotations

import time

import numpy as np

from ..batching import release_freed
from . import parallel

ENABLED = True
# dense convs on onnxruntime's ConvInteger (``build``): None, where it is the faster of the two
# engines on this host; True, wherever it checks out; False, never
INTEGER: bool | None = None
CHECK_ELEMENTS = 1 << 20  # the self-check's numpy sums and patches, a band of rows at a time

_ELEMENT = {np.dtype(np.int8): 3, np.dtype(np.uint8): 2}  # onnx TensorProto INT8, UINT8


class OrtConv:
    """The sums of one Conv for one input shape and type: ``engine(x)`` gives [n, C_out, out_h,
    out_w] float32 (int32 from ConvInteger sessions, ``integer``), exactly ``sum q_x * q_w`` with
    padding ``Z_x``;
    ``engine.zero_padded(x)`` the same with padding 0, to which ``border`` (``first, last, lead,
    tail, top, bottom, left, right``, see ``compiled.CompiledRequant.rows``) adds the rest.

    A conv large enough to split is one single-threaded session per range of output channels
    (``parts``: input channels [a, b) make output channels [c, d); a dense conv reads every input
    channel, a depthwise one its own), so the kernel runs the ranges on its own threads, each from
    its sums to its requantized outputs (``part``)."""

    def __init__(self, parts, border, integer: bool = False, shift: bool = False):
        self.parts = parts  # (in_lo, in_hi, out_lo, out_hi, session)
        self.part_ranges = tuple((k, k + 1) for k in range(len(parts)))  # for parallel.run_parts
        self.border = border
        self.integer = integer  # ConvInteger sessions: int32 sums (else float32)
        self.shift = shift  # ConvInteger of an int8 input: it reads x + 128 as uint8 (``feed``)
        first, last, lead, tail, top, bottom, left, right = border
        everything = slice(None)
        self.bands = [(index, band) for index, band in (
            ((everything, everything, slice(0, first)), top),
            ((everything, everything, slice(last, None)), bottom),
            ((everything, everything, slice(first, last), slice(0, lead)), left),
            ((everything, everything, slice(first, last), slice(tail, None)), right)) if band.size]

    def sharing(self, params, in_shape: tuple[int, ...], out_hw: tuple[int, int]) -> "OrtConv":
        """This engine's sessions with the padding correction of ``params`` (another ``Z_x``): an
        input of the same type and shape padded with another value, with no session more."""
        return OrtConv(self.parts, _border(params, in_shape, out_hw, self.integer), self.integer, self.shift)

    def feed(self, x: np.ndarray) -> np.ndarray:
        """What the sessions read for input ``x`` (given to ``part``): ``x`` itself, or for
        ConvInteger on int8, its bytes with the sign bit flipped (``x + 128`` as uint8)."""
        return np.bitwise_xor(x.view(np.uint8), np.uint8(128)) if self.shift else x

    def part(self, x: np.ndarray, k: int) -> tuple[int, int, np.ndarray]:
        """Output channels [lo, hi) of part ``k`` and their zero-padded sums, for ``x`` as
        ``feed`` gives it."""
        in_lo, in_hi, out_lo, out_hi, session = self.parts[k]
        own = x if in_hi - in_lo == x.shape[1] else x[:, in_lo:in_hi]
        return out_lo, out_hi, session.run(None, {"x": own})[0]

    def zero_padded(self, x: np.ndarray) -> np.ndarray:
        """All output channels' zero-padded sums, the parts on the executor's threads."""
        sums = [None] * len(self.parts)
        x = self.feed(x)

        def parts(first: int, stop: int) -> None:
            for k in range(first, stop):
                sums[k] = self.part(x, k)[2]

        parallel.run_parts(parts, self.part_ranges)
        return sums[0] if len(sums) == 1 else np.concatenate(sums, axis=1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.corrected(self.zero_padded(x))

    def corrected(self, sums: np.ndarray, channels: np.ndarray | None = None) -> np.ndarray:
        """``sums`` (zero-padded, written in place) with the padding's correction: all output
        channels, or the output ``channels`` that ``sums`` holds, in that order."""
        for index, correction in self.bands:
            sums[index] += correction if channels is None else correction[channels]
        return sums


def build(params, in_shape: tuple[int, ...], out_hw: tuple[int, int], dtype: np.dtype,
          reference) -> OrtConv | None:
    """An engine for ``params`` (``ConvParams``) on inputs of ``in_shape`` and ``dtype``, checked
    against ``reference(x)(start, stop)`` (the numpy path's float32 sums of output rows [start,
    stop) of input ``x``, compared a band of rows at a time so that its patches stay small); None
    where onnxruntime cannot build or run it, or where it disagrees.

    A dense conv (one group) also gets an engine on onnxruntime's ConvInteger, on uint8 operands
    (weights ``w + 128`` with zero point 128; an int8 input as ``x + 128`` with zero point 128,
    which is also what it pads with, so padding adds nothing): int32 sums, 1.3-1.6x faster than
    the float engine on a 2-core AMD EPYC with AVX-512 VNNI (3x3 and 1x1 convs of PP-OCRv4 det and
    rec). uint8 by uint8 is the form MLAS computes without a saturating step (its int8-weight form
    saturates pairs of products on x86 without VNNI, seed 002; on that AVX-512 host it also ran 3x
    slower than the float Conv), and the same self-check holds it to the numpy path's sums. Where both check out,
    the faster on the probe (``INTEGER`` None) is kept: both give the same sums, so the choice
    changes the time only, on hosts whose kernels differ. Depthwise and grouped convs keep the
    float engine, faster there (MLAS's depthwise kernel)."""
    if not ENABLED or np.dtype(dtype) not in _ELEMENT:
        return None
    dtype = np.dtype(dtype)
    integer = None
    if INTEGER is not False and params.group == 1:
        integer = _checked(params, in_shape, out_hw, dtype, reference, True)
        if integer is not None and INTEGER:
            return integer
    floating = _checked(params, in_shape, out_hw, dtype, reference, False)
    if integer is None or floating is None:
        return integer or floating
    probe = _probe(in_shape, dtype)
    return integer if _seconds(integer, probe) <= _seconds(floating, probe) else floating


def _seconds(engine: OrtConv, probe: np.ndarray, runs: int = 2) -> float:
    """The engine's quickest of ``runs`` on ``probe`` (after the self-check's first run)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        engine(probe)
        best = min(best, time.perf_counter() - start)
    return best


def _checked(params, in_shape: tuple[int, ...], out_hw: tuple[int, int], dtype: np.dtype, reference,
             integer: bool) -> OrtConv | None:
    """``build``'s engine of one kind (``integer``: ConvInteger), or None."""
    n, c_in, h, w = in_shape
    c_out, c_per_group = params.weight.shape[:2]
    depthwise = c_per_group == 1
    pieces = 1  # one session per range of output channels, each on one thread
    if (depthwise or params.group == 1) and n * c_out * out_hw[0] * out_hw[1] >= parallel.SPLIT_FROM:
        pieces = max(1, min(parallel.WORKERS, c_in if depthwise else c_out))
    per_input = c_out // c_in if depthwise else None
    bounds = [(c_in if depthwise else c_out) * i // pieces for i in range(pieces + 1)]
    parts = []
    try:
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if depthwise:  # input channels [lo, hi) make outputs [lo * m, hi * m)
                weight = params.weight[lo * per_input:hi * per_input]
                parts.append((lo, hi, lo * per_input, hi * per_input,
                              _session(params, (n, hi - lo, h, w), dtype, weight, hi - lo, integer)))
            else:  # outputs [lo, hi) from every input channel
                session = _session(params, in_shape, dtype, params.weight[lo:hi], params.group, integer)
                parts.append((0, c_in, lo, hi, session))
    except Exception:  # an onnxruntime without this Conv form: the numpy path runs instead
        return None
    engine = OrtConv(parts, _border(params, in_shape, out_hw, integer), integer, integer and dtype == np.int8)
    probe = _probe(in_shape, np.dtype(dtype))
    rows = reference(probe)
    kh, kw = params.weight.shape[2:]
    widest = max(c_out, c_in * kh * kw)  # per output pixel: its sums, or the numpy path's patch
    band = max(1, CHECK_ELEMENTS // (n * widest * out_hw[1]))
    try:
        sums = engine(probe)
    except Exception:  # onnxruntime could build the session but not run it
        return None
    try:
        for start in range(0, out_hw[0], band):
            stop = min(out_hw[0], start + band)
            if not np.array_equal(sums[:, :, start:stop], rows(start, stop)):
                return None
        return engine
    finally:
        # the check's probe, sums and patches, gone: their heap back to the system, so that the
        # next engine's check does not grow the process (a model's checks one after another
        # took PP-OCRv4 rec's int16 exec to 920 MB where 330 MB stay in use)
        del probe, sums, rows
        release_freed()


def _session(params, in_shape, dtype: np.dtype, weight: np.ndarray, group: int, integer: bool = False):
    """A session of ``Cast(x -> float) -> Conv``, or (``integer``) of ``ConvInteger`` on uint8
    operands (``build``): its zero-padded sums of ``x * weight``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    kh, kw = weight.shape[2:]
    top, left, bottom, right = params.pads
    attrs = dict(kernel_shape=[kh, kw], pads=[top, left, bottom, right], strides=list(params.strides),
                 dilations=list(params.dilations), group=group)
    if integer:
        x_zero = 128 if dtype == np.int8 else 0
        nodes = [helper.make_node("ConvInteger", ["x", "w", "x_zero", "w_zero"], ["y"], **attrs)]
        x = helper.make_tensor_value_info("x", TensorProto.UINT8, list(in_shape))
        y = helper.make_tensor_value_info("y", TensorProto.INT32, None)
        weights = [numpy_helper.from_array((weight.astype(np.int16) + 128).astype(np.uint8), "w"),
                   numpy_helper.from_array(np.array(x_zero, np.uint8), "x_zero"),
                   numpy_helper.from_array(np.array(128, np.uint8), "w_zero")]
    else:
        nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
                 helper.make_node("Conv", ["xf", "w"], ["y"], **attrs)]
        x = helper.make_tensor_value_info("x", _ELEMENT[dtype], list(in_shape))
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        weights = [numpy_helper.from_array(weight.astype(np.float32), "w")]
    graph = helper.make_graph(nodes, "conv", [x], [y], weights)
    # IR 8 and opset 13: what every onnxruntime this project supports (>= 1.17) reads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # one thread: the kernel runs the parts on its own threads (ops/parallel.py); a pool per
    # session would add a thread per conv, and onnxruntime's own split of a depthwise conv over
    # two threads measured slower than one thread.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # no memory arena: each session would keep its largest buffers for good, one set per conv
    # (PP-OCRv4 det: 1.2 GB peak with arenas, 0.6 GB without)
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _border(params, in_shape, out_hw, integer: bool = False):
    """``(first, last, lead, tail, top, bottom, left, right)``: output rows [0, first) and
    [last, out_h), and in the rows between columns [0, lead) and [tail, out_w), are those whose
    windows reach the padding; ``top`` [C_out, first, out_w], ``bottom``, ``left`` [C_out, last -
    first, lead] and ``right`` hold ``Z_x * sum(w)`` over the taps on padding there. Where the
    padding reaches rows or columns inside, the whole map is ``top`` (``first = last = out_h``).
    Nothing to add when ``Z_x`` is 0. ``integer``: the bands are int32 (to add to a ConvInteger
    engine's sums in place), else float32."""
    from .compiled import no_border

    top, left, bottom, right = params.pads
    out_h, out_w = out_hw
    if params.zero_in == 0 or not any(params.pads):
        return no_border(out_h, out_w)
    n, c_in, h, w = in_shape
    (sh, sw), (dh, dw) = params.strides, params.dilations
    kh, kw = params.weight.shape[2:]
    # tap (i, j) of output (r, q) reads padding unless both its input row and column are inside:
    # the correction is Z_x * (the sum of all taps - the sum of those inside), exact in int64
    taps = params.weight.astype(np.int64).sum(axis=1)  # [C_out, kh, kw], over the group's inputs
    rows_in = np.array([[0 <= r * sh - top + i * dh < h for i in range(kh)] for r in range(out_h)], np.int64)
    cols_in = np.array([[0 <= q * sw - left + j * dw < w for j in range(kw)] for q in range(out_w)], np.int64)
    inside = np.einsum("ri,cij,qj->crq", rows_in, taps, cols_in)
    correction = (params.zero_in * (taps.sum(axis=(1, 2))[:, None, None] - inside)).astype(
        np.int32 if integer else np.float32)
    rows = (rows_in.min(axis=1) == 0).tolist()  # output rows with a tap on padding
    cols = (cols_in.min(axis=1) == 0).tolist()
    first = next((r for r, hit in enumerate(rows) if not hit), out_h)  # rows [0, first) reach the top
    last = max(first, next((r + 1 for r in range(out_h - 1, -1, -1) if not rows[r]), first))
    lead = next((c for c, hit in enumerate(cols) if not hit), out_w)
    tail = max(lead, next((c + 1 for c in range(out_w - 1, -1, -1) if not cols[c]), lead))
    if any(rows[first:last]) or any(cols[lead:tail]):  # padding reaches inside: the whole map
        first = last = out_h
    band = (lambda r, c: np.ascontiguousarray(correction[:, r, c]))  # noqa: E731
    return (first, last, lead, tail, band(slice(0, first), slice(None)), band(slice(last, None), slice(None)),
            band(slice(first, last), slice(0, lead)), band(slice(first, last), slice(tail, None)))


def _probe(in_shape, dtype: np.dtype) -> np.ndarray:
    """Extreme values of ``dtype`` (its two ends, and a few in between), seeded."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    values = np.array([info.min, info.max, info.min, info.max, 0, 1, -1 if info.min < 0 else 2],
                      dtype=np.int64)
    return values[rng.integers(0, len(values), size=in_shape)].astype(dtype)
