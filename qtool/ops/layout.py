"""Data-movement ops: Transpose, Squeeze, Unsqueeze, Slice, Split, Concat, Pad, SpaceToDepth and
DepthToSpace.

None of them computes: threshold propagation joins inputs and outputs into one (S, Z) group
(``shares_qparams``), so the integers move unchanged. Each still applies ``rescale`` in case the
(S, Z) differ (a tensor fenced elsewhere); Concat rescales every input to the output's (S, Z).

Pad in constant mode fills with the pad value quantized at the output's (S, Z) the way ONNX
QuantizeLinear does, ``q = sat(round_half_even(value / S_y) + Z_y)`` (DESIGN.md: ``round(value/S_y)
+ Z_y``; a value of 0 gives ``Z_y``, real zero). Edge, reflect and wrap only move data.

Axes, pads, starts/ends/steps and split sizes are ``Raw`` constant inputs (attributes before opset
13/11/10), read once by ``derive``; a non-constant one keeps the node float.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..qparams import QParams, quantize_array
from . import (IntegerOp, NodeView, Raw, Rescale, Unsupported, check_integer, per_tensor, register,
               rescale)


def raw_input(view: NodeView, index: int, what: str):
    """The value of raw constant input ``index``: None when absent (or empty), ``Unsupported`` when
    it is not a constant."""
    if index >= len(view.inputs) or view.inputs[index] is None:
        return None
    value = view.inputs[index].value
    if value is None:
        raise Unsupported(f"{what} (input {index}) must be a constant")
    return np.asarray(value)


def _ints(value) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in np.asarray(value).reshape(-1))


def _same(view: NodeView, what: str) -> Rescale:
    x = per_tensor(view.inputs[0].qparams, f"{what} input")
    y = per_tensor(view.output, f"{what} output")
    return rescale(x, y, view)


# -- Transpose, Squeeze, Unsqueeze ------------------------------------------------------------------

@dataclass(frozen=True)
class AxesParams:
    rescale: Rescale
    axes: tuple[int, ...] | None  # Transpose: perm (None reverses); Squeeze: None = every 1-dim


@register
class Transpose(IntegerOp):
    op_type = "Transpose"
    shares_qparams = True

    def derive(self, view: NodeView) -> AxesParams:
        perm = view.attr("perm")
        return AxesParams(_same(view, "Transpose"), None if perm is None else tuple(perm))

    def run(self, p: AxesParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(np.transpose(x, p.axes))


@dataclass(frozen=True)
class BlockParams:
    rescale: Rescale
    block: int
    crd: bool  # DepthToSpace mode CRD (else DCR, the default)


@register
class SpaceToDepth(IntegerOp):
    """[N, C, H, W] -> [N, C*b*b, H/b, W/b]: each b x b block of a channel becomes b*b channels."""

    op_type = "SpaceToDepth"
    shares_qparams = True

    def derive(self, view: NodeView) -> BlockParams:
        return BlockParams(_same(view, "SpaceToDepth"), int(view.attr("blocksize")), False)

    def run(self, p: BlockParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        n, c, h, w = x.shape
        b = p.block
        blocks = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
        return p.rescale(blocks.reshape(n, c * b * b, h // b, w // b))


@register
class DepthToSpace(IntegerOp):
    """[N, C*b*b, H, W] -> [N, C, H*b, W*b], the channels read as (b, b, C) (DCR) or (C, b, b) (CRD)."""

    op_type = "DepthToSpace"
    shares_qparams = True

    def derive(self, view: NodeView) -> BlockParams:
        mode = view.attr("mode", "DCR")
        if mode not in ("DCR", "CRD"):
            raise Unsupported(f"DepthToSpace mode '{mode}'")
        return BlockParams(_same(view, "DepthToSpace"), int(view.attr("blocksize")), mode == "CRD")

    def run(self, p: BlockParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        n, c, h, w = x.shape
        b = p.block
        if p.crd:
            moved = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        else:
            moved = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
        return p.rescale(moved.reshape(n, c // (b * b), h * b, w * b))


@register
class Squeeze(IntegerOp):
    op_type = "Squeeze"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw()}

    def derive(self, view: NodeView) -> AxesParams:
        axes = _ints(raw_input(view, 1, "Squeeze axes"))
        if axes is None and view.attr("axes") is not None:  # opset < 13
            axes = tuple(view.attr("axes"))
        return AxesParams(_same(view, "Squeeze"), axes)

    def run(self, p: AxesParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(np.squeeze(x, axis=p.axes))


@register
class Unsqueeze(IntegerOp):
    op_type = "Unsqueeze"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw()}

    def derive(self, view: NodeView) -> AxesParams:
        axes = _ints(raw_input(view, 1, "Unsqueeze axes"))
        if axes is None:
            axes = view.attr("axes")  # opset < 13
            if axes is None:
                raise Unsupported("Unsqueeze needs axes")
            axes = tuple(axes)
        return AxesParams(_same(view, "Unsqueeze"), axes)

    def run(self, p: AxesParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(np.expand_dims(x, p.axes))  # negative axes count from the output's rank


# -- Slice -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SliceParams:
    rescale: Rescale
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    axes: tuple[int, ...] | None  # None: 0 .. len(starts) - 1
    steps: tuple[int, ...] | None  # None: all 1

    def index(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """ONNX Slice clamping (negative values count from the end, out-of-range ones clamp)."""
        index = [slice(None)] * len(shape)
        axes = self.axes if self.axes is not None else range(len(self.starts))
        steps = self.steps if self.steps is not None else (1,) * len(self.starts)
        for axis, start, end, step in zip(axes, self.starts, self.ends, steps):
            axis = axis + len(shape) if axis < 0 else axis
            dim = shape[axis]
            start = start + dim if start < 0 else start
            end = end + dim if end < 0 else end
            if step > 0:
                start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            else:
                start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            index[axis] = slice(start, end if end >= 0 else None, step)
        return tuple(index)


@register
class Slice(IntegerOp):
    op_type = "Slice"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw(), 2: Raw(), 3: Raw(), 4: Raw()}

    def derive(self, view: NodeView) -> SliceParams:
        if len(view.node.input) == 1:  # opset < 10: attributes
            starts, ends = view.attr("starts"), view.attr("ends")
            axes, steps = view.attr("axes"), None
        else:
            starts = _ints(raw_input(view, 1, "Slice starts"))
            ends = _ints(raw_input(view, 2, "Slice ends"))
            axes = _ints(raw_input(view, 3, "Slice axes"))
            steps = _ints(raw_input(view, 4, "Slice steps"))
        if starts is None or ends is None:
            raise Unsupported("Slice needs starts and ends")
        if steps is not None and 0 in steps:
            raise Unsupported("Slice step 0")
        return SliceParams(_same(view, "Slice"), tuple(starts), tuple(ends),
                           None if axes is None else tuple(axes), steps)

    def run(self, p: SliceParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        return p.rescale(x[p.index(x.shape)])


# -- Split -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitParams:
    rescales: tuple[Rescale, ...]  # one per output
    axis: int
    sizes: tuple[int, ...] | None  # None: equal parts (the last may be smaller, as in opset 18)

    def bounds(self, dim: int) -> list[int]:
        sizes = self.sizes
        if sizes is None:
            n = len(self.rescales)
            chunk = -(-dim // n)
            sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
        if sum(sizes) != dim or min(sizes) < 0:
            raise ValueError(f"Split sizes {list(sizes)} do not cover a dimension of {dim}")
        return list(np.cumsum(sizes)[:-1])


@register
class Split(IntegerOp):
    op_type = "Split"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw()}

    def derive(self, view: NodeView) -> SplitParams:
        x = per_tensor(view.inputs[0].qparams, "Split input")
        outs = [per_tensor(y, "Split output") for y in view.outputs]
        sizes = _ints(raw_input(view, 1, "Split sizes"))
        if sizes is None and view.attr("split") is not None:  # opset < 13
            sizes = tuple(view.attr("split"))
        if sizes is not None and len(sizes) != len(outs):
            raise Unsupported("Split sizes and outputs differ in number")
        return SplitParams(tuple(rescale(x, y, view) for y in outs), view.attr("axis", 0), sizes)

    def run(self, p: SplitParams, x: np.ndarray) -> list[np.ndarray]:
        check_integer(x)
        axis = p.axis + x.ndim if p.axis < 0 else p.axis
        parts = np.split(x, p.bounds(x.shape[axis]), axis=axis)
        return [r(part) for r, part in zip(p.rescales, parts)]


# -- Concat ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConcatParams:
    rescales: tuple[Rescale, ...]  # one per input, to the output's (S, Z)
    axis: int


@register
class Concat(IntegerOp):
    op_type = "Concat"
    shares_qparams = True
    accepts_constants = True  # a constant input is quantized per tensor and rescaled like the rest

    def derive(self, view: NodeView) -> ConcatParams:
        y = per_tensor(view.output, "Concat output")
        rescales = []
        for i, operand in enumerate(view.inputs):
            if operand is None or operand.qparams is None:
                raise Unsupported(f"Concat input {i} is not quantized")
            rescales.append(rescale(per_tensor(operand.qparams, f"Concat input {i}"), y, view))
        return ConcatParams(tuple(rescales), view.attr("axis"))

    def run(self, p: ConcatParams, *xs: np.ndarray) -> np.ndarray:
        check_integer(*xs)
        return np.concatenate([r(x) for r, x in zip(p.rescales, xs)], axis=p.axis)


# -- Pad -------------------------------------------------------------------------------------------

PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


@dataclass(frozen=True)
class PadParams:
    rescale: Rescale
    pads: tuple[int, ...]  # begins then ends, one pair per axis in ``axes``
    axes: tuple[int, ...] | None  # None: every axis
    mode: str
    fill: int  # the pad value quantized at the output's (S, Z) (constant mode)

    def widths(self, ndim: int) -> list[tuple[int, int]]:
        axes = self.axes if self.axes is not None else range(ndim)
        n = len(self.pads) // 2
        if len(axes) != n:
            raise ValueError(f"Pad has {len(self.pads)} pads for {len(axes)} axes")
        width = [(0, 0)] * ndim
        for k, axis in enumerate(axes):
            width[axis + ndim if axis < 0 else axis] = (self.pads[k], self.pads[n + k])
        return width


@register
class Pad(IntegerOp):
    op_type = "Pad"
    shares_qparams = True

    def constants(self, node):
        return {1: Raw(), 2: Raw(), 3: Raw()}

    def check(self, node, attrs):
        mode = attrs.get("mode", b"constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode not in PAD_MODES:
            raise Unsupported(f"Pad mode {mode!r} is not supported")

    def derive(self, view: NodeView) -> PadParams:
        self.check(view.node, view.attrs)
        mode = view.attr("mode", "constant")
        x = per_tensor(view.inputs[0].qparams, "Pad input")
        y = per_tensor(view.output, "Pad output")
        if len(view.node.input) == 1:  # opset < 11: attributes
            pads, value, axes = _ints(view.attr("pads")), view.attr("value", 0.0), None
        else:
            pads = _ints(raw_input(view, 1, "Pad pads"))
            value = raw_input(view, 2, "Pad constant_value")
            axes = _ints(raw_input(view, 3, "Pad axes"))
        if pads is None:
            raise Unsupported("Pad needs pads")
        if mode != "constant" and min(pads, default=0) < 0:
            raise Unsupported(f"negative pads in {mode} mode are not supported")
        value = 0.0 if value is None else float(np.asarray(value).reshape(-1)[0])
        return PadParams(rescale(x, y, view), pads, axes, mode, pad_value(value, y))

    def run(self, p: PadParams, x: np.ndarray) -> np.ndarray:
        check_integer(x)
        x = p.rescale(x)
        width = p.widths(x.ndim)
        if any(b < 0 or e < 0 for b, e in width):  # negative pads crop (constant mode only)
            x = x[tuple(slice(max(-b, 0), x.shape[a] - max(-e, 0)) for a, (b, e) in enumerate(width))]
            width = [(max(b, 0), max(e, 0)) for b, e in width]
        if p.mode == "constant":
            return np.pad(x, width, mode="constant", constant_values=np.asarray(p.fill, x.dtype))
        return np.pad(x, width, mode=PAD_MODES[p.mode])


def pad_value(value: float, y: QParams) -> int:
    """``sat(round_half_even(value / S_y) + Z_y)``, bit for bit what QuantizeLinear gives."""
    return int(quantize_array(np.array(value, dtype=np.float32), y))
