"""The integer parameters of a quantized model, as readable JSON for hardware back-ends.

They come from the integer executor's own lowering of the QDQ model, so they are exactly what
``qtool exec`` computes with: per integer op, the (S, Z) of its inputs and outputs and the kernel's
parameters (per-channel multiplier and rshift, zero-point-compensated int32 bias, lookup tables,
rounding mode). Weights are not repeated: they are the model's integer initializers, named here.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx

from .executor import IntegerExecutor
from .fixedpoint import Requant
from .ops import DUMPED_WHEN_SET_KEY, NOT_DUMPED_KEY, Unsupported, node_attrs
from .ops.lut import LutParams
from .qparams import QParams

PARAMS_FORMAT = "qtool-params/1"
PARAMS_KEY = "qtool.params"  # the model metadata entry that carries them
_SKIPPED = {"weight"}  # the integer weights stay in the model; and fields declared with ops.NOT_DUMPED


def _qparams(qp: QParams | None) -> dict | None:
    if qp is None:
        return None
    out = {"scale": _plain(np.asarray(qp.scale, np.float32)), "zero_point": _plain(qp.zero_point),
           "dtype": qp.dtype}
    if qp.axis is not None:
        out["axis"] = int(qp.axis)
    return out


def _plain(value):
    """JSON-ready: numpy scalars and arrays become Python numbers and lists."""
    if isinstance(value, Requant):
        return {"multiplier": _plain(value.multiplier), "rshift": _plain(value.rshift)}
    if isinstance(value, QParams):
        return _qparams(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name not in _SKIPPED and not f.metadata.get(NOT_DUMPED_KEY)
                and not (f.metadata.get(DUMPED_WHEN_SET_KEY) and getattr(value, f.name) is None)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return [float(v) for v in value.astype(np.float64).ravel()] if value.ndim else float(value)
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def integer_params(qmodel: onnx.ModelProto, executor: IntegerExecutor | None = None) -> dict:
    executor = executor or IntegerExecutor(qmodel)
    ops = []
    for step in executor.all_steps():  # inside If/Loop/Scan bodies too
        if step.kind != "integer":
            continue
        inputs = []
        for name in step.node.input:
            source = executor.producer.get(name)
            entry = {"tensor": name}
            if source is not None and source.op_type == "DequantizeLinear":
                entry["integer_tensor"] = source.input[0]
                try:
                    entry["qparams"] = _qparams(executor._qparams_of(source))
                except Unsupported:  # blocked (a MatMul's int4 weight): the scales per block
                    attrs = node_attrs(source)
                    entry["blocked"] = {"axis": attrs.get("axis", 1), "block_size": attrs.get("block_size", 0),
                                        "scale_tensor": source.input[1]}
            inputs.append(entry)
        ops.append({
            "node": step.node.name,
            "op_type": step.node.op_type,
            "inputs": inputs,
            "outputs": [{"tensor": key, "qparams": _qparams(qp)}
                        for key, qp in zip(step.keys, step.qparams)],
            "params": _plain(step.params),
        })
    return {"format": PARAMS_FORMAT, "rounding": executor.rounding,
            "multiplier_bits": executor.multiplier_bits, "ops": ops}


def lookup_tables(executor: IntegerExecutor) -> dict[str, dict[str, np.ndarray]]:
    """op_type -> node name -> 256-entry table, for every integer step whose kernel is a LUT."""
    luts: dict[str, dict[str, np.ndarray]] = {}
    for step in executor.all_steps():  # inside If/Loop/Scan bodies too
        if step.kind == "integer" and isinstance(step.params, LutParams) and step.params.table is not None:
            luts.setdefault(step.node.op_type, {})[step.node.name] = step.params.table
    return luts


def drop_params(qmodel: onnx.ModelProto) -> None:
    """In place: the model without its ``qtool.params`` entry (a model's size can double with it;
    ``model_params`` derives the same parameters again from the graph)."""
    kept = [p for p in qmodel.metadata_props if p.key != PARAMS_KEY]
    del qmodel.metadata_props[:]
    qmodel.metadata_props.extend(kept)


def model_params(qmodel: onnx.ModelProto) -> dict:
    """The parameters a quantized model carries (``qtool quantize`` embeds them), or, for a QDQ
    model without them, the executor's derivation."""
    for prop in qmodel.metadata_props:
        if prop.key == PARAMS_KEY:
            return json.loads(prop.value)
    return integer_params(qmodel)
