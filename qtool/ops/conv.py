"""Conv: ``q_y = ((sum q_x * q_w + b_i32) * M >> rshift) + Z_y`` per output channel.

``b_i32 = round(B / (S_x * S_w)) - Z_x * sum(q_w)`` folds the input zero point into the bias, so
padding fills with ``Z_x`` (real zero) and the weights need zero point 0.

The kernel sums on float32 where the weights prove it exact and the accumulator in range
(``ConvPlan``, set up once per input shape), and requantizes with the bias and zero point folded
into one multiply, add and shift (``OffsetRequant``); otherwise exactly, scanning for overflow.
The sums come from onnxruntime's ConvInteger or float32 Conv where it is available
(qtool/ops/ortconv.py), else from numpy; the requantization runs as a compiled loop where numba is installed
(qtool/ops/compiled.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from ..fixedpoint import (INT32_MAX, INT32_MIN, OffsetRequant, Requant, narrowed, offset_requant,
                          quantize_multipliers, requantize, saturate)
from ..qparams import QParams
from . import Bias, IntegerOp, NodeView, Unsupported, Weight, check_integer, parallel, per_tensor, plan_for, register
from . import compiled, ortconv
from .bytetable import lookup
from .intmatmul import FLOAT32_EXACT, int_matmul


@dataclass(frozen=True)
class ConvParams:
    weight: np.ndarray  # int8 [C_out, C_in/group, kh, kw]
    bias: np.ndarray  # int64 [C_out], zero-point compensated
    requant: Requant  # per output channel
    zero_in: int
    zero_out: int | np.ndarray  # one per output channel where the output is quantized per channel
    pads: tuple[int, ...]  # top, left, bottom, right (rank 3: front, top, left, back, bottom, right)
    strides: tuple[int, ...]  # (rank 3: depth, height, width)
    dilations: tuple[int, ...]
    group: int
    rounding: str
    dtype: str
    # 1 for a 1-D Conv ([N, C, L]), held as the 2-D Conv of height 1 it equals: weight [C_out,
    # C_in/group, 1, k], no padding, stride or dilation along the height; [N, C, L] inputs run
    # as [N, C, 1, L] (a view). 3 for a 3-D Conv ([N, C, D, H, W], weight [C_out, C_in/group,
    # kd, kh, kw]): the exact path of ``run_volume``
    rank: int = 2


def accumulator_bias(view: NodeView, bias_index: int | None, weight_q: np.ndarray, axis: int,
                     channel_scale: np.ndarray, zero_in: int) -> np.ndarray:
    """int32 bias in accumulator units minus ``Z_x * sum(q_w)`` per output channel."""
    channels = weight_q.shape[axis]
    sums = np.moveaxis(weight_q.astype(np.int64), axis, 0).reshape(channels, -1).sum(axis=1)
    bias = np.zeros(channels, dtype=np.int64)
    operand = None
    if bias_index is not None and bias_index < len(view.inputs):
        operand = view.inputs[bias_index]
    if operand is not None:
        if operand.qparams is None:
            raise Unsupported("bias must be quantized")
        stored = operand.value.astype(np.int64).reshape(-1)
        bias_scale = np.broadcast_to(np.asarray(operand.qparams.scale, np.float64), (channels,))
        if np.any(np.asarray(operand.qparams.zero_point) != 0):
            raise Unsupported("bias zero point must be 0")
        bias = in_accumulator_units(stored, bias_scale, channel_scale)
    return bias - zero_in * sums


def fitted_requant(scales, view: NodeView, weight_q: np.ndarray, axis: int, bias: np.ndarray,
                   x: QParams) -> Requant:
    """The per-channel multipliers of ``scales``, narrowed (fixedpoint.narrowed) where a channel's
    accumulator can leave int32: ``sum |q_w| * max |q_x| + |bias|`` bounds it (16-bit inputs)."""
    channels = weight_q.shape[axis]
    l1 = np.abs(np.moveaxis(weight_q.astype(np.int64), axis, 0).reshape(channels, -1)).sum(axis=1)
    bound = l1 * max(abs(x.qmin), abs(x.qmax)) + np.abs(bias)
    return narrowed(quantize_multipliers(scales, view.multiplier_bits), bound)


def in_accumulator_units(stored: np.ndarray, scale, accumulator_scale) -> np.ndarray:
    """int64 ``stored`` (a bias at ``scale``) in units of ``accumulator_scale``: as it is where the
    two agree in float32, else moved to the accumulator's scale at setup (rounded)."""
    scale, accumulator_scale = np.asarray(scale, np.float64), np.asarray(accumulator_scale, np.float64)
    if np.array_equal(np.broadcast_to(scale, np.shape(accumulator_scale)).astype(np.float32),
                      accumulator_scale.astype(np.float32)):
        return stored
    return np.rint(stored * scale / accumulator_scale).astype(np.int64)


def depthwise_input(qp: QParams, weight: np.ndarray, group: int) -> QParams:
    """The input's (S, Z) as the kernel takes it: per tensor, or for a depthwise Conv (one input
    channel per group) one scale per input channel with one zero point for all of them (padding
    fills with it), returned as one scale per output channel (output channel ``o`` reads input
    channel ``o // (C_out / group)``)."""
    if np.ndim(qp.scale) == 0 or np.size(qp.scale) == 1:
        return per_tensor(qp, "Conv input")
    zero = np.asarray(qp.zero_point).reshape(-1)
    if qp.axis != 1 or weight.shape[1] != 1 or group != np.size(qp.scale) or np.any(zero != zero[0]):
        raise Unsupported("Conv input must be quantized per tensor (per channel only into a depthwise "
                          "Conv, with one zero point)")
    scale = np.repeat(np.asarray(qp.scale, np.float64).reshape(-1), weight.shape[0] // group)
    return QParams(scale, int(zero[0]), qp.dtype)


def channel_output(qp: QParams, channels: int, what: str) -> QParams:
    """The output's (S, Z): per tensor, or one scale and zero point per output channel (axis 1)."""
    if np.ndim(qp.scale) == 0 or np.size(qp.scale) == 1:
        return per_tensor(qp, what)
    if qp.axis != 1 or np.size(qp.scale) != channels:
        raise Unsupported(f"{what} must be quantized per tensor or per output channel")
    return QParams(np.asarray(qp.scale, np.float64).reshape(-1), np.asarray(qp.zero_point, np.int64).reshape(-1),
                   qp.dtype, 1)


def zero_column(zero, ndim: int):
    """A zero point (one, or one per output channel) shaped to broadcast along axis 0 of an
    accumulator whose channels come first of ``ndim`` axes (after the batch: ``[C, 1, ...]``)."""
    return zero if np.ndim(zero) == 0 else np.asarray(zero, np.int64).reshape((-1,) + (1,) * (ndim - 1))


def weight_scales(view: NodeView, index: int, channels: int, axis: int) -> np.ndarray:
    operand = view.inputs[index]
    if operand is None or operand.value is None or operand.qparams is None:
        raise Unsupported("weight must be a quantized constant")
    qp = operand.qparams
    if np.any(np.asarray(qp.zero_point) != 0):
        raise Unsupported("weight zero point must be 0 (symmetric weights)")
    if qp.axis is not None and qp.axis % operand.value.ndim != axis:
        raise Unsupported(f"weight must be quantized along axis {axis}")
    return np.broadcast_to(np.asarray(qp.scale, dtype=np.float64).reshape(-1), (channels,))


@register
class Conv(IntegerOp):
    op_type = "Conv"
    takes_table = True

    def constants(self, node):
        return {1: Weight(axis=0), 2: Bias(activation=0, weight=1)}

    def check(self, node, attrs):
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            raise Unsupported("auto_pad SAME_* is not supported")
        if len(attrs.get("kernel_shape", [0, 0])) not in (1, 2, 3):
            raise Unsupported("only 1-D, 2-D and 3-D convolutions are supported")

    def derive(self, view: NodeView) -> ConvParams:
        self.check(view.node, view.attrs)
        weight = view.inputs[1].value
        if weight.ndim not in (3, 4, 5):
            raise Unsupported("only 1-D, 2-D and 3-D convolutions are supported")
        channels = weight.shape[0]
        x = depthwise_input(view.inputs[0].qparams, weight, view.attr("group", 1))
        y = channel_output(view.output, channels, "Conv output")
        channel_scale = x.scale * weight_scales(view, 1, channels, 0)
        rank = weight.ndim - 2
        pads = tuple(view.attr("pads", [0] * 2 * rank))
        strides, dilations = tuple(view.attr("strides", [1] * rank)), tuple(view.attr("dilations", [1] * rank))
        if rank == 1:  # the 2-D Conv of height 1 it equals
            weight, pads = weight[:, :, None, :], (0, pads[0], 0, pads[1])
            strides, dilations = (1, *strides), (1, *dilations)
        bias = accumulator_bias(view, 2, weight, 0, channel_scale, x.zero_point)
        return ConvParams(
            weight=weight,
            bias=bias,
            requant=fitted_requant(channel_scale / y.scale, view, weight, 0, bias, x),
            zero_in=x.zero_point,
            zero_out=y.zero_point,
            pads=tuple(int(v) for v in pads),
            strides=strides,
            dilations=dilations,
            group=view.attr("group", 1),
            rounding=view.rounding,
            dtype=y.dtype,
            rank=rank,
        )

    def specialize(self, p: ConvParams, shapes) -> "ConvPlan | ConvParams":
        if p.rank == 3:
            return p  # run_volume needs no plan
        shape = tuple(shapes[0])
        return ConvPlan.of(p, shape if p.rank == 2 else (*shape[:2], 1, *shape[2:]))

    def run(self, p: "ConvParams | ConvPlan", x: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
        """``table`` (``takes_table``): the output is ``table[byte of q_y]``, in the requantizing
        pass where the compiled loop writes the output whole, else looked up after."""
        rank = (p.params if isinstance(p, ConvPlan) else p).rank
        if rank == 1:  # [N, C, L] as [N, C, 1, L]
            return self._run(p, x[:, :, None, :], table)[:, :, 0, :]
        if rank == 3:
            return _mapped(run_volume(p, x), table)
        return self._run(p, x, table)

    def _run(self, p: "ConvParams | ConvPlan", x: np.ndarray, table: np.ndarray | None) -> np.ndarray:
        if table is not None and table.size != 256:  # a 16-bit output's table: looked up after
            return _mapped(self._run(p, x, None), table)
        params, plan = plan_for(p, x, ConvPlan)
        tail = plan.tails.get(x.dtype)
        if tail is None and plan.split16 is not None and x.dtype == np.int16:
            if plan.depthwise16 is not None:
                return _mapped(_run_depthwise16(plan, x), table)
            return _mapped(_run_split16(plan, x), table)
        if tail is None:
            return _mapped(run_scanned(params, x), table)
        engine = plan.engine(x.dtype)
        if engine is not None and isinstance(tail.requant, compiled.CompiledRequant):
            return _run_compiled(plan, engine, tail, x, table)
        if engine is not None:
            prepare, accumulate = engine, _rows_of
        else:
            prepare, accumulate = _FLOAT32[plan.method]
            prepare = functools.partial(prepare, plan)
        prepared = prepare(x)
        out = np.empty((x.shape[0], params.weight.shape[0], *plan.out_hw), dtype=params.dtype)

        def rows(start: int, stop: int) -> None:
            for lo, hi, acc in plan.numpy_bands(functools.partial(accumulate, plan, prepared), start, stop):
                if tail.unproven.size:
                    check_int32(acc[:, tail.unproven], params.bias[tail.unproven].reshape(-1, 1, 1))
                tail.requant(acc, out=out[:, :, lo:hi])

        parallel.run_parts(rows, plan.row_parts)
        return _mapped(out, table)


def _run_compiled(plan: "ConvPlan", engine: "ortconv.OrtConv", tail: "Tail", x: np.ndarray,
                  table: np.ndarray | None) -> np.ndarray:
    """onnxruntime's zero-padded sums, requantized by the compiled loop, which adds the padding's
    correction and looks up ``table`` in the same pass, by ranges of output channels, each summed
    and requantized on its own thread (``OrtConv.parts``). The channels to scan for int32 overflow
    are corrected apart and scanned first."""
    params = plan.params
    out = np.empty((x.shape[0], params.weight.shape[0], *plan.out_hw),
                   dtype=params.dtype if table is None else table.dtype)

    def scan(sums: np.ndarray, lo: int, hi: int) -> None:
        chosen = tail.unproven[(tail.unproven >= lo) & (tail.unproven < hi)]
        if chosen.size:
            check_int32(engine.corrected(sums[:, chosen - lo], chosen), params.bias[chosen].reshape(-1, 1, 1))

    fed = engine.feed(x)

    def channels(first: int, stop: int) -> None:
        for k in range(first, stop):
            lo, hi, sums = engine.part(fed, k)
            scan(sums, lo, hi)
            tail.requant.rows(sums, out, 0, plan.out_hw[0], table, engine.border, (lo, hi))

    parallel.run_parts(channels, engine.part_ranges)
    return out


def _run_split16(plan: "ConvPlan", x: np.ndarray) -> np.ndarray:
    """An int16 input's sums in parts (``ConvPlan.split_sums``) through the plan's int16 tail
    (an ``OffsetRequant`` proven for every int16 input), joined in the requantizing pass; the
    channels whose sums may leave int32 go through ``requantize`` as well, which raises where
    their multiplier was not narrowed."""
    params, tail = plan.params, plan.split16
    if isinstance(tail.requant, compiled.CompiledRequant) and plan.split_engines()[0] is not None:
        return _run_split16_parts(plan, tail, x)
    high, low, extra = plan.split_sums(x)
    _scan_joined(params, high, low, extra, tail.unproven)
    if isinstance(tail.requant, compiled.CompiledRequant):
        return tail.requant.joined(high, low, extra)
    return tail.requant(_joined(high, low, extra))


def _run_depthwise16(plan: "ConvPlan", x: np.ndarray) -> np.ndarray:
    """A depthwise Conv of an int16 input in one compiled pass per range of output channels
    (``compiled.CompiledRequant.depthwise``): its sums in float64 are exact, so there are no byte
    halves to sum twice and join."""
    params, requant = plan.params, plan.split16.requant
    out = np.empty((x.shape[0], params.weight.shape[0], *plan.out_hw), dtype=params.dtype)
    x = np.ascontiguousarray(x)
    per_input = params.weight.shape[0] // x.shape[1]

    def channels(lo: int, hi: int) -> None:
        requant.depthwise(x, plan.depthwise16, per_input, params.strides, params.dilations, params.pads, out, (lo, hi))

    parallel.run_parts(channels, parallel.ranges(params.weight.shape[0], out.size))
    return out


def _run_split16_parts(plan: "ConvPlan", tail: "Tail", x: np.ndarray) -> np.ndarray:
    """``_run_split16`` on onnxruntime's engines by their ranges of output channels, each range's
    two halves summed, joined and requantized on its own thread (as ``_run_compiled``): no
    whole-tensor sums are concatenated, and the requantization runs on every core."""
    params = plan.params
    high, low, extra = plan.split_engines()
    upper, lower = high.feed(split_high(x)), low.feed(split_low(x))
    out = np.empty((x.shape[0], params.weight.shape[0], *plan.out_hw), dtype=params.dtype)

    def channels(first: int, stop: int) -> None:
        for k in range(first, stop):
            lo, hi, sums_high = high.part(upper, k)
            sums_low = low.part(lower, k)[2]
            picked = np.arange(lo, hi)
            high.corrected(sums_high, picked), low.corrected(sums_low, picked)
            chosen = tail.unproven[(tail.unproven >= lo) & (tail.unproven < hi)]
            _scan_joined(params, sums_high, sums_low, extra, chosen, first=lo)
            tail.requant.joined(sums_high, sums_low, extra[lo:hi], out=out, channels=(lo, hi))

    parallel.run_parts(channels, high.part_ranges)
    return out


def _scan_joined(params: "ConvParams", high: np.ndarray, low: np.ndarray, extra: np.ndarray, chosen: np.ndarray,
                 first: int = 0) -> None:
    """Raise as ``requantize`` does where the joined sums of output channels ``chosen`` leave
    int32 (``high`` and ``low`` hold the channels from ``first`` on)."""
    if not chosen.size:
        return
    acc = _joined(high[:, chosen - first], low[:, chosen - first], extra[chosen])
    column = (-1, 1, 1)
    requantize(acc + params.bias[chosen].reshape(column), params.requant.multiplier[chosen].reshape(column),
               params.requant.rshift[chosen].reshape(column), params.rounding)


def join_halves(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """``256 * high + low`` in int64: the sums of an int16 input's high and low bytes joined."""
    acc = high.astype(np.int64)
    acc *= 256
    acc += low.astype(np.int64)
    return acc


def byte_halves(x: np.ndarray) -> list[np.ndarray]:
    """An int16 array as float32 ``[x >> 8, x & 0xFF]``: ``x = 256 * hi + lo``, ``hi`` in
    [-128, 127] and ``lo`` in [0, 255]."""
    return [(x >> 8).astype(np.float32), (x & 0xFF).astype(np.float32)]


def _joined(high: np.ndarray, low: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """``256 * high + low + extra`` (per channel, axis 1) in int64."""
    acc = join_halves(high, low)
    acc += extra.reshape(-1, 1, 1)
    return acc


def _mapped(q: np.ndarray, table: np.ndarray | None) -> np.ndarray:
    return q if table is None else lookup(table, q)


def run_scanned(p: ConvParams, x: np.ndarray, extra=None) -> np.ndarray:
    """The path without static bounds: exact accumulation (``int_matmul`` picks float32 or float64
    from the operands' actual maxima), and ``requantize`` scans the accumulator for overflow.
    ``extra(x)``, if given, returns int64 [n, C_out, out_h * out_w] added to the accumulator: what
    a target's arithmetic changes (qtool/targets/x86.py)."""
    n, c_out = x.shape[0], p.weight.shape[0]
    top, left, bottom, right = p.pads
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=p.zero_in)
    acc, out_h, out_w = conv_accumulate(padded, p.weight, p.group, p.strides, p.dilations)
    if extra is not None:
        acc = acc + extra(x)
    return _requantized(p, acc).reshape(n, c_out, out_h, out_w)


def _requantized(p: ConvParams, acc: np.ndarray) -> np.ndarray:
    """The output levels of int64 sums [n, C_out, L]: bias, requantization scanning for int32
    overflow, zero point, saturation."""
    y = requantize(acc + p.bias[None, :, None], p.requant.multiplier[None, :, None], p.requant.rshift[None, :, None],
                   p.rounding)
    return saturate(y + zero_column(p.zero_out, 2), p.dtype)


def run_volume(p: ConvParams, x: np.ndarray) -> np.ndarray:
    """A 3-D Conv, exactly: the sum over the ``kd`` depth taps of 2-D accumulations (each
    ``conv_accumulate`` of the depth planes that tap reads, the output depths as a batch), then
    the bias, the requantization scanning for int32 overflow and the zero point, as ``run_scanned``.
    Padding is ``Z_x`` along all three axes. No float32 fast path: a plain, readable kernel."""
    check_integer(x, p.weight)
    if x.ndim != 5:
        raise ValueError(f"Conv is 3-D: got input shape {x.shape}")
    n, c_in, depth = x.shape[:3]
    c_out, _, kd = p.weight.shape[:3]
    front, top, left, back, bottom, right = p.pads
    (sd, sh, sw), (dd, dh, dw) = p.strides, p.dilations
    padded = np.pad(x, ((0, 0), (0, 0), (front, back), (top, bottom), (left, right)), constant_values=p.zero_in)
    out_d = (depth + front + back - dd * (kd - 1) - 1) // sd + 1
    acc = out_h = out_w = None
    for k in range(kd):
        planes = padded[:, :, k * dd:k * dd + sd * (out_d - 1) + 1:sd]  # [n, C, out_d, H_p, W_p]
        planes = planes.transpose(0, 2, 1, 3, 4).reshape(n * out_d, c_in, *planes.shape[3:])
        part, out_h, out_w = conv_accumulate(planes, p.weight[:, :, k], p.group, (sh, sw), (dh, dw))
        acc = part.astype(np.int64) if acc is None else acc + part
    y = _requantized(p, acc).reshape(n, out_d, c_out, out_h, out_w)
    return np.ascontiguousarray(y.transpose(0, 2, 1, 3, 4))


# the largest |q| of an input type: a bound that holds for every input of that type
INPUT_MAX = {np.dtype(np.int8): 128, np.dtype(np.uint8): 255}
# the numpy path's working arrays for one band of output rows (im2col patches, float32 sums), at
# most about this: a whole thread's rows at once took basic-pitch's 5x5 conv over 8 samples to
# 1.3 GB of patches (exec peaked at 1.6 GB against a --memory of 512 MB)
BAND_BYTES = 1 << 25


@dataclass(frozen=True)
class ConvPlan:
    """A Conv specialized for one input shape (setup; the executor caches it per shape).

    For int8 and uint8 inputs the kernel runs on float32 where two bounds, proven here per input
    type from the weights alone, hold. Output channel c sums products ``q_x * q_w`` whose absolute
    values add up to at most ``l1_c * max|q_x|`` (``l1_c = sum |q_w|`` over its window; padding is
    ``Z_x``, an input value too):
    * ``max_c l1_c * max|q_x| < 2**24``: every partial sum, in whatever order the BLAS or the
      depthwise taps add, is an integer float32 holds exactly;
    * ``l1_c * max|q_x| + |b_c|`` within int32 (and the int64 steps of ``OffsetRequant``): the
      accumulator cannot overflow, so it is not scanned (``offset_requant``).
    Channels where the second bound fails (a saturated bias) are scanned alone, ``unproven``. Where
    the first fails, or for other input types, ``tails`` has no entry and the kernel takes the
    scanned path.

    The float32 path prepares its input once (padded, and for the taps as float32), then computes
    the output row ranges ``row_parts`` on the cores (qtool/ops/parallel.py), each from its
    patches and products to the int8 it writes. Where onnxruntime's Conv checks out for an input
    type (``engine``), it computes the sums instead, by ranges of output channels.
    """

    params: ConvParams
    in_shape: tuple[int, ...]
    out_hw: tuple[int, int]
    method: str  # a key of _FLOAT32
    weight: np.ndarray  # float32, laid out for ``method``
    tails: dict  # input np.dtype -> Tail
    row_parts: tuple[tuple[int, int], ...]  # output row ranges, one per thread
    engines: dict = field(default_factory=dict)  # input np.dtype -> ortconv.OrtConv or None

    @classmethod
    def of(cls, p: ConvParams, shape: tuple[int, ...]) -> "ConvPlan":
        if len(shape) != 4:
            raise ValueError(f"Conv is 2-D: got input shape {shape}")
        _, c_in, h, w = shape
        c_out, c_per_group, kh, kw = p.weight.shape
        if c_in != c_per_group * p.group:
            raise ValueError(f"Conv input {shape} does not match weight {p.weight.shape} "
                             f"with group {p.group}")
        top, left, bottom, right = p.pads
        (sh, sw), (dh, dw) = p.strides, p.dilations
        out_hw = ((h + top + bottom - dh * (kh - 1) - 1) // sh + 1,
                  (w + left + right - dw * (kw - 1) - 1) // sw + 1)
        if min(out_hw) < 1:  # onnxruntime refuses it too ("Invalid input shape")
            raise ValueError(f"Conv input {list(shape)} is smaller than its {kh}x{kw} kernel (dilations "
                             f"{dh}x{dw}, pads {list(p.pads)}): no output")
        weight = p.weight.astype(np.float32)
        # one input channel, strided (an STFT as a Conv: Silero's 258 outputs of 256 taps, stride
        # 128): one im2col product beats a pass per tap
        single_strided = p.group == 1 and c_in == 1 and (sh, sw) != (1, 1)
        if c_per_group == 1 and not single_strided:
            taps = np.ascontiguousarray(weight.reshape(c_out, kh * kw).T)  # [tap, C_out]
            if (sh, sw) != (1, 1):
                method, weight = "depthwise", taps
            elif c_out >= CHANNELS_LAST_FROM:
                # each tap's weights repeated along a padded row: one product per row of W_p * C
                method, weight = "depthwise_rows_last", np.tile(taps, (1, left + w + right))
            else:
                method, weight = "depthwise_rows_first", taps[:, :, None]
        elif p.group == 1 and (kh, kw, sh, sw) == (1, 1, 1, 1) and not any(p.pads):
            method, weight = "pointwise", weight.reshape(c_out, c_in)
        elif p.group == 1 and (sh, sw) == (1, 1) and c_out < c_in:
            # kh*kw products of [C_out, C_in] weights, each on a shifted view of the input, cost
            # less than an im2col copy of kh*kw inputs when the output has fewer channels
            method, weight = "taps", weight.transpose(2, 3, 0, 1).copy()
        else:
            method = "im2col"
            per_group = c_out // p.group
            weight = weight.reshape(1, p.group, per_group, c_per_group * kh * kw)
        l1 = np.abs(p.weight.astype(np.int64)).reshape(c_out, -1).sum(axis=1)
        tails = {}
        for dtype, x_max in INPUT_MAX.items():
            if int(l1.max(initial=0)) * x_max >= FLOAT32_EXACT:
                continue
            column = Requant(p.requant.multiplier.reshape(-1, 1, 1), p.requant.rshift.reshape(-1, 1, 1))
            fused = offset_requant(p.bias.reshape(-1, 1, 1), column, zero_column(p.zero_out, 3), p.dtype,
                                   p.rounding, (l1 * x_max).reshape(-1, 1, 1))
            if fused is not None:
                tails[dtype] = Tail.of(fused)
        row_parts = parallel.ranges(out_hw[0], shape[0] * c_out * out_hw[0] * out_hw[1])
        return cls(p, tuple(shape), out_hw, method, weight, tails, row_parts)

    @functools.cached_property
    def band(self) -> int:
        """Output rows the numpy path computes at once (``BAND_BYTES``): the same sums in any
        bands, each row's from its own windows."""
        n, c_in = self.in_shape[:2]
        c_out, _, kh, kw = self.params.weight.shape
        per_row = c_out + (c_in * kh * kw if self.method == "im2col" else c_out if self.method == "taps" else 0)
        return max(1, BAND_BYTES // (4 * n * self.out_hw[1] * per_row))

    def numpy_bands(self, rows, start: int, stop: int):
        """``rows(lo, hi)`` over [start, stop) in bands of ``band`` rows: (lo, hi, its result)."""
        for lo in range(start, stop, self.band):
            hi = min(stop, lo + self.band)
            yield lo, hi, rows(lo, hi)

    @functools.cached_property
    def split16(self) -> "Tail | None":
        """For int16 inputs (made on the first one): the tail after ``split_sums``, proven for
        every int16 input; None where the halves are not proven exact. An int16 input is
        ``256 * hi + lo`` with ``hi`` int8 and ``lo`` uint8: each half's sums are exact in float32
        when the weights bound them (``|lo| <= 255``), and padding 0 is 0 in both."""
        p = self.params
        l1 = np.abs(p.weight.astype(np.int64)).reshape(p.weight.shape[0], -1).sum(axis=1)
        if p.zero_in != 0 or int(l1.max(initial=0)) * 255 >= FLOAT32_EXACT:
            return None
        column = Requant(p.requant.multiplier.reshape(-1, 1, 1), p.requant.rshift.reshape(-1, 1, 1))
        fused = offset_requant(p.bias.reshape(-1, 1, 1), column, zero_column(p.zero_out, 3), p.dtype,
                               p.rounding, (l1 * 32768).reshape(-1, 1, 1))
        return None if fused is None else Tail.of(fused)

    @functools.cached_property
    def depthwise16(self) -> np.ndarray | None:
        """For int16 inputs of a depthwise Conv: its weights as float64 [C_out, kh, kw] for the
        compiled one-pass kernel (``_run_depthwise16``), where numba is installed, the int16
        tail (``split16``) is compiled and proven for every output channel, and the output rows
        are wide enough for the kernel's inner loop (``DEPTHWISE_ROWS_FROM``); else None."""
        p, tail = self.params, self.split16
        if p.weight.shape[1] != 1 or p.group != self.in_shape[1] or self.out_hw[1] < DEPTHWISE_ROWS_FROM \
                or tail is None or tail.unproven.size \
                or not isinstance(tail.requant, compiled.CompiledRequant) or not compiled.available():
            return None
        return np.ascontiguousarray(p.weight[:, 0], dtype=np.float64)

    def engine(self, dtype: np.dtype) -> "ortconv.OrtConv | None":
        """onnxruntime's float32 Conv for inputs of ``dtype`` where float32 is proven exact for
        them (qtool/ops/ortconv.py), built on first use; None where the numpy path runs."""
        if dtype not in self.engines:
            self.engines[dtype] = None if dtype not in self.tails else \
                ortconv.build(self.params, self.in_shape, self.out_hw, dtype, self.numpy_rows)
        return self.engines[dtype]

    def split_engines(self) -> tuple["ortconv.OrtConv | None", "ortconv.OrtConv | None", np.ndarray]:
        """onnxruntime's engines for the two halves of an int16 input (``split_sums``), made on
        first use, and their ``extra``; the engines None where the numpy path runs."""
        if "split16" not in self.engines:
            high = ortconv.build(self.params, self.in_shape, self.out_hw, np.dtype(np.int8), self.numpy_rows)
            low = None if high is None else high.sharing(dataclasses.replace(self.params, zero_in=-128),
                                                          self.in_shape, self.out_hw)
            extra = 128 * self.params.weight.astype(np.int64).sum(axis=(1, 2, 3))
            self.engines["split16"] = high, low, extra
        return self.engines["split16"]

    def split_sums(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sums of an int16 input (zero point 0) in three parts: ``x = 256 * hi + lo`` with
        ``hi = x >> 8`` (int8) and ``lo`` its low byte, so its sums [n, C_out, out_h, out_w] are
        ``256 * high + low + extra`` (``extra`` int64 [C_out]), ``high`` and ``low`` float32 Convs
        proven exact (``split16``). onnxruntime's engine, where it checks out, runs both on one set
        of int8 sessions: ``lo - 128`` (an int8) padded with -128, and ``extra = 128 * sum(w)``."""
        high, low, extra = self.split_engines()
        if high is None:
            return (self.numpy_sums((x >> 8).astype(np.int8)), self.numpy_sums((x & 0xFF).astype(np.uint8)),
                    np.zeros_like(extra))
        return high(split_high(x)), low(split_low(x)), extra

    def numpy_rows(self, x: np.ndarray):
        """``rows(start, stop)``: the float32 sums of output rows [start, stop) of input ``x`` by
        the numpy path (``method``), its input prepared once."""
        prepare, accumulate = _FLOAT32[self.method]
        prepared = prepare(self, x)
        return lambda start, stop: np.array(accumulate(self, prepared, start, stop))

    def numpy_sums(self, x: np.ndarray) -> np.ndarray:
        """The float32 sums of the whole output by the numpy path, a band of rows at a time."""
        bands = [acc for _, _, acc in self.numpy_bands(self.numpy_rows(x), 0, self.out_hw[0])]
        return bands[0] if len(bands) == 1 else np.concatenate(bands, axis=2)


def split_high(x: np.ndarray) -> np.ndarray:
    """An int16 array's high bytes, ``x >> 8``, as int8."""
    return (x >> 8).astype(np.int8)


def split_low(x: np.ndarray) -> np.ndarray:
    """An int16 array's low bytes less 128, ``(x & 0xFF) - 128``, as int8 (the byte with its top
    bit flipped)."""
    return (x ^ 0x80).astype(np.int8)


@dataclass(frozen=True)
class Tail:
    """Conv's, ConvTranspose's and MatMul's requantization: one entry per output channel, shaped to
    broadcast against the kernel's accumulator."""

    requant: "OffsetRequant | compiled.CompiledRequant"
    unproven: np.ndarray  # output channels whose int32 accumulator must be scanned

    @classmethod
    def of(cls, fused: tuple[OffsetRequant, np.ndarray]) -> "Tail":
        """From ``offset_requant``'s result: compiled where numba is installed (ops/compiled.py)."""
        return cls(compiled.requantizer(fused[0]), fused[1])


def check_int32(acc: np.ndarray, bias: np.ndarray) -> None:
    """Raise ``OverflowError`` as ``requantize`` does if ``acc + bias`` leaves int32."""
    total = acc.astype(np.int64) + bias
    if total.size and (total.min() < INT32_MIN or total.max() > INT32_MAX):
        raise OverflowError("accumulator exceeds int32")


def _padded(x: np.ndarray, pads, fill: int, dtype=None) -> np.ndarray:
    """``x`` [n, C, H, W] padded with ``fill`` (in ``dtype``, default ``x``'s)."""
    top, left, bottom, right = pads
    n, c, h, w = x.shape
    if not any(pads):
        return x if dtype is None else x.astype(dtype)
    out = np.empty((n, c, top + h + bottom, left + w + right), dtype=dtype or x.dtype)
    _fill_border(out, pads, fill, axes=(2, 3))
    out[:, :, top:top + h, left:left + w] = x
    return out


def _fill_border(out: np.ndarray, pads, fill: int, axes) -> None:
    """Write ``fill`` around the interior of ``out`` that ``pads`` leaves along ``axes`` (rows, cols)."""
    top, left, bottom, right = pads
    rows, cols = axes
    height, width = out.shape[rows], out.shape[cols]

    def region(r, c):
        index = [slice(None)] * out.ndim
        index[rows], index[cols] = r, c
        return tuple(index)

    out[region(slice(0, top), slice(None))] = fill
    out[region(slice(height - bottom, height), slice(None))] = fill
    out[region(slice(top, height - bottom), slice(0, left))] = fill
    out[region(slice(top, height - bottom), slice(width - right, width))] = fill


# Depthwise taps run channels last from this many channels: each tap then multiplies rows of
# ``out_w * C`` contiguous values by the C weights, which numpy runs as long vector loops, where
# channels first broadcasts one weight over each short row of ``out_w`` values. Below it, the
# transposition costs more than it saves (measured on the PP-OCRv4 depthwise layers: 16 to 96
# channels faster first, 128 to 480 faster last).
CHANNELS_LAST_FROM = 128
# The compiled one-pass depthwise kernel for int16 inputs (``ConvPlan.depthwise16``) from this
# output width on; below it the per-tap loop set-up outweighs the row, and onnxruntime's depthwise
# kernel on the two byte halves was faster (PP-OCRv4 det at 320: its 5x5 convs on 10x10 maps took
# 0.31 ms that way and 1.06 ms in the kernel; on 20x20 maps 0.52 and 0.44 ms; rec's rows of 40 to
# 160 gained 1.2x to 3x, on a 2-core AMD EPYC with AVX-512 VNNI)
DEPTHWISE_ROWS_FROM = 16


def _flat_padded(x: np.ndarray, pads, fill: int, repeat: int, channels_last: bool) -> np.ndarray:
    """``x`` padded with ``fill`` and one more row at the bottom, in float32, each channel repeated
    ``repeat`` times, flattened row by row: [n, C, (H_p + 1) * W_p], or channels last
    [n, (H_p + 1) * W_p, C]. For stride 1, output row r of tap (i, j) reads padded row
    ``r + i * dh`` from column ``j * dw``: output rows ``[start, stop)`` of every tap are one
    contiguous run of ``(stop - start) * W_p`` pixels from ``(start + i * dh) * W_p + j * dw``,
    whose last row's overhang (columns past ``out_w``, dropped) the extra row keeps inside."""
    top, left, bottom, right = pads
    n, c, h, w = x.shape
    shape = (n, top + h + bottom + 1, left + w + right, c) if channels_last else \
        (n, c, top + h + bottom + 1, left + w + right)
    padded = np.empty(shape, dtype=np.float32)
    axes = (1, 2) if channels_last else (2, 3)
    _fill_border(padded, (top, left, bottom + 1, right), fill, axes)
    if channels_last:
        padded[:, top:top + h, left:left + w] = x.transpose(0, 2, 3, 1)
    else:
        padded[:, :, top:top + h, left:left + w] = x
    if repeat > 1:  # a channel multiplier: output channel o reads input channel o // repeat
        padded = np.repeat(padded, repeat, axis=3 if channels_last else 1)
    return padded.reshape(n, -1, c * repeat) if channels_last else padded.reshape(n, c * repeat, -1)


def _rows_of(plan: ConvPlan, sums: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Output rows [start, stop) of sums computed whole (by an ``ortconv`` engine)."""
    return sums[:, :, start:stop]


# Each method: prepare(plan, x) once, then accumulate(plan, prepared, start, stop) gives the float32
# sums of output rows [start, stop) as [n, C_out, stop - start, out_w] (possibly a view).

def _depthwise_rows_prepare(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    c_out = plan.params.weight.shape[0]
    return _flat_padded(x, plan.params.pads, plan.params.zero_in, c_out // x.shape[1],
                        plan.method == "depthwise_rows_last")


def _depthwise_rows(plan: ConvPlan, flat: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Stride 1, tap by tap on whole runs of padded rows (``_flat_padded``), so every product and
    sum is one long contiguous loop: channels first, one weight per channel row; channels last,
    rows of ``W_p * C`` values times the tap's weights repeated along a row (``plan.weight``)."""
    p = plan.params
    c_out, _, kh, kw = p.weight.shape
    (dh, dw), out_w = p.dilations, plan.out_hw[1]
    n, rows = flat.shape[0], stop - start
    width = p.pads[1] + plan.in_shape[3] + p.pads[3]
    run = rows * width
    last = plan.method == "depthwise_rows_last"
    acc = np.empty((n, rows, width * c_out) if last else (n, c_out, run), dtype=np.float32)
    product = np.empty_like(acc)
    for i in range(kh):
        for j in range(kw):
            first = (start + i * dh) * width + j * dw
            window = flat[:, first:first + run].reshape(acc.shape) if last else flat[:, :, first:first + run]
            if i == j == 0:
                np.multiply(window, plan.weight[0], out=acc)
            else:
                np.multiply(window, plan.weight[i * kw + j], out=product)
                acc += product
    if last:
        return acc.reshape(n, rows, width, c_out)[:, :, :out_w].transpose(0, 3, 1, 2)
    return acc.reshape(n, c_out, rows, width)[:, :, :, :out_w]


def _depthwise_strided_prepare(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    """Padded float32 input as [n, H_p, W_p, C_out] (channels repeated for a multiplier): channels
    last in memory from ``CHANNELS_LAST_FROM`` channels, else a view of channels first."""
    p = plan.params
    c_out = p.weight.shape[0]
    n, c, h, w = x.shape
    if c_out >= CHANNELS_LAST_FROM:
        top, left, bottom, right = p.pads
        padded = np.empty((n, top + h + bottom, left + w + right, c), dtype=np.float32)
        _fill_border(padded, p.pads, p.zero_in, axes=(1, 2))
        padded[:, top:top + h, left:left + w] = x.transpose(0, 2, 3, 1)
    else:
        padded = _padded(x, p.pads, p.zero_in, np.float32).transpose(0, 2, 3, 1)
    if c_out > c:  # a channel multiplier: output channel o reads input channel o // per_group
        padded = np.repeat(padded, c_out // c, axis=3)
    return padded


def _depthwise_strided(plan: ConvPlan, padded: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Tap by tap, in float32 (any stride), in the memory order of ``_depthwise_strided_prepare``."""
    p = plan.params
    c_out, _, kh, kw = p.weight.shape
    (sh, sw), (dh, dw), out_w = p.strides, p.dilations, plan.out_hw[1]
    n, rows = padded.shape[0], stop - start
    if c_out >= CHANNELS_LAST_FROM:
        acc = np.empty((n, rows, out_w, c_out), dtype=np.float32)
    else:
        acc = np.empty((n, c_out, rows, out_w), dtype=np.float32).transpose(0, 2, 3, 1)
    product = np.empty_like(acc)
    for i in range(kh):
        for j in range(kw):
            top = start * sh + i * dh
            window = padded[:, top:top + sh * (rows - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
            if i == j == 0:
                np.multiply(window, plan.weight[0], out=acc)
            else:
                np.multiply(window, plan.weight[i * kw + j], out=product)
                acc += product
    return acc.transpose(0, 3, 1, 2)


def _pointwise_prepare(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    n, c_in, h, w = x.shape
    return x.reshape(n, c_in, h * w)  # each range converts its own columns to float32


def _pointwise(plan: ConvPlan, x: np.ndarray, start: int, stop: int) -> np.ndarray:
    n, width = x.shape[0], plan.out_hw[1]
    acc = np.matmul(plan.weight, x[:, :, start * width:stop * width].astype(np.float32))
    return acc.reshape(n, -1, stop - start, width)


def _taps_prepare(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    return _flat_padded(x, plan.params.pads, plan.params.zero_in, 1, channels_last=False)


def _taps(plan: ConvPlan, flat: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Stride 1: as ``_depthwise_rows``, every tap is one product of its [C_out, C_in] weights with
    a contiguous run of the flattened padded input. Columns past ``out_w`` of each output row wrap
    around and are dropped (their sums are of the same weights times input values, inside the same
    float32 bound)."""
    p = plan.params
    kh, kw, c_out, _ = plan.weight.shape
    (dh, dw), out_w = p.dilations, plan.out_hw[1]
    n, rows = flat.shape[0], stop - start
    width = p.pads[1] + plan.in_shape[3] + p.pads[3]
    run = rows * width
    acc = np.empty((n, c_out, run), dtype=np.float32)
    product = np.empty_like(acc)
    for i in range(kh):
        for j in range(kw):
            first = (start + i * dh) * width + j * dw
            if i == j == 0:
                np.matmul(plan.weight[0, 0], flat[:, :, first:first + run], out=acc)
            else:
                np.matmul(plan.weight[i, j], flat[:, :, first:first + run], out=product)
                acc += product
    return acc.reshape(n, c_out, rows, width)[:, :, :, :out_w]


def _im2col_prepare(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    return _padded(x, plan.params.pads, plan.params.zero_in)  # each range takes its own patches


def _im2col_rows(plan: ConvPlan, padded: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The patches of output rows [start, stop), from padded rows ``start * sh`` on, in float32."""
    p = plan.params
    (sh, _), (dh, _) = p.strides, p.dilations
    _, group, _, k = plan.weight.shape
    kh, kw = p.weight.shape[2:]
    rows = padded[:, :, start * sh:(stop - 1) * sh + (kh - 1) * dh + 1]
    cols, out_h, out_w = _im2col(rows, kh, kw, p.strides, p.dilations, np.float32)
    acc = np.matmul(plan.weight, cols.reshape(padded.shape[0], group, k, out_h * out_w))
    return acc.reshape(padded.shape[0], -1, out_h, out_w)  # out_h == stop - start


_FLOAT32 = {"depthwise": (_depthwise_strided_prepare, _depthwise_strided),
            "depthwise_rows_first": (_depthwise_rows_prepare, _depthwise_rows),
            "depthwise_rows_last": (_depthwise_rows_prepare, _depthwise_rows),
            "pointwise": (_pointwise_prepare, _pointwise),
            "taps": (_taps_prepare, _taps),
            "im2col": (_im2col_prepare, _im2col_rows)}


def conv_accumulate(x: np.ndarray, weight: np.ndarray, group: int, strides, dilations):
    """``sum x * w`` over each window of the (already padded) integer ``x`` [n, C, H, W], exact:
    returns (int64 [n, C_out, out_h * out_w], out_h, out_w).

    Depthwise (one input channel per group) multiplies and adds tap by tap in int32, or int64
    when the sum could leave int32; every other conv is one batched ``int_matmul`` over the groups.
    """
    n = x.shape[0]
    c_out, c_per_group, kh, kw = weight.shape
    per_group = c_out // group
    if c_per_group == 1:
        return _depthwise(x, weight, per_group, strides, dilations)
    cols, out_h, out_w = _im2col(x, kh, kw, strides, dilations)  # [n, C, kh*kw, L]
    patch = cols.reshape(n, group, c_per_group * kh * kw, out_h * out_w)
    acc = int_matmul(weight.reshape(1, group, per_group, -1), patch)  # [n, group, per_group, L]
    return acc.reshape(n, c_out, out_h * out_w), out_h, out_w


def _depthwise(x: np.ndarray, weight: np.ndarray, per_group: int, strides, dilations):
    n, _, h, w = x.shape
    c_out, _, kh, kw = weight.shape
    sh, sw = strides
    dh, dw = dilations
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    bound = kh * kw * int(np.abs(x).max(initial=0)) * int(np.abs(weight).max(initial=0))
    dtype = np.int32 if bound <= INT32_MAX else np.int64
    if per_group > 1:  # a channel multiplier: output channel o reads input channel o // per_group
        x = np.repeat(x, per_group, axis=1)
    x = x.astype(dtype, copy=False)
    taps = weight.reshape(c_out, kh * kw).astype(dtype)[None, :, :, None, None]
    acc = np.zeros((n, c_out, out_h, out_w), dtype=dtype)
    for i in range(kh):
        for j in range(kw):
            window = x[:, :, i * dh:i * dh + sh * (out_h - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
            acc += taps[:, :, i * kw + j] * window
    return acc.reshape(n, c_out, out_h * out_w).astype(np.int64), out_h, out_w


def _im2col(x: np.ndarray, kh: int, kw: int, strides, dilations, dtype=None):
    """Patches of ``x`` [n, C, H, W] as [n, C, kh*kw, out_h*out_w] (a copy, in ``dtype``, default
    ``x``'s)."""
    n, c, h, w = x.shape
    sh, sw = strides
    dh, dw = dilations
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    cols = np.empty((n, c, kh * kw, out_h, out_w), dtype=dtype or x.dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i * kw + j] = x[:, :, i * dh:i * dh + sh * out_h:sh, j * dw:j * dw + sw * out_w:sw]
    return cols.reshape(n, c, kh * kw, out_h * out_w), out_h, out_w
