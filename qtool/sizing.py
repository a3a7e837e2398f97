"""How big a sample is, and so how many run at once: the float activations of one sample, from
shape inference on the model with the data's dims (and the tensors it cannot size measured on
the first sample), turned into a batch size by the memory budget (qtool/batching.py). calibrate,
verify and exec size their batches here; it imports no more than they all need."""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx

from .batching import check_memory, choose_batch, release_freed
from .data import Dataset
from .model import (FloatRunner, fixed_size, float_tensors, graph_inputs, input_shape, node_reads, state_inputs,
                    submodel, without_weights)


def fixed_batch(model) -> int | None:
    """The batch size a model with a fixed first input dim demands, or None when it is free. An
    input whose first size is fixed above 1 and another size open (an LSTM state [2, N, 128]) has
    its samples on that open axis, as the data rules say (qtool/data.py): its first size is no
    batch (Silero ran 2 samples at a time). Nor is it where another input's first size is open:
    that input fixed above 1 in every size is a state fed whole (madmom's recurrent beat trackers
    take frames [T, 266] and states [25]: 25 is no batch), while a first size of 1 still is a
    batch of 1 (an input exported without its dynamic axis beside one with it)."""
    states = state_inputs(model)
    fixed = set()
    for vi in graph_inputs(model):
        dims = input_shape(vi)
        if not dims or not fixed_size(dims[0]) or vi.name in states:
            continue
        if dims[0] > 1 and not all(fixed_size(d) for d in dims[1:]):
            continue
        fixed.add(dims[0])
    return fixed.pop() if len(fixed) == 1 else None


def _fix_dims(model: onnx.ModelProto, data: Dataset, batch: int | None = None
              ) -> tuple[onnx.ModelProto, dict[str, list]]:
    """A copy of ``model`` with every input dim but the batch fixed to the data's, shapes inferred;
    with ``batch``, the batch dim fixed too and shape computations (Shape -> Reshape) followed, so
    that most tensors get static sizes.

    Only used to learn tensor types and shapes; the graph that runs keeps its dynamic dims.
    """
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    del fixed.graph.value_info[:]  # inferred again, from the fixed dims
    _casts_for_contrib_qdq(fixed.graph)
    shapes = {}
    for vi in graph_inputs(fixed):
        sample_shape, axis = data.sample_shape(vi.name), data.sample_axis(vi.name)
        shape = list(sample_shape) if axis is None else [*sample_shape[:axis], "N", *sample_shape[axis:]]
        dims = vi.type.tensor_type.shape.dim
        for dim, size in zip(dims, shape):
            if size != "N" or batch:
                dim.Clear()
                dim.dim_value = batch if size == "N" else size
        shapes[vi.name] = shape
    for data_prop in ((True, False) if batch else (False,)):
        try:
            infer = functools.partial(onnx.shape_inference.infer_shapes, data_prop=data_prop)
            return without_weights(infer, fixed), shapes
        except Exception:  # shape inference is a help here, not a requirement
            pass
    return (fixed if batch is None else model), shapes


def _casts_for_contrib_qdq(graph: onnx.GraphProto) -> None:
    """com.microsoft QuantizeLinear and DequantizeLinear (16-bit QDQ) replaced by Casts to their
    output types, in a copy made for shape inference: onnx's inference stops at a domain it does
    not know, and every tensor after the first such node went unsized (PP-OCRv4 rec at int16: 656
    of 746), to be measured by running the quantized model in onnxruntime (exec of one line: 2.4 s
    and 375 MB, now 1.6 s and 170 MB). Both keep their input's shape."""
    types = {t.name: t.data_type for t in graph.initializer}
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if node.op_type == "QuantizeLinear":  # the zero point's type; uint8 without one
            to = types.get(node.input[2], onnx.TensorProto.UINT8) if len(node.input) > 2 and node.input[2] \
                else onnx.TensorProto.UINT8
        else:
            to = types.get(node.input[1], onnx.TensorProto.FLOAT)  # the scale's type
        cast = onnx.helper.make_node("Cast", [node.input[0]], list(node.output[:1]), name=node.name, to=to)
        node.CopyFrom(cast)


def _typed_sizes(typed: onnx.ModelProto, unsized: list[str] | None = None) -> dict[str, int]:
    """The bytes of each float activation of ``typed`` (from ``_fix_dims``) whose size inference
    found (for the batch ``typed`` was fixed at), in graph order; the others appended to
    ``unsized`` when given."""
    infos = {vi.name: vi for vi in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]}
    sizes = {}
    for name in float_tensors(typed):
        dims = input_shape(infos[name]) if name in infos else []
        if dims and all(isinstance(d, int) and d > 0 for d in dims):
            sizes[name] = math.prod(dims) * 4
        elif unsized is not None:
            unsized.append(name)
    if unsized is not None:
        # outputs whose type inference never reached (behind a com.microsoft QuantizeLinear, as
        # int16 QDQ models write it): measured like the unsized ones, not left out
        typed_names = {name for name, vi in infos.items() if vi.type.tensor_type.elem_type}
        unsized.extend(o for node in typed.graph.node for o in node.output if o and o not in typed_names)
    return sizes


def activation_sizes(model: onnx.ModelProto, data: Dataset,
                     typed: tuple[onnx.ModelProto, int] | None = None) -> tuple[dict[str, int], list[str]]:
    """(bytes of each float activation of one sample that shape inference sizes, the activations
    it cannot size: a ViT's attention behind run-time reshapes)."""
    shaped, batch = typed if typed is not None else (_fix_dims(model, data, 1)[0], 1)
    unsized: list[str] = []
    sizes = {name: size // max(1, batch) for name, size in _typed_sizes(shaped, unsized).items()}
    known = {o.name for o in model.graph.output} | {n for node in model.graph.node for n in node.output}
    return sizes, [n for n in unsized if n in known]


def tensor_sizes(model: onnx.ModelProto, data: Dataset, typed: tuple[onnx.ModelProto, int] | None = None,
                 sizes: tuple[dict[str, int], list[str]] | None = None, prepack: bool = True) -> dict[str, int]:
    """Bytes of each float activation of one sample: ``activation_sizes`` (or ``sizes``, its
    result), the unsized ones measured by running the first sample through the nodes up to the
    last that makes one (``probe_model``; ``prepack``: FloatRunner's). An unsized tensor the run
    does not give (onnxruntime cannot run the model) is left out."""
    known, unsized = sizes if sizes is not None else activation_sizes(model, data, typed)
    found = dict(known)
    if unsized and len(data):
        try:
            probe = probe_model(model, unsized)
            runner = FloatRunner(probe, prepack=prepack)
            reads = {vi.name for vi in probe.graph.input}
            values = runner.run({k: v for k, v in data.batch(0, 1).items() if k in reads},
                                list(dict.fromkeys(unsized)))
        except Exception:  # onnxruntime cannot run this model (the integer executor may): no measure
            values = {}
        found.update((n, np.asarray(values[n]).nbytes) for n in unsized if n in values)
        probe = runner = values = None
        release_freed()  # the probe's session, before the command builds its own
    return found


def probe_model(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """The nodes of ``model`` up to the last that makes one of ``names``, which are its outputs:
    onnxruntime keeps every output of a run alive until the run ends, so a session on the whole
    model that returns every compared tensor held one sample's activations all at once (a ViT-S:
    230 MB, to size two tensors of its embedding), and the nodes after the last are not run."""
    nodes = list(model.graph.node)
    wanted = set(names)
    last = max(i for i, node in enumerate(nodes) if wanted.intersection(node.output))
    part = nodes[:last + 1]
    reads = {name for node in part for name in node_reads(node)}
    inputs = [vi for vi in graph_inputs(model) if vi.name in reads]
    initializers = [t for t in model.graph.initializer if t.name in reads]
    outputs = [onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names)]
    return submodel(model, part, inputs, outputs, initializers, "qtool_size_probe")


def one_feed_bytes(model: onnx.ModelProto, names, feeds: list[dict]) -> dict[str, int] | None:
    """The bytes of each of ``names`` (those shape inference sizes) for ``feeds[0]``, the graph's
    inputs fixed to its arrays' shapes; None where there is no feed or the inference fails."""
    if not feeds:
        return None
    shaped = onnx.ModelProto()
    shaped.CopyFrom(model)
    del shaped.graph.value_info[:]
    for vi in shaped.graph.input:
        value = feeds[0].get(vi.name)
        if value is None or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape
        dims.Clear()
        for size in np.shape(value):
            dims.dim.add().dim_value = int(size)
    try:
        typed = without_weights(lambda m: onnx.shape_inference.infer_shapes(m, data_prop=True), shaped)
    except Exception:  # a help, not a requirement: callers do without it
        return None
    out = {}
    for vi in [*typed.graph.value_info, *typed.graph.output]:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        if vi.name in names and t.HasField("shape") and dims and all(d > 0 for d in dims):
            out[vi.name] = int(np.prod(dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
    return out


def sample_bytes(model: onnx.ModelProto, data: Dataset, typed: tuple[onnx.ModelProto, int] | None = None,
                 sizes: tuple[dict[str, int], list[str]] | None = None) -> int:
    """Bytes of one sample's float activations (``tensor_sizes``, summed)."""
    return sum(tensor_sizes(model, data, typed, sizes).values())


def live_peak_bytes(model: onnx.ModelProto, sizes: dict[str, int]) -> int:
    """The most bytes of ``sizes`` (one sample's float activations) alive at once when the nodes
    run in graph order and each tensor is freed after its last reader (graph outputs kept to the
    end): the working set a run needs, where ``sample_bytes`` is every activation at once."""
    last = {}
    for i, node in enumerate(model.graph.node):
        for name in node_reads(node):
            last[name] = i
    kept = {o.name for o in model.graph.output}
    alive: dict[str, int] = {}
    live = peak = 0
    for i, node in enumerate(model.graph.node):
        for name in node.output:
            if name in sizes and name not in alive:
                alive[name] = sizes[name]
                live += sizes[name]
        peak = max(peak, live)
        for name in [n for n in alive if last.get(n, -1) <= i and n not in kept]:
            live -= alive.pop(name)
    return peak


def wide_activations(qmodel: onnx.ModelProto) -> bool:
    """The quantized model has 16-bit activations (a 16-bit zero point)."""
    wide = (onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
    return any(t.data_type in wide for t in qmodel.graph.initializer)


def batch_is_chosen(model: onnx.ModelProto, requested: int | None) -> bool:
    """Whether ``default_batch`` chooses the batch from the memory budget."""
    return not (fixed_batch(model) or requested)


def default_batch(model: onnx.ModelProto, data: Dataset, requested: int | None, factor: float,
                  memory_mb: int, cap: int, typed: tuple[onnx.ModelProto, int] | None = None,
                  held: int = 0,
                  sizes: tuple[dict[str, int], list[str]] | None = None, live: bool = False) -> tuple[int, str]:
    """The batch size a command runs: the model's fixed batch, else ``requested``, else chosen
    from the activations' size and ``memory_mb`` (qtool/batching.py) with ``held`` bytes held
    whatever the batch; and a line for the log when chosen. ``typed``: (``_fix_dims``'s model,
    its batch) when the caller has one; ``sizes``: see ``sample_bytes``; ``live``: ``factor``
    applies to ``live_peak_bytes``, not to every activation's."""
    if data.whole_samples:  # frames [T, F] and the like: no batch axis to put samples on
        return 1, ""
    fixed = fixed_batch(model)
    if fixed or requested:
        return fixed or requested, ""
    check_memory(memory_mb)
    per_sample = (live_peak_bytes(model, tensor_sizes(model, data, typed, sizes)) if live
                  else sample_bytes(model, data, typed, sizes))
    return choose_batch(per_sample, factor, memory_mb, cap, held)
