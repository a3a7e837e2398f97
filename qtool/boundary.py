"""QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear in every form ONNX defines, computed as
the operator specifications say: the forms the integer kernels do not take.

Those forms are
* sub-byte integer types (int4, uint4, int2, uint2) and the float8/float4 types, held in the
  ``ml_dtypes`` arrays that ``onnx.numpy_helper`` reads them into;
* blocked scales and zero points (``block_size``, opset 21: one scale per block of ``block_size``
  consecutive elements along ``axis``, the layout of 4-bit weights);
* scales and zero points computed at run time (``DynamicQuantizeLinear``, or its expanded form:
  a QuantizeLinear whose scale a few float ops derived from the tensor's range).

Each is a boundary between float and integer tensors, so each is float arithmetic by definition,
done here in the specification's order and types: ``x / scale`` in float32, round half to even,
add the zero point, saturate (QuantizeLinear); ``(x - zero point) * scale`` in float32, then the
output type (DequantizeLinear). Nothing here depends on the CPU: NaN and infinities are bounded
before any cast to an integer (a cast of NaN is undefined in C and differs between CPUs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .errors import QtoolError

# integer types ONNX quantizes to, with their ranges
INTEGER_RANGES = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127),
                  TensorProto.UINT16: (0, 65535), TensorProto.INT16: (-32768, 32767),
                  TensorProto.INT32: (-(2**31), 2**31 - 1)}
INTEGER_RANGES.update({getattr(TensorProto, name): bounds for name, bounds in (
    ("UINT4", (0, 15)), ("INT4", (-8, 7)), ("UINT2", (0, 3)), ("INT2", (-2, 1))) if hasattr(TensorProto, name)})
# float8 types: QuantizeLinear's ``saturate`` applies to them, and their zero point must be 0
FLOAT8 = {getattr(TensorProto, name) for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2",
                                                  "FLOAT8E5M2FNUZ") if hasattr(TensorProto, name)}
# narrower float types: the zero point is added as a float
FLOAT_NARROW = {getattr(TensorProto, name) for name in ("FLOAT4E2M1", "FLOAT6E2M3", "FLOAT6E3M2")
                if hasattr(TensorProto, name)}
# the types the plain integer kernels take (numpy's own): every other quantized type is a boundary
PLAIN_TYPES = ("int8", "uint8", "int16", "uint16", "int32")


def type_of(dtype) -> int:
    """The ONNX type of a numpy (or ml_dtypes) dtype."""
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def type_name(onnx_type: int) -> str:
    return TensorProto.DataType.Name(onnx_type).lower()


def numpy_native(dtype) -> bool:
    """A numpy type of its own (not one of ml_dtypes' 4-bit, float8 or float4 types)."""
    return np.dtype(dtype).kind in "biufcOSU" and np.dtype(dtype).name in np.sctypeDict


def is_plain(dtype) -> bool:
    """A numpy dtype (or its name as ``str(dtype)`` gives it) the integer kernels take. Compared by
    name: ``np.dtype("int4")`` is numpy's 4-byte integer, not ml_dtypes' 4-bit one."""
    try:
        return _plain(dtype)  # str() of a numpy dtype is slow, and lowering asks often: remembered
    except TypeError:  # unhashable: asked as it is
        return str(dtype) in PLAIN_TYPES


@functools.lru_cache(maxsize=None)
def _plain(dtype) -> bool:
    return str(dtype) in PLAIN_TYPES


@dataclass(frozen=True)
class Boundary:
    """One QuantizeLinear, DequantizeLinear or DynamicQuantizeLinear node, as ``run`` computes it."""

    op_type: str
    node: str  # its name, for messages
    axis: int = 1
    block_size: int = 0
    saturate: bool = True
    has_zero: bool = False  # the node has a zero point input
    output_type: int = 0  # QuantizeLinear's output_dtype / DequantizeLinear's output_dtype, 0 if unset
    precision: int = 0  # QuantizeLinear's precision (opset 23): the float type x / scale is computed in

    def run(self, *values: np.ndarray) -> list[np.ndarray]:
        if self.op_type == "DynamicQuantizeLinear":
            return dynamic_quantize(values[0], self.node)
        x, scale = values[0], np.asarray(values[1])
        zero = np.asarray(values[2]) if self.has_zero else None
        if self.op_type == "QuantizeLinear":
            return [self.quantize(np.asarray(x), scale, zero)]
        return [self.dequantize(np.asarray(x), scale, zero)]

    # -- the two formulas --------------------------------------------------------------------------
    def quantize(self, x: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
        target = self.output_type or (type_of(zero.dtype) if zero is not None else TensorProto.UINT8)
        if zero is not None and self.output_type and type_of(zero.dtype) != self.output_type:
            raise QtoolError(f"QuantizeLinear node '{self.node}': output_dtype {type_name(self.output_type)} "
                             f"differs from its zero point's type {type_name(type_of(zero.dtype))}")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(target)
        scale = self.spread(scale, x.shape, "scale")
        if self.precision:
            kind = onnx.helper.tensor_dtype_to_np_dtype(self.precision)
            x, scale = x.astype(kind), scale.astype(kind)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            r = x / scale
        if target in INTEGER_RANGES:
            lo, hi = INTEGER_RANGES[target]
            z = np.zeros((), np.int64) if zero is None else self.spread(zero, x.shape, "zero point").astype(np.int64)
            # bounded in float before the cast: beyond these every value saturates whatever Z is,
            # and NaN (undefined in ONNX) becomes the lowest value rather than what the CPU casts
            reach = float(hi - lo) + 1.0
            bounds = (float(lo) - float(np.max(z)) - reach, float(hi) - float(np.min(z)) + reach)
            r = np.fmin(np.fmax(np.asarray(r, dtype=np.float64), bounds[0]), bounds[1])
            return np.clip(np.rint(r).astype(np.int64) + z, lo, hi).astype(dtype)
        if target in FLOAT8:  # the zero point of a float8 type is 0 by definition
            return numpy_helper.saturate_cast(r, dtype) if self.saturate else np.asarray(r).astype(dtype)
        if target in FLOAT_NARROW:
            if zero is not None:
                r = r + self.spread(zero, x.shape, "zero point").astype(np.float32)
            return np.asarray(r).astype(dtype)
        raise QtoolError(f"QuantizeLinear node '{self.node}' quantizes to {type_name(target)}, "
                         f"which is not a quantized type")

    def dequantize(self, x: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
        kind = type_of(x.dtype)
        dx = x.astype(np.float32)
        if zero is not None and kind not in FLOAT8 and kind not in FLOAT_NARROW:
            if type_of(zero.dtype) != kind:
                raise QtoolError(f"DequantizeLinear node '{self.node}': input type {type_name(kind)} "
                                 f"differs from its zero point's type {type_name(type_of(zero.dtype))}")
            dx = dx - self.spread(zero, x.shape, "zero point").astype(np.float32)
        elif zero is not None and kind in FLOAT8 and np.any(zero.astype(np.float32) != 0):
            raise QtoolError(f"DequantizeLinear node '{self.node}': a float8 zero point must be 0")
        with np.errstate(over="ignore", invalid="ignore"):
            y = dx * self.spread(scale, x.shape, "scale")
        out = onnx.helper.tensor_dtype_to_np_dtype(self.output_type) if self.output_type else scale.dtype
        return y.astype(out)

    def spread(self, value: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
        """A scale or zero point made to broadcast against ``shape``: one value, one per slice along
        ``axis``, or one per block of ``block_size`` slices along it (the last block may be short)."""
        if value.size == 1 and (value.ndim <= 1 or not self.block_size):
            return value.reshape(())
        ndim = len(shape)
        axis = self.axis + ndim if self.axis < 0 else self.axis
        if not 0 <= axis < ndim:
            raise QtoolError(f"{self.op_type} node '{self.node}': axis {self.axis} is outside a "
                             f"{ndim}-D input")
        if not self.block_size:
            if value.ndim != 1 or value.size != shape[axis]:
                raise QtoolError(f"{self.op_type} node '{self.node}': a {what} of shape {list(value.shape)} "
                                 f"for an input of shape {list(shape)} along axis {axis}")
            dims = [1] * ndim
            dims[axis] = -1
            return value.reshape(dims)
        blocks = -(-shape[axis] // self.block_size)
        expected = list(shape)
        expected[axis] = blocks
        if list(value.shape) != expected:
            raise QtoolError(f"{self.op_type} node '{self.node}': a blocked {what} of shape "
                             f"{list(value.shape)} for an input of shape {list(shape)} (block {self.block_size} "
                             f"along axis {axis} needs {expected})")
        return np.repeat(value, self.block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)


def dynamic_quantize(x: np.ndarray, node: str) -> list[np.ndarray]:
    """DynamicQuantizeLinear: uint8 with the scale and zero point of the tensor's range widened to
    contain 0, in float32 as the specification writes it."""
    x = np.asarray(x)
    if x.size == 0:
        raise QtoolError(f"DynamicQuantizeLinear node '{node}' got an empty tensor: its range is undefined")
    top, bottom = np.float32(np.max(x)), np.float32(np.min(x))
    if not (np.isfinite(top) and np.isfinite(bottom)):
        raise QtoolError(f"DynamicQuantizeLinear node '{node}' got a tensor with NaN or infinity: "
                         f"its scale is undefined")
    hi, lo = np.float32(max(np.float32(0), top)), np.float32(min(np.float32(0), bottom))
    scale = np.float32(np.float32(1.0) if hi == lo else np.float32(hi - lo)) / np.float32(255)
    zero = np.float32(np.rint(np.clip(np.float32(0) - lo / scale, 0, 255)))
    r = np.rint(x.astype(np.float32) / scale) + zero  # within [lo, hi] / scale + zero: no overflow
    y = np.clip(r, 0, 255).astype(np.uint8)
    return [y, np.array(scale.astype(x.dtype)), np.array(zero.astype(np.uint8))]


def of(node: onnx.NodeProto) -> Boundary:
    """The node's ``Boundary``."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return Boundary(node.op_type, node.name, axis=int(attrs.get("axis", 1)),
                    block_size=int(attrs.get("block_size", 0)), saturate=bool(attrs.get("saturate", 1)),
                    has_zero=len(node.input) > 2 and bool(node.input[2]),
                    output_type=int(attrs.get("output_dtype", 0)), precision=int(attrs.get("precision", 0)))
