"""``qtool quantize``: rewrite a float model as QDQ ONNX from a calibration table.

Nodes with an integer kernel (``qtool.ops.REGISTRY``) get DequantizeLinear on their inputs and
QuantizeLinear on their output; weights become int8 initializers (per output channel by default),
biases int32 at scale ``S_x * S_w``. Every other node stays float, fenced by the Q/DQ of its
neighbours, and is named in the report with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections import Counter, OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import __version__, boundary, control, masks
from .errors import QtoolError
from .executor import IntegerExecutor
from .fixedpoint import DEFAULT_ROUNDING, MULTIPLIER_BITS, ROUNDING_MODES
from .joins import find_joins
from .model import (FLOAT_TYPES, default_opset, file_digest, folded_note, stored_bytes, file_opset, float_tensors,
                    graph_inputs, initializers, names_read, prepare_file, upgrade, all_nodes)
from .ops import REGISTRY, Bias, Raw, Unsupported, Weight, node_attrs
from .ops.flat import SATURATING, readers_cut, saturation_window
from .data import PREPROCESS_KEY
from .params import PARAMS_KEY, integer_params, lookup_tables
from .pixels import PixelInput, fold, metadata as pixel_metadata
from .qoperator import to_qoperator
from .qparams import (MIN_THRESHOLD, RANGE_LIMIT, QParams, asymmetric, per_channel_activation,
                      per_channel_symmetric, quantize_array,
                      safe_range, symmetric)
from .table import Table, TensorEntry
from .targets import DEFAULT_TARGET, METADATA_KEY as TARGET_KEY, get_target
from .targets import x86
from .targets.form import guard_float_ops, to_unsigned

ACTIVATION_TYPES = ("int8", "uint8", "int16")
WEIGHT_TYPES = ("int8", "int4", "int16")
# the ops whose weights --weight-type int16 stores int16 (with int16 activations: 16x16 products,
# summed in 64 bits by the executor's exact paths)
WIDE_WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# int4 weights and blocked scales (DequantizeLinear's block_size) are standard ONNX from opset 21
BLOCKED_OPSET = 21
BLOCKED_OPS = ("MatMul", "Gemm")  # the ops whose constant B may be int4 / blocked
# int16 QuantizeLinear/DequantizeLinear are standard ONNX from opset 21; below it, onnxruntime's
# com.microsoft ops of the same name and signature carry them
INT16_OPSET = 21
MS_DOMAIN = "com.microsoft"
# at most this many values: an int16 Gather's table is stored int16 (_wide_tables); BERT-size word
# tables (30522 x up to 1024) are under it, a multilingual or LLM vocabulary stays int8
WIDE_TABLE_VALUES = 2**25
DEAD_CHANNEL = 1e-6  # a channel whose largest weight is under this part of its layer's largest: all but zero
FORMATS = ("qdq", "qoperator")
# Outputs whose range the op itself fixes. Softmax's calibrated maximum is below 1 on small data;
# onnxruntime fuses DQ -> Softmax -> Q into QLinearSoftmax, which outputs zeros when the output
# scale is below 1/256 (onnxruntime 1.31).
FIXED_OUTPUT_RANGE = {"Softmax": (0.0, 1.0)}
# the ops of a Log's front end that stays float (_log_front_ends): linear transforms, powers, shapes
FRONT_END_OPS = {"Conv", "MatMul", "Gemm", "Mul", "Add", "Sub", "Div", "Neg", "Abs", "Pow", "Sqrt", "ReduceSum",
                 "ReduceL2", "ReduceSumSquare", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Concat",
                 "Split", "Pad", "Flatten", "Identity", "Cast", "Shape", "Expand", "ConstantOfShape", "Constant"}
FRONT_END_POWERS = {"Pow", "Abs", "Sqrt", "ReduceL2", "ReduceSumSquare"}  # and a Mul of a tensor by itself
FRONT_END_FLOOR = 1e-3  # a Max or Clip is the front end's epsilon floor only below this constant
# a ReduceMean/ReduceSum over at least this many values an output is a normalization's statistic
# (a LayerNorm's row of 32 and more; a complex value's two parts are no statistic)
STATISTIC_FROM = 8
# an output's Concat whose parts' ranges differ more than this stays float with what follows it:
# one scale for both leaves the narrow part 1/JOIN_RATIO of the steps (YOLOv8: boxes 0-320 beside
# class scores 0-1 in one tensor, every score then 0 or one step)
JOIN_RATIO = 4.0
FLOAT_ONNX_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                    onnx.TensorProto.BFLOAT16}
_ONNX_INT = {"int8": onnx.TensorProto.INT8, "uint8": onnx.TensorProto.UINT8,
             "int16": onnx.TensorProto.INT16, "int32": onnx.TensorProto.INT32}


ACTIVATION_KEY = "qtool.activation_type"  # metadata: the options' activation type (int8, int16, ...)
WEIGHT_KEY = "qtool.weight_type"  # metadata: the options' weight type, where not int8
FLOAT_NODES_KEY = "qtool.float_nodes"  # metadata: node name -> why it runs float, as quantize reported it
DATA_STEPS_KEY = "qtool.data_steps"  # metadata: the judged steps of quantize --data that ran (qtool/recipe.py)
KEPT_FLOAT = "kept float (--keep-float)"  # the reason of an op QuantizeOptions.keep_float names
TABLE_FLOAT = "kept float (--precision-table)"  # ... that only the precision table names (table_float)


@dataclass(frozen=True)
class QuantizeOptions:
    per_channel: bool = True
    symmetric: bool = False
    activation_type: str = "int8"
    multiplier_bits: int = 32
    rounding: str = DEFAULT_ROUNDING
    keep_float: tuple[str, ...] = ()
    format: str = "qdq"
    strict: bool = False
    target: str = DEFAULT_TARGET  # qtool/targets: the form the model is written in
    input_pixels: PixelInput | None = None  # qtool/pixels.py: the model takes raw uint8 pixels
    # op types or node names whose activations (inputs and outputs) are int16 whatever
    # activation_type says (--precision-table; the search's promotions)
    int16: tuple[str, ...] = ()
    # the weights of MatMul/Gemm (BLOCKED_OPS): int4 (symmetric, -7..7) and/or in blocks of
    # ``block_size`` along K (0: one scale per output channel); other ops' weights stay int8
    weight_type: str = "int8"
    block_size: int = 0
    # the names of keep_float that only --precision-table gave (the reason recorded credits it)
    table_float: tuple[str, ...] = ()

    @property
    def blocked_weights(self) -> bool:
        """int4 and/or blocked MatMul/Gemm weights: standard ONNX from ``BLOCKED_OPSET``."""
        return self.weight_type == "int4" or self.block_size > 0

    def check(self) -> None:
        get_target(self.target)
        if self.input_pixels is not None:
            self.input_pixels.check()
        if self.format not in FORMATS:
            raise QtoolError(f"unknown format '{self.format}'; choose one of {', '.join(FORMATS)}")
        if self.activation_type not in ACTIVATION_TYPES:
            raise QtoolError(f"unknown activation type '{self.activation_type}'; "
                             f"choose one of {', '.join(ACTIVATION_TYPES)}")
        if (self.activation_type == "int16" or self.int16) and (self.format != "qdq"
                                                                or self.target != DEFAULT_TARGET):
            what = f"--format {self.format}" if self.format != "qdq" else f"--target {self.target}"
            more = f" and {len(self.int16) - 3} more" if len(self.int16) > 3 else ""
            source = ("--activation-type int16 is" if self.activation_type == "int16" else
                      f"the precision table's INT16 ({', '.join(self.int16[:3])}{more}) is")
            raise QtoolError(f"{source} written as QDQ for the {DEFAULT_TARGET} target "
                             f"(the QLinear ops and the x86 forms take 8-bit activations); drop {what}")
        if self.weight_type not in WEIGHT_TYPES:
            raise QtoolError(f"unknown weight type '{self.weight_type}'; choose one of {', '.join(WEIGHT_TYPES)}")
        if self.weight_type == "int16" and self.activation_type != "int16":
            raise QtoolError("--weight-type int16 goes with --activation-type int16 (16-bit weights on "
                             "16-bit activations); add it, or keep int8 weights")
        if self.weight_type == "int16" and self.block_size:
            raise QtoolError("--block-size is for int8 and int4 weights; int16 weights take one scale per channel")
        if self.block_size < 0 or self.block_size == 1:
            raise QtoolError(f"--block-size must be 0 (per channel) or at least 2, got {self.block_size}")
        if self.blocked_weights and (self.format != "qdq" or self.target != DEFAULT_TARGET):
            what = f"--format {self.format}" if self.format != "qdq" else f"--target {self.target}"
            raise QtoolError(f"int4 and blocked weights are written as QDQ (DequantizeLinear with "
                             f"block_size, opset {BLOCKED_OPSET}) for the {DEFAULT_TARGET} target; drop {what}")
        if self.multiplier_bits not in MULTIPLIER_BITS:
            raise QtoolError(f"--multiplier-bits must be one of {', '.join(map(str, MULTIPLIER_BITS))}, "
                             f"got {self.multiplier_bits}")
        if self.rounding not in ROUNDING_MODES:
            raise QtoolError(f"unknown rounding mode '{self.rounding}'; "
                             f"choose one of {', '.join(ROUNDING_MODES)}")


@dataclass
class QuantizeReport:
    quantized: dict[str, int] = field(default_factory=dict)  # op_type -> count
    kept_float: list[tuple[str, str, str]] = field(default_factory=list)  # op_type, node, why
    widened: list[str] = field(default_factory=list)  # tensors whose range was too narrow
    warnings: list[str] = field(default_factory=list)
    opset: int = 0
    size_before: int = 0
    size_after: int = 0
    format: str = "qdq"
    # QOperator only: integer groups with no quantized-operator form, left as DQ -> op -> Q
    qdq_groups: list[tuple[str, str]] = field(default_factory=list)
    bias_correction: dict | None = None  # qtool.bias_correction's summary, when it ran
    search: dict | None = None  # qtool.search's result, when it ran
    method_choice: dict | None = None  # qtool.search.choose_methods's summary, when it ran
    method_pick: dict | None = None  # qtool.search.choose_method's summary, when it ran
    placement: dict | None = None  # qtool.placement's summary, when it ran
    rounding: dict | None = None  # qtool.rounding's summary, when it ran
    channels: dict | None = None  # qtool.channels's summary, when it ran
    # activations written with one (S, Z) per channel (qtool.channels)
    channel_scales: list[str] = field(default_factory=list)
    target: str = DEFAULT_TARGET
    # layers whose u8 x s8 pairs can saturate in onnxruntime without VNNI (qtool/targets/x86.py)
    hazards: list[dict] = field(default_factory=list)
    # float-kept ops whose input was routed through an identity so that onnxruntime keeps their
    # float weights (targets.form.guard_float_ops)
    guarded: list[str] = field(default_factory=list)
    # activations that share (S, Z), their range the union of the members' (not in to_dict)
    qparam_groups: list[list[str]] = field(default_factory=list)
    # Softmax nodes that read scores plus an attention mask (qtool/masks.py): softmax -> mask tensor
    masked: dict[str, str] = field(default_factory=dict)
    # MatMul/Gemm weights written int4 or blocked: {"type", "block_size", "weights": count}
    blocked: dict | None = None
    # per If/Loop/Scan body: {"node", "body", "integer", "float"} (ops of the body itself)
    bodies: list[dict] = field(default_factory=list)
    # integer ops given int16 activations beside 8-bit ones (QuantizeOptions.int16): (op_type, node)
    int16: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"format": self.format, "quantized": self.quantized,
               "kept_float": [{"op_type": t, "node": n, "reason": r} for t, n, r in self.kept_float],
               "widened_ranges": self.widened, "warnings": self.warnings, "opset": self.opset,
               "size_before": self.size_before, "size_after": self.size_after,
               "target": self.target, "saturation_hazards": self.hazards,
               "float_weights_guarded": self.guarded, "masked_softmax": self.masked}
        if self.blocked is not None:
            out["blocked_weights"] = self.blocked
        if self.int16:
            out["int16"] = [{"op_type": t, "node": n} for t, n in self.int16]
        if self.bodies:
            out["bodies"] = self.bodies
        if self.bias_correction is not None:
            out["bias_correction"] = self.bias_correction
        if self.search is not None:
            out["search"] = self.search
        if self.method_choice is not None:
            out["method_choice"] = self.method_choice
        if self.method_pick is not None:
            out["method_pick"] = self.method_pick
        if self.placement is not None:
            out["placement"] = self.placement
        if self.rounding is not None:
            out["weight_rounding"] = self.rounding
        if self.channels is not None:
            out["channel_scales_step"] = self.channels
        if self.channel_scales:
            out["channel_scales"] = self.channel_scales
        if self.format == "qoperator":
            out["qdq_groups"] = [{"op_type": t, "node": n} for t, n in self.qdq_groups]
        return out


# The judged steps of quantize --data each build the model they start from (on PP-OCRv4 rec the
# channel scales, the placement and the rounding built the same candidate, 0.19 s each). Inside
# ``keeping_candidates()`` scored-only builds are kept by the content of their arguments and
# handed out as copies: the same arguments give the same bytes. KEPT_CANDIDATES of them at most
# (a ViT-S's or MiniLM's QDQ model holds about 25 MB); a candidate asked for again is kept before
# one that was not, then the last built.
_CANDIDATES: OrderedDict | None = None  # key -> [model, report, times asked for again]
KEPT_CANDIDATES = 2
# and, for the same duration, each weight's nearest integers, by the model it comes from (its
# file's digest, the pixel folding, the opset: ``_Rewriter.source``), its name and its (S, Z):
# every build rounded all of rec's 2.7 million weights again, twice (27 ms a build)
_INTEGERS: OrderedDict | None = None
KEPT_INTEGER_BYTES = 64 << 20


@contextmanager
def keeping_candidates():
    """Scored-only builds inside are kept (see above) until the outermost use ends."""
    global _CANDIDATES, _INTEGERS
    if _CANDIDATES is not None:
        yield
        return
    _CANDIDATES, _INTEGERS = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        _CANDIDATES = _INTEGERS = None


def _nearest_integers(source: tuple | None, name: str, x: np.ndarray, qp: QParams) -> np.ndarray:
    """``quantize_array(x, qp)`` for weight ``name`` of the model ``source`` identifies (its
    file's digest and whatever changes its weights before quantization), kept inside
    ``keeping_candidates()`` (a read-only array)."""
    if _INTEGERS is None or source is None:
        return quantize_array(x, qp)
    key = (source, name, x.shape, qp.dtype, qp.axis, np.asarray(qp.scale, np.float32).tobytes(),
           np.asarray(qp.zero_point, np.int64).tobytes())
    if key in _INTEGERS:
        _INTEGERS.move_to_end(key)
        return _INTEGERS[key]
    q = np.asarray(quantize_array(x, qp))
    q.flags.writeable = False
    _INTEGERS[key] = q
    held = sum(a.nbytes for a in _INTEGERS.values())
    while held > KEPT_INTEGER_BYTES and len(_INTEGERS) > 1:
        held -= _INTEGERS.popitem(last=False)[1].nbytes
    return q


def _content_key(*values) -> bytes:
    """A digest of ``values`` by content: arrays by type, shape and bytes; dicts by sorted keys;
    dataclasses by type and fields; anything else by ``repr`` (exact for floats)."""
    h = hashlib.sha256()

    def add(v) -> None:
        if isinstance(v, (np.ndarray, np.generic)):
            a = np.ascontiguousarray(v)
            h.update(f"<a {a.dtype.str} {a.shape}>".encode())
            h.update(a.tobytes())
        elif isinstance(v, dict):
            h.update(f"<d {len(v)}>".encode())
            for k in sorted(v, key=repr):
                add(k)
                add(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"<l {type(v).__name__} {len(v)}>".encode())
            for item in v:
                add(item)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            h.update(f"<c {type(v).__qualname__}>".encode())
            for f in dataclasses.fields(v):
                add(getattr(v, f.name))
        else:
            text = repr(v).encode()
            h.update(f"<r {len(text)}>".encode())
            h.update(text)

    for value in values:
        add(value)
    return h.digest()


def quantize(model_path: str | Path, table: Table, options: QuantizeOptions = QuantizeOptions(),
             table_name: str = "table", bias_corrections: dict[str, np.ndarray] | None = None,
             rounded_weights: dict | None = None, channel_ranges: dict | None = None,
             scored_only: bool = False) -> tuple[onnx.ModelProto, QuantizeReport]:
    """``bias_corrections``: node name -> float shift added to its bias before quantization (see
    qtool.bias_correction); a named Conv or ConvTranspose without a bias gets one.
    ``rounded_weights``: weight name -> ``qtool.rounding.Rounded``, integers fitted on the scales
    quantize gives the weight (used where those scales are the ones it gets).
    ``channel_ranges``: tensor -> (min, max) per channel (axis 1), for the 8-bit activations
    ``qtool.channels`` found that may take one (S, Z) per channel: each channel's range within the
    table's range for the tensor.
    ``scored_only``: the model is a candidate a judged step only runs in onnxruntime to score
    (QDQ): the executor's lowering, and what it gives (the float-op list, the hazards, the integer
    parameters), and onnx's checker (the model written is checked) are left out. They change no
    node of the graph, so the score is the same. Inside ``keeping_candidates()`` a scored-only
    build asked for again is a copy of the first."""
    options.check()
    key = None
    if scored_only and _CANDIDATES is not None:
        key = _content_key(str(model_path), file_digest(model_path), table, options, table_name,
                           bias_corrections, rounded_weights, channel_ranges)
        if key in _CANDIDATES:
            entry = _CANDIDATES[key]
            entry[2] += 1
            model = onnx.ModelProto()
            model.CopyFrom(entry[0])
            return model, copy.deepcopy(entry[1])
    model, report = _quantize(model_path, table, options, table_name, bias_corrections, rounded_weights,
                              channel_ranges, scored_only)
    if key is not None:
        while _CANDIDATES and len(_CANDIDATES) >= KEPT_CANDIDATES:
            unasked = [k for k, entry in _CANDIDATES.items() if not entry[2]]
            del _CANDIDATES[unasked[0] if unasked else next(iter(_CANDIDATES))]
        kept = onnx.ModelProto()
        kept.CopyFrom(model)
        _CANDIDATES[key] = [kept, copy.deepcopy(report), 0]
    return model, report


def _quantize(model_path, table: Table, options: QuantizeOptions, table_name: str, bias_corrections,
              rounded_weights, channel_ranges, scored_only: bool) -> tuple[onnx.ModelProto, QuantizeReport]:
    model = prepare_file(model_path)  # the file read, checked and prepared (kept when repeated)
    report = QuantizeReport(size_before=stored_bytes(model_path))
    digest = file_digest(model_path)
    if not table.model_sha256:  # TPU-MLIR, TensorRT and onnxruntime tables do not record one
        report.warnings.append(f"{'the table on standard input' if table_name == '-' else table_name} carries "
                               f"no model digest: it cannot be matched to "
                               f"model '{Path(model_path).name}' (make sure it was made for it)")
    made_for = None  # another model's, when the table records it
    if table.model_sha256 and table.model_sha256 != digest:
        made_for = (f"model '{table.model}' (sha256 {table.model_sha256[:12]}), not '{Path(model_path).name}' "
                    f"(sha256 {digest[:12]})")
        report.warnings.append(f"{table_name} was made for {made_for}")
    if options.blocked_weights and default_opset(model) < BLOCKED_OPSET:
        model = upgrade(model, BLOCKED_OPSET, f"model file '{model_path}'",
                        "int4 and blocked weights are standard ONNX from there")
    report.opset = default_opset(model)
    written = file_opset(model_path)
    if written < report.opset:
        why = " (int4 and blocked weights need it)" if report.opset == BLOCKED_OPSET and options.blocked_weights else ""
        report.warnings.append(f"opset upgraded from {written} to {report.opset}{why}")
    report.warnings += _not_followed_by_onnxruntime(options)
    if options.block_size and not options.per_channel:
        report.warnings.append(f"--per-tensor applies to the other ops' weights: MatMul/Gemm weights keep "
                               f"a scale per block of {options.block_size} (--block-size)")
    pixels = None
    if options.input_pixels is not None:
        pixels = fold(model, options.input_pixels, table.tensors)  # (input name, zero point)
    corrections = dict(bias_corrections or {})
    _add_zero_biases(model, corrections)
    if options.format != "qdq" or options.target != DEFAULT_TARGET:
        channel_ranges = None  # QLinearConv and the x86 forms take one scale a tensor (qtool.channels)
    rewriter = _Rewriter(model, table, options, report, table_name, corrections, pixels,
                         rounded_weights or {}, channel_ranges=channel_ranges or {}, made_for=made_for)
    # the weights are the prepared file's, but for the pixel folding (and a bias zero added)
    rewriter.source = (digest, repr(options.input_pixels), report.opset)
    rewriter.model_path = model_path
    rewritten = rewriter.run()
    if get_target(options.target).unsigned:
        to_unsigned(rewritten)
    report.guarded = report.guarded + guard_float_ops(rewritten)  # the bodies were guarded as rewritten
    meta = {"qtool.version": __version__, "qtool.rounding": options.rounding,
            "qtool.multiplier_bits": str(options.multiplier_bits), "qtool.source_sha256": digest,
            TARGET_KEY: options.target, ACTIVATION_KEY: options.activation_type}
    if options.weight_type != "int8":
        meta[WEIGHT_KEY] = options.weight_type
    if table.preprocess:  # how the calibration images became tensors: verify and exec reuse it
        meta[PREPROCESS_KEY] = json.dumps(table.preprocess, sort_keys=True)
    for key, value in meta.items():
        rewritten.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    if pixels is not None:
        rewritten.metadata_props.append(pixel_metadata(pixels[0], options.input_pixels, pixels[1]))
    report.format = options.format
    if scored_only and options.format == "qdq":
        return rewritten, report  # onnx's checker reads the model written; onnxruntime loads this one
    _check(rewritten)
    # the executor's lowering is the judge of what runs integer, and the source of the parameters
    executor = IntegerExecutor(rewritten)
    _reconcile(report, executor)
    if options.activation_type != "int16":
        report.int16 = [(step.node.op_type, step.node.name) for step in executor.all_steps() if step.kind == "integer"
                        and any(qp is not None and qp.dtype == "int16" for qp in step.qparams)]
    record_float_nodes(rewritten, report.kept_float)
    if options.format != "qoperator":
        _list_hazards(report, executor, options.target)
    if options.strict:
        _enforce_strict(report, options, _shape_arithmetic(rewritten))
    params = integer_params(rewritten, executor)
    rewritten.metadata_props.append(onnx.StringStringEntryProto(
        key=PARAMS_KEY, value=json.dumps(params, separators=(",", ":"))))
    if options.format == "qoperator":
        converted = to_qoperator(rewritten, lookup_tables(executor))
        rewritten = converted.model
        report.qdq_groups = converted.unchanged
        _check(rewritten)
        # the hazards of what is written: a QLinearConv of int8 activations runs s8 x s8, exact
        # (the QDQ form it came from moves them to uint8 and pairs u8 x s8: "5 of 5 can saturate")
        _list_hazards(report, IntegerExecutor(rewritten), options.target)
    report.size_after = rewritten.ByteSize()
    return rewritten, report


def _other_byte_type(dtype: str) -> str:
    return "uint8" if dtype == "int8" else "int8"


def per_output(activation_scale, channels: int) -> np.ndarray:
    """An input's scale per output channel: one for all, or for an input quantized per channel
    (into a depthwise Conv) input channel ``c``'s for the ``channels / C`` outputs that read it."""
    scale = np.asarray(activation_scale, np.float64)
    if scale.ndim == 0 or scale.size == 1:
        return scale.reshape(())
    return np.repeat(scale.reshape(-1), channels // scale.size)


def _add_zero_biases(model: onnx.ModelProto, nodes) -> None:
    """A zero bias input on each Conv and ConvTranspose named in ``nodes`` that has none, so that
    bias correction has an int32 bias to shift."""
    inits = {i.name: i for i in model.graph.initializer}
    taken = set(inits) | {o for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name not in nodes or node.op_type not in ("Conv", "ConvTranspose"):
            continue
        if len(node.input) > 2 and node.input[2]:
            continue
        weight = inits.get(node.input[1])
        if weight is None:
            continue
        shape = list(weight.dims)
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        channels = shape[0] if node.op_type == "Conv" else shape[1] * group
        name, k = f"{node.name}_bias", 1
        while name in taken:
            name, k = f"{node.name}_bias_{k}", k + 1
        taken.add(name)
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(channels, np.float32), name))
        if len(node.input) == 2:
            node.input.append(name)
        else:
            node.input[2] = name


def _check(model: onnx.ModelProto) -> None:
    """onnx's full check of a model quantize writes; in place, outputs the model declares with
    shapes it does not compute (plcmos_v2 declares a scalar and makes [3]: onnxruntime warns and
    runs it, onnx's inference refuses the DequantizeLinear before it) are declared as inferred."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.shape_inference.InferenceError:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        for output in probe.graph.output:
            output.ClearField("type")
        try:
            inferred = {o.name: o.type for o in onnx.shape_inference.infer_shapes(probe).graph.output}
        except onnx.shape_inference.InferenceError as e:
            raise RuntimeError(f"quantized model fails the ONNX checker: {e}") from e
        for output in model.graph.output:  # as inferred, where inference tells
            if output.name in inferred and inferred[output.name].tensor_type.HasField("shape"):
                output.type.CopyFrom(inferred[output.name])
        _check_strictly(model)
    except onnx.checker.ValidationError as e:  # a bug in the rewriter, not a user error
        raise RuntimeError(f"quantized model fails the ONNX checker: {e}") from e


def _check_strictly(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:  # a bug in the rewriter
        raise RuntimeError(f"quantized model fails the ONNX checker: {e}") from e


def record_float_nodes(model: onnx.ModelProto, kept_float: list[tuple[str, str, str]]) -> None:
    """In place: the float list quantize reports, with its reasons, in the model's metadata
    (``qtool.float_nodes``), for verify to show the same; replaces an earlier record."""
    kept = [p for p in model.metadata_props if p.key != FLOAT_NODES_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.append(onnx.StringStringEntryProto(
        key=FLOAT_NODES_KEY, value=json.dumps({n: r for _, n, r in kept_float}, separators=(",", ":"))))


def _not_followed_by_onnxruntime(options: QuantizeOptions) -> list[str]:
    """Warnings for the integer arithmetic options whose effect onnxruntime does not reproduce: it
    requantizes with the float scales, rounding half to even, whatever the model records. Where
    that makes a difference of more than a tie now and then."""
    said = []
    how = "it requantizes with the float scales, rounding half to even"
    if options.multiplier_bits == 8 and (options.activation_type == "int16" or options.int16):
        said.append(f"onnxruntime does not follow --multiplier-bits 8 ({how}): on int16 activations its "
                    f"results differ from qtool exec's and verify's (an integer device's) by up to about 1% "
                    f"of a tensor's range, hundreds of steps")
    if options.rounding == "toward_zero":
        said.append(f"onnxruntime does not follow --rounding toward_zero ({how}): its results differ from qtool "
                    f"exec's and verify's (an integer device's) by about half a step at every op")
    return said


def _reconcile(report: QuantizeReport, executor: IntegerExecutor) -> None:
    """The float list is what the executor runs in float, the one verify shows: nodes the rewriter
    quantized but whose kernel refused the derived parameters are counted float, and nodes the
    rewriter left float that no longer run (shape arithmetic on fixed shapes, folded) are not
    listed. A node keeps the rewriter's reason where it gave one."""
    mine = {(t, n): r for t, n, r in report.kept_float}
    running = executor.float_nodes()
    for op_type, name, reason in running:
        if op_type in report.quantized and (op_type, name) not in mine:
            report.quantized[op_type] -= 1
    report.quantized = {t: n for t, n in report.quantized.items() if n}
    report.kept_float = [(t, n, mine.get((t, n), r)) for t, n, r in running]


def _list_hazards(report: QuantizeReport, executor: IntegerExecutor, target: str) -> None:
    report.target = target
    report.hazards = [h.to_dict() for h in x86.hazards(executor)]
    if not report.hazards:
        return
    layers = sum(report.quantized.get(t, 0) for t in ("Conv", "Gemm", "MatMul"))
    report.warnings.append(f"target {target}: {x86.hazard_summary(report.hazards, layers)}")


def _shape_arithmetic(model: onnx.ModelProto) -> set[str]:
    """The main graph's nodes that compute on shapes, not values: Shape and Size (they read a
    tensor's dims only), and nodes whose every input and output is an integer or boolean tensor (a
    Gather, Concat or Cast of shapes; not a Cast or Range to float). An integer-only device runs or
    folds them as they are."""
    graph = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info, *graph.output]
             if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in graph.initializer})
    known_integer = {n for n, t in types.items() if t not in FLOAT_TYPES | {TensorProto.UNDEFINED}}
    found = set()
    for node in graph.node:
        inputs, outputs = [n for n in node.input if n], [n for n in node.output if n]
        if not node.name or not all(o in known_integer for o in outputs):
            continue  # (a Cast or Range to float computes values)
        if node.op_type in ("Shape", "Size") or (inputs and all(n in known_integer for n in inputs)):
            found.add(node.name)
    return found


def _enforce_strict(report: QuantizeReport, options: QuantizeOptions, shapes: set[str] = frozenset()) -> None:
    """``--strict``: every op left float that --keep-float does not name fails, but shape
    arithmetic (``_shape_arithmetic``), which no quantization applies to."""
    asked = set(options.keep_float)
    blocking = [(t, n, r) for t, n, r in report.kept_float
                if t not in asked and n not in asked and n not in shapes]
    if blocking:
        listed = "; ".join(f"{t} '{n}' ({r})" for t, n, r in blocking[:10])
        more = f"; and {len(blocking) - 10} more" if len(blocking) > 10 else ""
        raise QtoolError(f"--strict: {len(blocking)} op(s) cannot run integer-only: {listed}{more}")


class _Rewriter:
    source: tuple | None = None  # what identifies the weights (_nearest_integers); None: not kept
    model_path = None  # the model file, for messages about names preparation folded away

    def __init__(self, model, table: Table, options: QuantizeOptions, report: QuantizeReport,
                 table_name: str, bias_corrections: dict[str, np.ndarray], pixels=None,
                 rounded_weights: dict | None = None, parent: "_Rewriter | None" = None,
                 channel_ranges: dict | None = None, made_for: str | None = None):
        """``parent``: the rewriter of the graph around ``model``, when ``model`` is the body of
        one of its If, Loop or Scan nodes (qtool/control.py's ``body_model``). ``made_for``: the
        other model the table was made for, if it records one (for messages)."""
        self.model, self.table, self.opt, self.report = model, table, options, report
        self.parent = parent
        self.made_for = parent.made_for if parent is not None else made_for
        self.bias_corrections = bias_corrections
        self.rounded = rounded_weights or {}
        self.channel_ranges = channel_ranges or {}
        self.pixels = pixels  # (input name, zero point) with --input-pixels
        self.table_name = table_name
        self.graph = model.graph
        self.inits = initializers(model)
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.outputs = {o.name for o in self.graph.output}
        self.producers = {o: node for node in self.graph.node for o in node.output}
        self.float_names = set(float_tensors(model))
        # names are unique across a graph and its bodies: a body's rewriter adds to its parent's
        self.taken = parent.taken if parent is not None else set()
        self.taken |= set(self.inits) | {n for node in all_nodes(self.graph) for n in node.output}
        self.taken |= {i.name for i in self.graph.input}
        self.nodes: list[onnx.NodeProto] = []
        self.new_inits: list[onnx.TensorProto] = []
        self.weight_cache: dict[tuple, str] = {}  # (weight, axis) -> DequantizeLinear output
        self.weight_qparams: dict[tuple, QParams] = {}
        self.wide_tables: set[str] = set()  # constants stored int16 (_wide_tables, _wide_operands, _wide_weights)
        self.masks = masks.find(model, self.inits)

    def run(self) -> onnx.ModelProto:
        integer = self._choose_nodes()
        self._keep_mixed_joins(integer)
        counts = Counter(node.op_type for node in self.graph.node if node.name in integer)
        self.report.quantized = dict(sorted(counts.items()))
        activations = self._activations(integer)
        qparams = self._activation_qparams(integer, activations)
        self.wide_tables = self._wide_tables(integer, qparams) | self._wide_operands(integer, qparams) | \
            self._wide_weights(integer)
        self._fit_biases(integer, qparams)
        dq_name = {}
        if self.pixels is not None:
            self._pixel_input(qparams, dq_name)
        for vi in graph_inputs(self.model):
            if vi.name in qparams and vi.name not in dq_name:
                dq_name[vi.name] = self._fence(vi.name, vi.name, qparams[vi.name])
        for node in self.graph.node:
            node = onnx.NodeProto.FromString(node.SerializeToString())
            op = integer.get(node.name)
            consts = self._specs(node, op) if op else {}
            original = list(node.input)
            for i, name in enumerate(original):
                spec = consts.get(i)
                if isinstance(spec, Weight) and self._blocked(node, spec):
                    node.input[i] = self._blocked_weight(name, spec)
                elif isinstance(spec, Weight):
                    node.input[i] = self._weight(name, spec)
                elif isinstance(spec, Bias) and name:
                    node.input[i] = self._bias(name, node, original, spec, qparams)
                elif name in dq_name:
                    node.input[i] = dq_name[name]
            if control.is_control(node):
                self._rewrite_bodies(node, dq_name)
            self.nodes.append(node)
            for out in node.output:
                if out in qparams:
                    produced = out
                    if out in self.outputs:  # the graph output name goes to the final DequantizeLinear
                        produced = self._fresh(f"{out}_float")
                        node.output[list(node.output).index(out)] = produced
                    dq_name[out] = self._fence(produced, out, qparams[out])
        return self._assemble()

    def _rewrite_bodies(self, node: onnx.NodeProto, dq_name: dict[str, str]) -> None:
        """In place: each body of an If, Loop or Scan ``node`` quantized as a graph of its own, its
        integer ops with their Q/DQ inside; an outer tensor it quantizes is read where this graph
        has it dequantized already. Its report joins this one."""
        types = {vi.name: vi.type for vi in [*self.graph.value_info, *self.graph.input, *self.graph.output]}
        for attr in node.attribute:
            if not attr.HasField("g"):
                continue
            graph = attr.g
            outer = [n for n in control.graph_outer_reads(graph) if n not in self.inits]
            body = control.body_model(graph, outer, self.model.opset_import, self.model.ir_version, types)
            body.graph.initializer.extend(control.to_initializers(control.constant_reads(graph, self.inits)))
            report = QuantizeReport()
            model = _Rewriter(body, self.table, self.opt, report, self.table_name, self.bias_corrections,
                              None, self.rounded, parent=self).run()
            if get_target(self.opt.target).unsigned:  # as quantize does the main graph
                to_unsigned(model)
            self.report.guarded.extend(guard_float_ops(model))
            rewritten = model.graph
            inputs = [onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in graph.input]
            del rewritten.input[:]
            rewritten.input.extend(inputs)  # as declared (body_model keeps their types only)
            kept = [t for t in rewritten.initializer if t.name not in self.inits]  # outer ones stay outer
            del rewritten.initializer[:]
            rewritten.initializer.extend(kept)
            renamed = {n: dq_name[n] for n in outer if n in dq_name}
            for inner in all_nodes(rewritten):
                for i, name in enumerate(inner.input):
                    if name in renamed:
                        inner.input[i] = renamed[name]
            rewritten.name = graph.name
            attr.g.CopyFrom(rewritten)
            self.report.bodies.append({"node": node.name, "body": attr.name,
                                       "integer": sum(report.quantized.values()) - sum(
                                           b["integer"] for b in report.bodies),
                                       "float": len(report.kept_float) - sum(b["float"] for b in report.bodies)})
            self.report.bodies.extend(report.bodies)
            for op_type, count in report.quantized.items():
                self.report.quantized[op_type] = self.report.quantized.get(op_type, 0) + count
            self.report.quantized = dict(sorted(self.report.quantized.items()))
            self.report.kept_float.extend(report.kept_float)
            self.report.widened.extend(report.widened)
            self.report.warnings.extend(report.warnings)
            self.report.masked.update(report.masked)
            if report.blocked is not None:
                mine = self.report.blocked or dict(report.blocked, weights=0)
                mine["weights"] += report.blocked["weights"]
                self.report.blocked = mine

    def _pixel_input(self, qparams: dict, dq_name: dict) -> None:
        """--input-pixels: the input is uint8 pixels, dequantized with the preprocessing's scale
        and the zero point the Conv layers were folded for (qtool/pixels.py): no QuantizeLinear."""
        name, zero = self.pixels
        readers = [n for n in self.graph.node if name in n.input]
        kept = {k for _, k, _ in self.report.kept_float}
        floats = [n for n in readers if name not in qparams or n.name in kept]
        if floats:
            why = next((r for t, k, r in self.report.kept_float if k == floats[0].name), "float")
            raise QtoolError(f"--input-pixels: {floats[0].op_type} '{floats[0].name}', which reads input "
                             f"'{name}', stays float ({why}); the pixels need an integer first layer")
        qp = QParams(float(np.float32(self.opt.input_pixels.scale)), zero, "uint8")
        qparams[name] = qp
        scale, zero_point = self._qp_inits(name, qp)
        out = self._fresh(f"{name}_dequantized")
        self.nodes.append(helper.make_node("DequantizeLinear", [name, scale, zero_point], [out],
                                           name=self._fresh(f"{name}_DequantizeLinear")))
        dq_name[name] = out

    # -- which nodes and tensors -------------------------------------------------------------------
    def _choose_nodes(self) -> dict:
        integer = {}
        keep = set(self.opt.keep_float)
        asked = keep - set(self.opt.table_float)  # by --keep-float
        known = {n.op_type for n in all_nodes(self.graph)} | {n.name for n in all_nodes(self.graph)}
        unknown = sorted(keep - known)
        if unknown and self.parent is None:  # a body's rewriter sees the names of its body only
            note = folded_note(unknown, self.model_path) if self.model_path is not None else ""
            raise QtoolError(f"--keep-float: {', '.join(repr(u) for u in unknown)} is neither an op type "
                             f"nor a node name of the prepared model (qtool analyze lists them){note}")
        layernorm = self._layernorm_variance_nodes()
        front_ends = self._log_front_ends()
        unbounded = set(self.table.unbounded)
        doubles = {vi.name for vi in [*self.graph.value_info, *self.graph.input, *self.graph.output]
                   if vi.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE}
        joins = self.masks.join_nodes
        counts = self._cast_to_integers()
        for node in self.graph.node:
            op = REGISTRY.get(node.op_type)
            reason = None
            if node.name in joins:  # the executor runs it with its Softmax (a masked Softmax)
                continue
            if node.op_type in keep or node.name in keep:
                reason = KEPT_FLOAT if {node.op_type, node.name} & asked else TABLE_FLOAT
            elif node.name in self.masks.arithmetic:
                reason = masks.REASON
            elif any(n in self.masks.tensors for n in node.input):  # never calibrated: not a Softmax's join
                held = next(n for n in node.input if n in self.masks.tensors)
                reason = (f"reads '{held}', a mask tensor (a huge negative constant, kept float and never "
                          f"calibrated)")
            elif any(n in doubles and n not in self.inits for n in (*node.input, *node.output)):
                wide = next(n for n in (*node.input, *node.output) if n in doubles)
                reason = f"'{wide}' is float64, which QuantizeLinear does not take"
            elif any(n in unbounded for n in (*node.input, *node.output)):
                held = next(n for n in (*node.input, *node.output) if n in unbounded)
                reason = (f"'{held}' held inf or NaN on the calibration data, or no element at all (no range "
                          f"to quantize it to)")
            elif node.name in layernorm:
                reason = "inside a LayerNormalization (float by default)"
            elif node.name in front_ends:
                reason = (f"in the front end of Log '{front_ends[node.name]}' (a log of linearly quantized values "
                          f"loses the small ones)")
            elif any(o in counts for o in node.output):
                reason = (f"its output is cast to {counts[next(o for o in node.output if o in counts)]} "
                          f"(a count or an index): quantized, it would be rounded")
            elif op is None:
                reason = None if control.is_control(node) else "no integer kernel for this op type"
                if reason is None:  # its bodies are rewritten on their own (_rewrite_bodies)
                    continue
            elif self.parent is not None and any(
                    n not in self.table.tensors for n in (*node.input, *node.output)
                    if n and n not in self.inits and n in self.float_names):
                reason = "not calibrated: the data never ran this branch or loop"
            else:
                try:
                    op.check(node, node_attrs(node))
                    reason = self._constants_reason(node, op)
                except Unsupported as e:
                    reason = str(e)
            if reason:
                self.report.kept_float.append((node.op_type, node.name, reason))
            else:
                integer[node.name] = op
        for join in self.masks.joins.values():
            if join.softmax in integer:
                self.report.masked[join.softmax] = join.mask
        return integer

    def _cast_to_integers(self) -> dict[str, str]:
        """Float tensors a Cast turns into integers or booleans (a decoder's step counter, a
        position it writes at), with the type: their values are whole numbers that must stay
        exact, so the op computing them stays float."""
        counts = {}
        for node in self.graph.node:
            to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
            if to is not None and to not in FLOAT_ONNX_TYPES and node.input[0] in self.float_names:
                counts[node.input[0]] = onnx.TensorProto.DataType.Name(to).lower()
        return counts

    def _keep_mixed_joins(self, integer: dict) -> None:
        """A graph output that concatenates parts of very different ranges (qtool/joins.py) keeps
        its Concats (a nested join's too) and the ops between them and the output float: each
        part is dequantized with its own scale."""
        for join in find_joins(self.model).values():
            parts = join.parts()
            if join.node not in integer or any(n not in self.table.tensors for n in parts):
                continue
            ranges = [(self.table.tensors[n].min, self.table.tensors[n].max) for n in parts]
            widths = [hi - lo for lo, hi in ranges]
            if min(widths) <= 0 or max(widths) / min(widths) <= JOIN_RATIO:
                continue
            shown = ", ".join(f"'{n}' [{lo:.3g}, {hi:.3g}]" for n, (lo, hi) in zip(parts, ranges))
            reason = (f"joins ranges {max(widths) / min(widths):.0f}x apart into output '{join.output}' "
                      f"({shown}): float, so each part keeps its own scale")
            for name, op_type in join.nodes():
                if integer.pop(name, None) is not None:
                    self.report.kept_float.append((op_type, name, reason if name == join.node else
                                                   f"part of the join at Concat '{join.node}', which joins ranges "
                                                   f"{max(widths) / min(widths):.0f}x apart"))

    def _log_front_ends(self) -> dict[str, str]:
        """node -> Log node, for the nodes that compute nothing but a float Log's input from the
        model's inputs with linear, power and shape ops (``FRONT_END_OPS``: an STFT or constant-Q
        transform as a Conv, its power (at least one: ``FRONT_END_POWERS``), an epsilon added or
        as a floor), every output read within (or by a Shape). Such a
        log spectrum spans a range no 8- or 16-bit linear grid holds: the small powers round to
        0 and their logs to log(eps) (speechmos's DNSMOS: -6.5 dB after the Log at int8, 6.4 dB
        at its output even at int16; basic-pitch likewise), where a float front end costs a
        spectrum's worth of compute. A front end with any other op is a network: quantized."""
        inits = set(self.inits)
        found: dict[str, str] = {}
        for log in self.graph.node:
            if log.op_type != "Log" or REGISTRY.get("Log") is not None or not log.input[0]:
                continue
            ancestors: dict[str, onnx.NodeProto] = {}
            todo = [log.input[0]]
            while todo:
                node = self.producers.get(todo.pop())
                if node is None or node.name in ancestors:
                    continue
                ancestors[node.name] = node
                todo += [i for i in node.input if i and i not in inits]
            within = set(ancestors) | {log.name}
            if ancestors and all(n.op_type in FRONT_END_OPS or self._epsilon_floor(n) for n in ancestors.values()) \
                    and any(n.op_type in FRONT_END_POWERS or (n.op_type == "Mul" and n.input[0] == n.input[1])
                            for n in ancestors.values()) and all(
                    u.name in within or u.op_type in ("Shape", "Size")  # sizes only, not values
                    for n in ancestors.values() for o in n.output for u in self.consumers.get(o, [])) \
                    and not any(o in self.outputs for n in ancestors.values() for o in n.output):
                found.update({name: log.name for name in ancestors})
        return found

    def _epsilon_floor(self, node: onnx.NodeProto) -> bool:
        """A Max with a constant, or a Clip with a constant min and no max, below
        ``FRONT_END_FLOOR``: the floor a log's input gets (DNSMOS's Maximum(power, 1e-12)). A
        Max or Clip at 0 or 6 is a ReLU: a network's."""
        if node.op_type == "Max" and len(node.input) == 2:
            bounds = [self.inits.get(name) for name in node.input]
        elif node.op_type == "Clip" and len(node.input) >= 2 and (len(node.input) < 3 or not node.input[2]):
            bounds = [self.inits.get(node.input[1])]
        else:
            return False
        known = [b for b in bounds if b is not None]
        return len(known) == 1 and np.size(known[0]) == 1 and 0 < float(np.ravel(known[0])[0]) < FRONT_END_FLOOR

    def _reduces_few(self, node: onnx.NodeProto) -> bool:
        """A reduction over fewer than ``STATISTIC_FROM`` values an output, by static sizes: the
        sum of a complex value's squared parts over an axis of 2 (basic-pitch's constant-Q
        magnitude), a tensor of values like any other, not a normalization's statistic (its
        whole network downstream had been kept float as "inside a LayerNormalization")."""
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
        if axes is None and len(node.input) > 1 and node.input[1] in self.inits:
            axes = [int(a) for a in np.ravel(self.inits[node.input[1]])]
        known = next((vi for vi in [*self.graph.value_info, *self.graph.input] if vi.name == node.input[0]), None)
        if not axes or known is None or not known.type.tensor_type.HasField("shape"):
            return False
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in known.type.tensor_type.shape.dim]
        sizes = [dims[a] for a in axes if -len(dims) <= a < len(dims)]
        return len(sizes) == len(axes) and all(sizes) and int(np.prod(sizes)) < STATISTIC_FROM

    def _layernorm_variance_nodes(self) -> set[str]:
        """The nodes of a decomposed normalization's statistics: those that compute, from
        ReduceMean/ReduceSum outputs alone, what a Sqrt reads (the Add of epsilon in ReduceMean
        -> Sub -> Pow -> ReduceMean -> Add -> Sqrt; the E[x^2] - E[x]^2 -> Max(eps) -> Add chain).
        int8 would cost the variance about 1% of its value for no gain, and in the E[x^2] - E[x]^2
        form all of it (the difference of two rounded near-equal terms is rounding: 0, then
        divided by)."""
        # statistics: a reduction's output, and what ops compute from statistics alone (float
        # inputs other than constants; shape tensors do not count), in graph order
        statistics: set[str] = set()
        constant = set(self.inits)  # and what nodes compute from constants alone (a reshaped gamma)
        below: set[str] = set()
        for node in self.graph.node:
            if node.op_type in ("ReduceMean", "ReduceSum") and not self._reduces_few(node):
                statistics.update(node.output)
                continue
            inputs = [n for n in node.input if n]
            if all(n in constant for n in inputs):
                constant.update(node.output)
                continue
            values = [n for n in inputs if n not in constant and n in self.float_names]
            if values and all(n in statistics for n in values):
                statistics.update(node.output)
                below.add(node.name)
        # the statistics a Sqrt reads (variance, epsilon) and those computed from its output
        # (1 / sqrt, times gamma): a tensor spanning 1 to 1/sqrt(epsilon) when a row is constant
        linked: set[str] = set()
        todo = [n for n in self.graph.node if n.op_type == "Sqrt"]
        while todo:
            node = todo.pop()
            sources = [self.producers.get(name) for name in node.input]
            users = [u for out in node.output for u in self.consumers.get(out, [])]
            for other in [*sources, *users]:
                if other is not None and other.name in below and other.name not in linked:
                    linked.add(other.name)
                    todo.append(other)
        roots = {n.name for n in self.graph.node if n.op_type == "Sqrt" and n.input[0] in statistics}
        # the reductions whose statistics those read (ReduceSum runs integer; here it must not)
        read = {name for n in self.graph.node if n.name in linked | roots for name in n.input}
        roots |= {n.name for n in self.graph.node if n.op_type in ("ReduceMean", "ReduceSum")
                  and any(o in read for o in n.output)}
        # and the Mul or Div that normalizes with them: its operand spans that range too
        kept = linked | roots
        scaling = {u.name for node in self.graph.node if node.name in kept
                   for out in node.output for u in self.consumers.get(out, [])
                   if u.op_type in ("Mul", "Div") and u.name not in below}
        return kept | scaling

    def _specs(self, node, op) -> dict:
        """The op's constant inputs, plus any other constant input where the op accepts them as
        per-tensor quantized operands."""
        consts = dict(op.constants(node))
        for i, spec in list(consts.items()):
            if isinstance(spec, Weight) and spec.optional and node.input[i] not in self.inits:
                del consts[i]  # e.g. MatMul's B when it is an activation
        if op.accepts_constants:
            for i, name in enumerate(node.input):
                if name in self.inits and i not in consts and self.inits[name].dtype.kind == "f":
                    consts[i] = Weight(axis=None)
        return consts

    def _constants_reason(self, node, op) -> str | None:
        consts = self._specs(node, op)
        for i, name in enumerate(node.input):
            if not name:
                continue
            spec = consts.get(i)
            if isinstance(spec, (Weight, Bias)) and name not in self.inits:
                return f"input '{name}' must be a constant"
            if isinstance(spec, Raw) and not spec.at_run and name not in self.inits:
                return f"input '{name}' must be a constant"
            if isinstance(spec, Weight) and self.inits[name].dtype.kind != "f":
                return f"weight '{name}' is not float"
            if spec is None and name in self.inits:
                return f"input '{name}' is a constant where an activation is expected"
            if spec is None and name not in self.float_names:
                return f"input '{name}' is not a float tensor"
        for name in node.output:
            if name and name not in self.float_names:
                return f"output '{name}' is not a float tensor"
        return None

    def _activations(self, integer) -> list[str]:
        names = []
        for node in self.graph.node:
            op = integer.get(node.name)
            if op is None:
                continue
            consts = self._specs(node, op)
            masked = self.masks.joins.get(node.name)  # a masked Softmax reads the float masked scores
            names += [n for i, n in enumerate(node.input) if n and i not in consts
                      and (masked is None or n != masked.output)]
            names += [n for n in node.output if n]
        names = list(dict.fromkeys(names))
        for name in names:
            if name not in self.table.tensors:
                user = next((n for n in self.graph.node if name in n.input or name in n.output), None)
                where = f" ({user.op_type} node '{user.name}')" if user is not None else ""
                other = f", made for {self.made_for}: calibrate this model" if self.made_for else ""
                raise QtoolError(f"tensor '{name}'{where} is not in the calibration table "
                                 f"'{self.table_name}'{other}")
        return names

    def _activation_qparams(self, integer, activations) -> dict[str, QParams]:
        """(S, Z) per activation; ops that share (S, Z) join their input and output into one group
        whose range covers both (forward and backward threshold propagation)."""
        parent = {n: n for n in activations}

        def find(n):
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for node in self.graph.node:
            op = integer.get(node.name)
            if op is None:
                continue
            tied = [[n for n in group if n in parent] for group in op.tied(node)]
            if op.shares_qparams:
                consts = self._specs(node, op)
                tied.append([n for i, n in enumerate(node.input) if n and i not in consts]
                            + [n for n in node.output if n in parent])
            for members in tied:
                for other in members[1:]:
                    parent[find(other)] = find(members[0])
        groups = defaultdict(list)
        for n in activations:
            groups[find(n)].append(n)
        result, per_tensor = {}, {}
        self.report.qparam_groups = [list(m) for m in groups.values() if len(m) > 1]
        wide = self._int16_tensors(integer)
        for members in groups.values():
            dtype = "int16" if any(name in wide for name in members) else self.opt.activation_type
            lo, hi, threshold = np.inf, -np.inf, 0.0
            for name in members:
                e_lo, e_hi, e_thr = self._effective_range(name, integer, dtype == "int16")
                lo, hi, threshold = min(lo, e_lo), max(hi, e_hi), max(threshold, e_thr)
            qp = self._qparams(lo, hi, threshold, members, dtype)
            if len(members) == 1 and members[0] in self.channel_ranges and qp.dtype in ("int8", "uint8") \
                    and not self.opt.symmetric:
                per_tensor[members[0]] = qp
                qp = self._channel_qparams(members[0], lo, hi, qp.dtype)
            for name in members:
                result[name] = qp
        if per_tensor:
            self._alternate_types(integer, result, per_tensor)
            self.report.channel_scales = sorted(n for n, qp in result.items() if qp.axis is not None)
        return result

    def _alternate_types(self, integer, result: dict, per_tensor: dict) -> None:
        """In place: each activation quantized per channel made int8 or uint8 (the same steps,
        ``Z`` moved by 128) so that every integer op reading or writing one has different input
        and output types. onnxruntime fuses DequantizeLinear -> Conv (or Sigmoid, ...) ->
        QuantizeLinear into QLinearConv (QLinearSigmoid, ...) whatever the scales' shapes, and
        those kernels then fail on a scale per channel; it fuses only where the types agree, so
        these groups run as written, dequantized. Per-tensor neighbours count with the type they
        are written in (uint8 for the portable target). Links run from an op's input to its output;
        where two ops pin one tensor to both types, that tensor goes back to its scale per tensor."""
        unsigned = get_target(self.opt.target).unsigned  # to_unsigned then makes per-tensor int8 uint8

        def written(dtype: str) -> str:
            return "uint8" if unsigned and dtype == "int8" else dtype

        links = []
        for node in self.graph.node:
            if node.name in integer and node.input and node.output and node.input[0] in result \
                    and node.output[0] in result:
                links.append((node.input[0], node.output[0]))
        while True:
            channel = {n for n, qp in result.items() if qp.axis is not None}
            near: dict[str, list[str]] = defaultdict(list)
            pins: dict[str, set[str]] = defaultdict(set)  # tensor -> the types it may not take
            for a, b in links:
                if a in channel and b in channel:
                    near[a].append(b)
                    near[b].append(a)
                elif a in channel or b in channel:
                    inside, outside = (a, b) if a in channel else (b, a)
                    pins[inside].add(written(result[outside].dtype))
            chosen: dict[str, str] = {}
            dropped = None
            order = {n: i for i, n in enumerate(result)}
            for start in sorted(channel, key=order.__getitem__):
                if start in chosen:
                    continue
                component, queue, parity = [], [start], {start: 0}
                while queue:
                    t = queue.pop()
                    component.append(t)
                    for u in near[t]:
                        if u not in parity:
                            parity[u] = 1 - parity[t]
                            queue.append(u)
                        elif parity[u] == parity[t]:
                            dropped = dropped or u  # an odd cycle: no alternation exists
                base = None  # the type of parity 0
                for t in component:
                    for banned in sorted(pins[t]):
                        want = _other_byte_type(banned) if parity[t] == 0 else banned
                        if banned not in ("int8", "uint8"):
                            continue
                        if base is None:
                            base = want
                        elif base != want:
                            dropped = dropped or t
                base = base or _other_byte_type(written(self.opt.activation_type))
                for t in component:
                    chosen[t] = base if parity[t] == 0 else _other_byte_type(base)
            if dropped is None:
                break
            result[dropped] = per_tensor[dropped]
        for t, dtype in chosen.items():
            qp = result[t]
            if qp.dtype != dtype:
                shift = 128 if dtype == "uint8" else -128
                result[t] = replace(qp, zero_point=np.asarray(qp.zero_point, np.int64) + shift, dtype=dtype)

    def _channel_qparams(self, name: str, lo: float, hi: float, dtype: str) -> QParams:
        """One (S, Z) per channel (axis 1) from the fitted per-channel range, each within the
        tensor's own range ``[lo, hi]`` (the calibration method's clipping stays). A tensor read by
        a Conv (depthwise: qtool.channels) is symmetric, so that its channels share one zero point
        (padding fills with it)."""
        c_lo, c_hi = (np.asarray(v, np.float64).reshape(-1) for v in self.channel_ranges[name])
        read_by_conv = any(u.op_type == "Conv" for u in self.consumers.get(name, []))
        # both ends into [lo, hi]: a channel wholly beyond a cut (above a clipped top, or where a
        # Sigmoid has saturated) keeps the cut's end, not an inverted range
        return per_channel_activation(np.clip(c_lo, lo, hi), np.clip(c_hi, lo, hi), dtype, read_by_conv)

    def _effective_range(self, name, integer, int16: bool = False):
        """A tensor read only by ops that clamp at zero (Relu) needs only its non-negative part,
        one read only by ops flat beyond some bounds (``_flat_input``) or by saturating ones
        (``_saturated_input``) only the part they tell apart. An output whose range the op fixes
        (Softmax: [0, 1]) takes that range. An int16 one takes the table's ``int16_ranges`` where
        it has one."""
        producer = self.producers.get(name)
        if producer is not None and producer.op_type in FIXED_OUTPUT_RANGE:
            lo, hi = FIXED_OUTPUT_RANGE[producer.op_type]
            return lo, hi, max(abs(lo), abs(hi))
        e = self.table.tensors[name]
        if int16 and name in self.table.int16_ranges:
            lo, hi = self.table.int16_ranges[name]
            e = TensorEntry(lo, hi, max(abs(lo), abs(hi)), e.method)
        users = self.consumers.get(name, [])
        clamped = (users and name not in self.outputs
                   and all(integer.get(u.name) is not None and integer[u.name].clamps_below_zero
                           for u in users))
        if not clamped:
            lo, hi = (e.min, e.max) if int16 else self._flat_input(name, users, integer, e.min, e.max)
            lo, hi = self._saturated_input(name, users, integer, lo, hi)
            if (lo, hi) != (e.min, e.max):
                return lo, hi, min(e.threshold, max(abs(lo), abs(hi)))
            return e.min, e.max, e.threshold
        lo = max(e.min, 0.0)
        return lo, e.max, min(e.threshold, max(abs(lo), abs(e.max)))

    def _flat_input(self, name: str, users, integer, lo: float, hi: float) -> tuple[float, float]:
        """The range of a tensor read only by integer nodes that are constant beyond some bounds
        (qtool/ops/flat.py: HardSwish, HardSigmoid, Clip), cut at those bounds. 8-bit tensors
        only: at int16 the steps are fine already, and the cut only moved the fitted steps' noise
        (PP-OCRv4 rec int16 --data 34.67 -> 34.35 dB held out, the judge 33.18 -> 33.17)."""
        if name in self.outputs or not all(integer.get(u.name) is not None for u in users):
            return lo, hi
        cut = readers_cut(name, [(u, list(u.input)) for u in users], self.inits.get)
        if cut is None:
            return lo, hi
        new_lo, new_hi = max(lo, cut[0]), min(hi, cut[1])
        if not new_lo < new_hi:
            return lo, hi
        # past each cut by more than half a step: the zero point's rounding moves the levels by up
        # to half a step, and the end level must still lie at or beyond the bound
        margin = (new_hi - new_lo) / 500
        return max(lo, new_lo - margin) if new_lo > lo else lo, min(hi, new_hi + margin) if new_hi < hi else hi

    def _saturated_input(self, name: str, users, integer, lo: float, hi: float) -> tuple[float, float]:
        """The input range of a tensor read only by integer Sigmoid or Tanh nodes (increasing, and
        flat at both ends), cut where their output stops changing: every input below ``f^-1(y_lo +
        S_y / 4)`` gives the output's lowest step anyway, and above ``f^-1(y_hi - S_y / 4)`` its
        highest (``[y_lo, y_hi]``, ``S_y``: the output's calibrated range and step). A class score's
        logits span [-15, 2] where its probabilities span [0, 0.25]: the logits then get the steps
        of [-7.6, -1.1] (widened to hold 0), 2.6 times finer, and the same output. Where the
        readers' outputs differ, the widest cut is taken."""
        if not users or name in self.outputs or self.opt.activation_type == "int16" or self.opt.symmetric:
            return lo, hi
        cut_lo, cut_hi = np.inf, -np.inf
        for user in users:
            out = user.output[0] if user.output else ""
            if user.op_type not in SATURATING or integer.get(user.name) is None or user.input[0] != name \
                    or out not in self.table.tensors or out in self.opt.int16 or user.name in self.opt.int16:
                return lo, hi
            y = self.table.tensors[out]
            window = saturation_window(user.op_type, y.min, y.max,
                                       asymmetric(y.min, y.max, self.opt.activation_type).scale)
            cut_lo, cut_hi = min(cut_lo, window[0]), max(cut_hi, window[1])
        new_lo, new_hi = max(lo, cut_lo), min(hi, cut_hi)
        return (new_lo, new_hi) if new_lo < new_hi else (lo, hi)

    def _int16_tensors(self, integer) -> set[str]:
        """The activations of the integer ops that ``int16`` names (by node name or op type)."""
        named = set(self.opt.int16)
        wide = set()
        for node in self.graph.node:
            op = integer.get(node.name)
            if op is None or not ({node.name, node.op_type} & named):
                continue
            consts = self._specs(node, op)
            wide.update(n for i, n in enumerate(node.input) if n and i not in consts)
            wide.update(n for n in node.output if n)
        return wide

    def _qparams(self, lo, hi, threshold, members, dtype: str) -> QParams:
        if dtype == "int16":  # symmetric, Z = 0 (TFLite's 16x8): the whole calibrated range
            threshold = max(abs(lo), abs(hi))
        symmetric_range = self.opt.symmetric or dtype == "int16"
        _, _, widened = safe_range(0.0, threshold) if symmetric_range else safe_range(lo, hi)
        if widened:
            self.report.widened.extend(members)
        if symmetric_range:
            if dtype == "uint8" and lo < 0:
                dtype = "int8"  # uint8 symmetric holds only [0, threshold]
            return symmetric(threshold, dtype)
        return asymmetric(lo, hi, dtype)

    # -- emitting ----------------------------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def _init(self, base: str, array: np.ndarray) -> str:
        name = self._fresh(base)
        self.new_inits.append(numpy_helper.from_array(array, name))
        return name

    def _qp_inits(self, base: str, qp: QParams, shape=()) -> tuple[str, str]:
        scale = np.asarray(qp.scale, dtype=np.float32).reshape(shape)
        zero_point = np.asarray(qp.zero_point).astype(qp.dtype).reshape(shape)
        return self._init(f"{base}_scale", scale), self._init(f"{base}_zero_point", zero_point)

    def _fence(self, produced: str, name: str, qp: QParams) -> str:
        """QuantizeLinear then DequantizeLinear after ``produced``; returns the DQ output name."""
        per_channel = qp.axis is not None
        scale, zero_point = self._qp_inits(name, qp, (np.size(qp.scale),) if per_channel else ())
        attrs = {"axis": qp.axis} if per_channel else {}
        q_out = self._fresh(f"{name}_quantized")
        dq_out = name if produced != name else self._fresh(f"{name}_dequantized")
        domain = self._fence_domain(qp)
        self.nodes.append(helper.make_node("QuantizeLinear", [produced, scale, zero_point], [q_out],
                                           name=self._fresh(f"{name}_QuantizeLinear"), domain=domain, **attrs))
        self.nodes.append(helper.make_node("DequantizeLinear", [q_out, scale, zero_point], [dq_out],
                                           name=self._fresh(f"{name}_DequantizeLinear"), domain=domain, **attrs))
        return dq_out

    def _fence_domain(self, qp: QParams) -> str:
        if qp.dtype in ("int16", "uint16") and default_opset(self.model) < INT16_OPSET:
            return MS_DOMAIN
        return ""

    def _weight_qparams(self, name: str, axis: int | None) -> QParams:
        """Symmetric int8 scales of a weight (int16 for a small table an int16 Gather reads),
        computed once per (weight, axis): its bias needs them again."""
        w = self.inits[name]
        key = (name, axis if self.opt.per_channel and w.ndim > 1 else None)
        dtype = "int16" if name in self.wide_tables else "int8"
        if key not in self.weight_qparams:
            if key[1] is not None:
                self.weight_qparams[key] = per_channel_symmetric(w, axis, dtype)
            else:
                self.weight_qparams[key] = symmetric(float(np.abs(w).max(initial=0.0)), dtype)
        return self.weight_qparams[key]

    def _wide_tables(self, integer: dict, qparams: dict) -> set[str]:
        """The tables of embedding Gathers whose output is int16 and which hold at most
        ``WIDE_TABLE_VALUES`` values: stored int16 (per row), as their rows' int8 rounding would
        be the same error added to every token (a token-type or position table: on
        all-MiniLM-L6-v2 1.6 dB of the int16 model's output) or to every use of a word (its word
        table, 30522 x 384: 34.63 -> 35.02 dB with `--data`, for 11.7 MB more); a table beyond
        the bound stays int8."""
        return {node.input[0] for node in self.graph.node
                if node.op_type == "Gather" and node.name in integer and node.input[0] in self.inits
                and self.inits[node.input[0]].size <= WIDE_TABLE_VALUES
                and getattr(qparams.get(node.output[0]), "dtype", "") == "int16"}

    def _wide_weights(self, integer: dict) -> set[str]:
        """With ``--weight-type int16``: the weights of the integer ``WIDE_WEIGHT_OPS``, stored int16
        per channel. The int8 weights of a convolutional backbone are what limits an int16 model
        (PP-OCRv4 rec's logits with int16 activations: every Conv's weights int8 14.3 dB, int16
        42.6 dB, before bias correction)."""
        if self.opt.weight_type != "int16":
            return set()
        found = set()
        for node in self.graph.node:
            op = integer.get(node.name)
            if op is None or node.op_type not in WIDE_WEIGHT_OPS:
                continue
            found |= {node.input[i] for i, spec in self._specs(node, op).items() if isinstance(spec, Weight)}
        return found

    def _wide_operands(self, integer: dict, qparams: dict) -> set[str]:
        """The constant operands (``accepts_constants``: an Add's bias or position table, a Mul's
        factor) whose every reader is integer with an int16 output: stored int16, as their int8
        rounding (one scale for the whole tensor) would be one error added to every token or
        pixel. With `--activation-type int16 --data`, held out: the ViT-S saliency model 33.86 ->
        45.12 dB (its position table and every MatMul's bias Add), all-MiniLM-L6-v2 35.02 ->
        35.66 dB."""
        wide: dict[str, bool] = {}
        for node in self.graph.node:
            op = integer.get(node.name)
            wide_out = (op is not None and op.accepts_constants and bool(node.output)
                        and getattr(qparams.get(node.output[0]), "dtype", "") == "int16")
            own = dict(op.constants(node)) if wide_out else {}  # its weights and biases: not operands
            for i, name in enumerate(node.input):
                if name in self.inits and self.inits[name].dtype.kind == "f":
                    ok = wide_out and i not in own and self.inits[name].size <= WIDE_TABLE_VALUES
                    wide[name] = wide.get(name, True) and ok
        return {name for name, ok in wide.items() if ok}

    def _fit_biases(self, integer: dict, qparams: dict) -> None:
        """Raise the weight scale of channels whose int32 bias would not fit. A bias is stored at
        ``S_x * S_w``: a channel whose weights are all but zero (PP-OCRv6 det has channels with
        max |w| = 1e-6) gets a tiny S_w, and its bias then exceeds int32 (it was clipped, and the
        executor's accumulator overflowed). A channel whose bias and largest possible sum of
        products, ``|b| / (S_x S_w) + sum |q_w| * max |q_x - Z_x|``, would leave int32 gets the
        S_w that puts its bias at ``max(2^30, 2^31 - 1 - that sum)``; its weights are then a small
        part of its output anyway."""
        raised = []
        for node in self.graph.node:
            op = integer.get(node.name)
            if op is None:
                continue
            consts = self._specs(node, op)
            for i, spec in consts.items():
                name = node.input[i] if i < len(node.input) else ""
                if not isinstance(spec, Bias) or spec.recurrent is not None or not name:
                    continue
                w_name = node.input[spec.weight]
                w_spec = consts.get(spec.weight)
                x = qparams.get(node.input[spec.activation])
                if not isinstance(w_spec, Weight) or x is None or w_name not in self.inits:
                    continue
                w_qp = self._weight_qparams(w_name, w_spec.axis)
                bias = np.abs(self.inits[name].astype(np.float64).reshape(-1))
                if node.name in self.bias_corrections:
                    bias = bias + np.abs(np.asarray(self.bias_corrections[node.name], np.float64).reshape(-1))
                scale = np.asarray(w_qp.scale, np.float64)
                if scale.ndim and bias.shape != scale.shape:
                    continue
                w_q = np.abs(self._weight_integers(w_name, w_qp).astype(np.int64))  # symmetric: Z = 0
                axis = w_qp.axis if w_qp.axis is not None else 0
                l1 = np.moveaxis(w_q, axis, 0).reshape(w_q.shape[axis], -1).sum(axis=1) if scale.ndim \
                    else np.full(bias.shape, w_q.sum())
                zero = np.asarray(x.zero_point, np.int64)
                reach = l1 * max(x.qmax - int(zero.min()), int(zero.max()) - x.qmin)
                x_scale = per_output(x.scale, bias.size)
                needed = bias / (x_scale * np.maximum(2.0 ** 30, (2.0 ** 31 - 1) - reach))
                if scale.ndim == 0:
                    needed = needed.max(initial=0.0)
                if not np.any(needed > scale):
                    continue
                widened = np.maximum(scale, needed).astype(np.float32)
                key = (w_name, w_spec.axis if self.opt.per_channel and self.inits[w_name].ndim > 1 else None)
                self.weight_qparams[key] = replace(w_qp, scale=widened if scale.ndim else float(widened))
                raised.append((node.name, int(np.sum(needed > scale)),
                               int(np.sum((needed > scale) & (scale <= DEAD_CHANNEL * scale.max(initial=0.0))))
                               if scale.ndim else 0))
        if raised:
            names = ", ".join(f"'{n}' ({c})" for n, c, _ in raised[:4]) + (", ..." if len(raised) > 4 else "")
            count, dead = sum(c for _, c, _ in raised), sum(d for _, _, d in raised)
            note = "" if not dead else (f" ({'all' if dead == count else dead} of them with weights under "
                                        f"{DEAD_CHANNEL:g} of their layer's largest: outputs that are their bias)")
            self.report.warnings.append(
                f"the weight scale of {count} channel(s) in {len(raised)} layer(s) "
                f"raised so that their int32 bias cannot overflow: {names}{note}")

    def _weight_integers(self, name: str, qp: QParams) -> np.ndarray:
        """The weight's integers: rounded to nearest, or fitted (qtool.rounding) on these scales."""
        fitted = self.rounded.get(name)
        if fitted is not None and fitted.values.shape == self.inits[name].shape:
            mine, asked = np.asarray(fitted.scale, np.float32), np.asarray(qp.scale, np.float32)
            if np.array_equal(mine, asked):
                return fitted.values.astype(qp.dtype)
            if mine.shape == asked.shape and mine.ndim == 1 and qp.axis is not None and np.any(mine == asked):
                # the channels whose scale ``_fit_biases`` raised take nearest rounding, the others
                # keep theirs (each output channel is fitted on its own)
                nearest = _nearest_integers(self.source, name, self.inits[name], qp)
                shape = [1] * nearest.ndim
                shape[qp.axis] = mine.size
                return np.where((mine == asked).reshape(shape), fitted.values.astype(qp.dtype), nearest)
        return _nearest_integers(self.source, name, self.inits[name], qp)

    def _blocked(self, node, spec) -> bool:
        """This weight of ``node`` is written int4 and/or in blocks (the options ask, the op takes it)."""
        return (node.op_type in BLOCKED_OPS and isinstance(spec, Weight) and spec.axis is not None
                and self.opt.blocked_weights
                and getattr(self.inits.get(node.input[1] if len(node.input) > 1 else ""), "ndim", 0) == 2)

    def _blocked_weight(self, name: str, spec: Weight) -> str:
        """A MatMul/Gemm B as int4 (or int8) integers with one symmetric scale per block of
        ``block_size`` along K and output column (per column without a block size), read by a
        DequantizeLinear with ``axis`` K and ``block_size``."""
        key = (name, "blocked", spec.axis)
        if key in self.weight_cache:
            return self.weight_cache[key]
        w = self.inits[name].astype(np.float32)
        if w.ndim != 2:
            raise QtoolError(f"weight '{name}' has {w.ndim} axes: a blocked weight needs 2")
        k_axis = 1 - spec.axis
        k = w.shape[k_axis]
        block = self.opt.block_size or k
        qmax = 7 if self.opt.weight_type == "int4" else 127
        blocks = -(-k // block)
        padded = np.zeros(w.shape[:k_axis] + (blocks * block,) + w.shape[k_axis + 1:], np.float32)
        padded[(slice(None),) * k_axis + (slice(0, k),)] = w
        moved = np.moveaxis(padded, k_axis, 0).reshape(blocks, block, -1)
        top = np.clip(np.abs(moved).max(axis=1), MIN_THRESHOLD, RANGE_LIMIT)  # [blocks, columns]
        scale = np.moveaxis((top / qmax).astype(np.float32), 0, k_axis)
        dtype = TensorProto.INT4 if self.opt.weight_type == "int4" else TensorProto.INT8
        rule = boundary.Boundary("QuantizeLinear", name, axis=k_axis, block_size=block, output_type=dtype)
        q = rule.quantize(w, scale, None)
        q_name = self._init(f"{name}_quantized", q)
        s_name = self._init(f"{name}_scale", scale)
        out = self._fresh(f"{name}_dequantized")
        self.nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [out],
                                           name=self._fresh(f"{name}_DequantizeLinear"), axis=k_axis,
                                           block_size=block))
        self.weight_cache[key] = out
        if self.report.blocked is None:
            self.report.blocked = {"type": self.opt.weight_type, "block_size": self.opt.block_size, "weights": 0}
        self.report.blocked["weights"] += 1
        return out

    def _weight(self, name: str, spec: Weight) -> str:
        key = (name, spec.axis if self.opt.per_channel else None)
        if key in self.weight_cache:
            return self.weight_cache[key]
        qp = self._weight_qparams(name, spec.axis)
        q_name = self._init(f"{name}_quantized", self._weight_integers(name, qp))
        shape = np.shape(qp.scale)
        scale, zero_point = self._qp_inits(name, qp, shape)
        out = self._fresh(f"{name}_dequantized")
        attrs = {"axis": qp.axis} if qp.axis is not None else {}
        self.nodes.append(helper.make_node("DequantizeLinear", [q_name, scale, zero_point], [out],
                                           name=self._fresh(f"{name}_DequantizeLinear"),
                                           domain=self._fence_domain(qp), **attrs))
        self.weight_cache[key] = out
        return out

    def _bias(self, name: str, node, inputs: list[str], spec: Bias, qparams) -> str:
        bias = self.inits[name].astype(np.float64)
        scale = self._bias_scale(node, inputs, qparams[inputs[spec.activation]], spec.weight)
        if spec.recurrent is not None:  # [directions, 2 * rows]: per column, the two halves' scales
            hidden = qparams[next(n for n in node.output[:2] if n)]
            half = (bias.shape[-1] // 2,)
            scale = np.concatenate([np.broadcast_to(scale, half), np.broadcast_to(
                self._bias_scale(node, inputs, hidden, spec.recurrent), half)])
            bias, axis = bias.reshape(-1, scale.size), 1
        else:
            bias, axis = bias.reshape(-1), 0
        scale = np.broadcast_to(scale.astype(np.float32), bias.shape[axis:axis + 1]).copy()
        q = np.rint(bias / scale.astype(np.float64))
        if node.name in self.bias_corrections:  # whole steps of this bias's own scale
            q += np.rint(np.asarray(self.bias_corrections[node.name], np.float64) / scale)
        q = np.clip(q, -(2**31), 2**31 - 1).astype(np.int32)
        q_name = self._init(f"{name}_quantized", q)
        s_name = self._init(f"{name}_{node.name}_scale", scale)
        z_name = self._init(f"{name}_{node.name}_zero_point", np.zeros(scale.shape, np.int32))
        out = self._fresh(f"{name}_dequantized")
        self.nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [out],
                                           name=self._fresh(f"{name}_DequantizeLinear"), axis=axis))
        return out

    def _bias_scale(self, node, inputs: list[str], activation: QParams, weight: int) -> np.ndarray:
        """``S_activation * S_weight`` (float64, per weight channel or one) for ``node``'s input
        ``weight`` (named ``inputs[weight]``), quantized as the op quantizes it."""
        w_spec = REGISTRY[node.op_type].constants(node)[weight]
        w_qp = self._weight_qparams(inputs[weight], w_spec.axis)
        w_scale = np.asarray(w_qp.scale, np.float64)
        return per_output(activation.scale, max(w_scale.size, 1)) * w_scale

    def _assemble(self) -> onnx.ModelProto:
        used = names_read(self.nodes) | self.outputs  # a body may output a constant as it is
        inits = [numpy_helper.from_array(a, n) for n, a in self.inits.items() if n in used]
        inits += [t for t in self.new_inits if t.name in used]
        # weights' DequantizeLinear precede their users and Q/DQ follow producers: still topological
        inputs = [onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in self.graph.input]
        for vi in inputs:
            if self.pixels is not None and vi.name == self.pixels[0]:
                vi.type.tensor_type.elem_type = onnx.TensorProto.UINT8
        graph = helper.make_graph(self.nodes, self.graph.name, inputs, list(self.graph.output), inits)
        opsets = list(self.model.opset_import)
        if any(n.domain == MS_DOMAIN for n in all_nodes(graph)) and all(o.domain != MS_DOMAIN for o in opsets):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))  # (a body's node too)
        model = helper.make_model(graph, opset_imports=opsets, producer_name="qtool",
                                  producer_version=__version__)
        model.ir_version = self.model.ir_version
        return onnx.shape_inference.infer_shapes(model)

