"""A Conv's integer sums computed by onnxruntime's float32 Conv (MLAS), where they are exact.

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
must equal the numpy path's; if they do not, or onnxruntime cannot build the session, the plan
keeps the numpy path (``ENABLED`` switches the engine off, for tests).
"""

from __future__ import annotations

import numpy as np

from . import parallel

ENABLED = True

_ELEMENT = {np.dtype(np.int8): 3, np.dtype(np.uint8): 2}  # onnx TensorProto INT8, UINT8


class OrtConv:
    """The float32 sums of one Conv for one input shape and type: ``engine(x)`` gives
    [n, C_out, out_h, out_w] float32, exactly ``sum q_x * q_w`` with padding ``Z_x``;
    ``engine.zero_padded(x)`` the same with padding 0, to which ``border`` (``first, last, lead,
    tail, top, bottom, left, right``, see ``compiled.CompiledRequant.rows``) adds the rest.

    A depthwise conv large enough to split is one session per range of channels (``parts``:
    input channels [a, b) make output channels [c, d)), each on one thread, so the kernel can run
    the ranges on its own threads, each from its sums to its requantized outputs (``part``); a
    dense conv is one session on every core."""

    def __init__(self, parts, border):
        self.parts = parts  # (in_lo, in_hi, out_lo, out_hi, session)
        self.border = border
        first, last, lead, tail, top, bottom, left, right = border
        everything = slice(None)
        self.bands = [(index, band) for index, band in (
            ((everything, everything, slice(0, first)), top),
            ((everything, everything, slice(last, None)), bottom),
            ((everything, everything, slice(first, last), slice(0, lead)), left),
            ((everything, everything, slice(first, last), slice(tail, None)), right)) if band.size]

    def part(self, x: np.ndarray, k: int) -> tuple[int, int, np.ndarray]:
        """Output channels [lo, hi) of part ``k`` and their zero-padded sums."""
        in_lo, in_hi, out_lo, out_hi, session = self.parts[k]
        return out_lo, out_hi, session.run(None, {"x": x[:, in_lo:in_hi] if len(self.parts) > 1 else x})[0]

    def zero_padded(self, x: np.ndarray) -> np.ndarray:
        sums = [self.part(x, k)[2] for k in range(len(self.parts))]
        return sums[0] if len(sums) == 1 else np.concatenate(sums, axis=1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.corrected(self.zero_padded(x))

    def corrected(self, sums: np.ndarray, channels: np.ndarray | None = None) -> np.ndarray:
        """``sums`` (zero-padded, written in place) with the padding's correction: all output
        channels, or the output ``channels`` that ``sums`` holds, in that order."""
        for index, correction in self.bands:
            sums[index] += correction if channels is None else correction[channels]
        return sums


def build(params, in_shape: tuple[int, ...], out_hw: tuple[int, int], dtype: np.dtype, reference) -> OrtConv | None:
    """An engine for ``params`` (``ConvParams``) on inputs of ``in_shape`` and ``dtype``, checked
    against ``reference(x)`` (the numpy path's float32 sums); None where it is not available."""
    if not ENABLED or np.dtype(dtype) not in _ELEMENT:
        return None
    n, c_in, h, w = in_shape
    c_out, c_per_group = params.weight.shape[:2]
    pieces = 1
    if c_per_group == 1 and n * c_out * out_hw[0] * out_hw[1] >= parallel.SPLIT_FROM:
        pieces = max(1, min(parallel.WORKERS, c_in))
    bounds = [c_in * i // pieces for i in range(pieces + 1)]
    per_input = c_out // c_in if c_per_group == 1 else None
    parts = []
    try:
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if per_input is None:  # one session for the whole conv
                parts.append((0, c_in, 0, c_out, _session(params, in_shape, np.dtype(dtype), params.weight,
                                                          params.group, parallel.WORKERS)))
            else:  # depthwise: input channels [lo, hi) make outputs [lo * m, hi * m), one thread each
                weight = params.weight[lo * per_input:hi * per_input]
                parts.append((lo, hi, lo * per_input, hi * per_input,
                              _session(params, (n, hi - lo, h, w), np.dtype(dtype), weight, hi - lo, 1)))
    except Exception:  # an onnxruntime without this Conv form: the numpy path runs instead
        return None
    engine = OrtConv(parts, _border(params, in_shape, out_hw))
    probe = _probe(in_shape, np.dtype(dtype))
    if not np.array_equal(engine(probe), reference(probe)):
        return None
    return engine


def _session(params, in_shape, dtype: np.dtype, weight: np.ndarray, group: int, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    kh, kw = weight.shape[2:]
    top, left, bottom, right = params.pads
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Conv", ["xf", "w"], ["y"], kernel_shape=[kh, kw], pads=[top, left, bottom, right],
                              strides=list(params.strides), dilations=list(params.dilations), group=group)]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", _ELEMENT[dtype], list(in_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight.astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # a dense conv gains from every core, a depthwise one is split by channels instead (measured:
    # onnxruntime's own split of a depthwise conv over two threads is slower than one thread). The
    # pool's threads sleep when idle, so they do not compete with the executor's (ops/parallel.py).
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _border(params, in_shape, out_hw):
    """``(first, last, lead, tail, top, bottom, left, right)``: output rows [0, first) and
    [last, out_h), and in the rows between columns [0, lead) and [tail, out_w), are those whose
    windows reach the padding; ``top`` [C_out, first, out_w], ``bottom``, ``left`` [C_out, last -
    first, lead] and ``right`` hold ``Z_x * sum(w)`` over the taps on padding there, from an exact
    integer conv of the padding's indicator. Where the padding reaches rows or columns inside, the
    whole map is ``top`` (``first = last = out_h``). Nothing to add when ``Z_x`` is 0."""
    from .compiled import no_border
    from .conv import conv_accumulate

    top, left, bottom, right = params.pads
    out_h, out_w = out_hw
    if params.zero_in == 0 or not any(params.pads):
        return no_border(out_h, out_w)
    n, c_in, h, w = in_shape
    (sh, sw), (dh, dw) = params.strides, params.dilations
    kh, kw = params.weight.shape[2:]
    indicator = np.ones((1, c_in, top + h + bottom, left + w + right), dtype=np.int64)
    indicator[:, :, top:top + h, left:left + w] = 0
    sums, _, _ = conv_accumulate(indicator, params.weight.astype(np.int64), params.group, params.strides,
                                 params.dilations)
    correction = (params.zero_in * sums).reshape(-1, out_h, out_w).astype(np.float32)

    def reaches(count, size, stride, dilation, kernel, before):
        return [o * stride < before or o * stride + dilation * (kernel - 1) >= before + size for o in range(count)]

    rows = reaches(out_h, h, sh, dh, kh, top)
    cols = reaches(out_w, w, sw, dw, kw, left)
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
    values = np.array([info.min, info.max, info.min, info.max, 0, 1, -1 if info.min < 0 else 2], dtype=np.int64)
    return values[rng.integers(0, len(values), size=in_shape)].astype(dtype)
