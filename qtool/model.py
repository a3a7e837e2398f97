"""Loading, preparing and running float ONNX models."""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, external_data_helper, numpy_helper

from . import diskcache, fusion
from .batching import release_freed
from .errors import QtoolError

FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


def _file_key(path: Path) -> tuple | None:
    """A file's identity for the caches below: its resolved path, size, times and inode (None when
    it cannot be read): a file written over, even at the same size, gets another."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


_digests: dict[tuple, str] = {}  # file_digest by the file's identity (``_file_key``), a few kept


def file_digest(path: str | Path) -> str:
    """The sha256 of a file's bytes; the same file again (``_file_key``) from the digest kept in
    this process (quantize --data digests its model in every step)."""
    key = _file_key(Path(path))
    if key is not None and key in _digests:
        return _digests[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if key is not None:
        while len(_digests) >= 8:
            del _digests[next(iter(_digests))]
        _digests[key] = h.hexdigest()
    return h.hexdigest()


def load_model(path: str | Path) -> onnx.ModelProto:
    """Load and check an ONNX model; problems become one-line ``QtoolError``s naming the file."""
    path = Path(path)
    if path.is_dir():
        raise QtoolError(f"model file '{path}' is a directory, not an ONNX file")
    if not path.is_file():
        if path.exists():
            raise QtoolError(f"model file '{path}' is not a regular file (a pipe or a device); save the "
                             f"model to a file first")
        raise QtoolError(f"model file '{path}' not found")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, truncated files raise others
        raise QtoolError(f"model file '{path}' is not a valid ONNX model ({first_line(e)})") from None
    external = _check_external_data(model, path)
    if external:
        try:
            external_data_helper.load_external_data_for_model(model, str(path.parent))
        except Exception as e:  # a missing or short data file
            raise QtoolError(f"model file '{path}': cannot read its external data ({first_line(e)})") from None
    if not model.graph.node:
        raise QtoolError(f"model file '{path}' is not a valid ONNX model (empty graph)")
    try:
        # the file itself where it is whole: the checker given the message serializes it first
        # (a copy of the weights beside the message: 90 MB of a ViT-S's peak)
        onnx.checker.check_model(model if external else str(path))
    except onnx.checker.ValidationError as e:
        raise QtoolError(f"model file '{path}' fails the ONNX checker: {first_line(e)}") from None
    return model


def stored_bytes(path: str | Path) -> int:
    """The bytes a model takes on disk: its file and the external data files its tensors name
    (each once; a ResNet-18 of a 91 KB graph and a 45 MB weights file reported 91179 bytes).
    Kept for a file with no external data, as it is (quantize --data builds a dozen candidates
    of one model: each read the file again, 10 ms a time on PP-OCRv4 rec)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if _STORED.get("key") == key:
        return _STORED["total"]
    total, external = _stored_bytes(path, stat.st_size)
    if not external:  # (another file's size could change under the same graph)
        _STORED.update(key=key, total=total)
    return total


_STORED: dict = {}  # the last file without external data that stored_bytes measured, and its size


def _stored_bytes(path: Path, total: int) -> tuple[int, bool]:
    """``total`` and the sizes of the external data files, and whether there were any."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return total, True  # (not kept: nothing known of it)
    locations = {next((e.value for e in t.external_data if e.key == "location"), "")
                 for t in _all_tensors(model.graph) if t.data_location == TensorProto.EXTERNAL}
    for location in sorted(locations - {""}):
        try:
            total += (path.parent / location).stat().st_size
        except OSError:
            pass
    return total, bool(locations)


def _check_external_data(model: onnx.ModelProto, path: Path) -> bool:
    """Refuse external data outside the model's folder before reading any: a model file must not
    make qtool read (and embed in its outputs) other files of the machine. True when some tensor
    has external data."""
    folder = path.parent.resolve()
    external = False
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        external = True
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        where = f"model file '{path}': tensor '{tensor.name}' has external data at '{location}'"
        if not location:
            raise QtoolError(f"{where}: no location")
        if os.path.isabs(location):
            raise QtoolError(f"{where}, an absolute path; only files inside the model's folder "
                             "are read")
        if not (folder / location).resolve().is_relative_to(folder):  # '..' or a symlink out
            raise QtoolError(f"{where}, outside the model's folder '{folder}'; refusing to read it")
    return external


def _all_tensors(graph: onnx.GraphProto):
    """Every TensorProto of a graph: initializers, sparse ones, node attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
        for sub in subgraphs(node):
            yield from _all_tensors(sub)


MIN_OPSET = 13  # DequantizeLinear's axis (per-channel weights) needs opset 13


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


# the last model prepared in this process: (sha256 of its bytes, the prepared model's bytes once
# it was prepared a second time). quantize --data prepares the same model once per step (19 times
# on PP-OCRv4 rec, 0.3 s each); from the third time on each call parses the kept bytes into a
# model of its own instead. A command that prepares once (verify, calibrate) keeps no bytes.
_last_prepared: tuple[bytes, bytes | None] | None = None


def prepare(model: onnx.ModelProto, source: str = "model") -> onnx.ModelProto:
    """Upgrade to opset 13 when older, fold constants and BatchNorm with onnxruntime's basic graph
    optimizer, then infer shapes.

    Calibrate, quantize and verify all call this, so they see the same graph and tensor names.
    The upgrade comes first because onnx's version converter rewrites some ops (Softmax gains a
    Flatten and a Reshape going to opset 13). The same model given again (byte for byte) gets the
    same preparation back, parsed anew: callers may change what they get. Another command's
    preparation of the same model by the same code comes from disk (qtool/diskcache.py)."""
    global _last_prepared
    given = _serialized(model)  # None: over 2 GB, prepared every time
    key = None if given is None else hashlib.sha256(given).digest()
    del given
    again = key is not None and _last_prepared is not None and _last_prepared[0] == key
    if again and _last_prepared[1] is not None:
        return onnx.load_model_from_string(_last_prepared[1])
    prepared, data = _prepared_on_disk(model, source, key)
    kept = None
    if again:
        kept = data if data is not None else _serialized(prepared)
    _last_prepared = None if key is None else (key, kept)
    return prepared


def _serialized(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes, or None where protobuf cannot serialize it (over 2 GB)."""
    try:
        return model.SerializeToString()
    except Exception:
        return None


# the last model file prepared in this process (``prepare_file``): (its identity, ``_file_key``;
# the prepared model's bytes once it was prepared a second time; the file's own opset)
_last_file: tuple[tuple, bytes | None, int] | None = None


def prepare_file(path: str | Path, source: str | None = None, loaded: onnx.ModelProto | None = None
                 ) -> onnx.ModelProto:
    """``prepare(load_model(path))``, and the same file again (``_file_key``: the same path, size,
    times and inode) from the prepared bytes kept in this process: quantize --data prepares its model in
    every step (27 times on a ViT-S, whose 97 MB took about 0.7 s a time to read, check, serialize
    and hash). Each call gets a model of its own. As with ``prepare``, a command that prepares
    once keeps no bytes. ``loaded``: ``load_model(path)`` where the caller has it already (read
    only when the file has to be prepared; it is not changed)."""
    global _last_file, _last_prepared
    path = Path(path)
    key = _file_key(path)
    again = key is not None and _last_file is not None and _last_file[0] == key
    if again and _last_file[1] is not None:
        return onnx.load_model_from_string(_last_file[1])
    loaded = load_model(path) if loaded is None else loaded
    prepared = prepare(loaded, source or f"model file '{path}'")
    kept = None
    if again:
        # prepare, given the same model again, has just kept its bytes: take them over (one copy)
        kept = _last_prepared[1] if _last_prepared is not None else None
        _last_prepared = None
        if kept is None:
            kept = _serialized(prepared)  # None over 2 GB: prepared every time
    _last_file = None if key is None else (key, kept, default_opset(loaded))
    return prepared


def file_opset(path: str | Path) -> int:
    """The opset of the model file ``path`` as written (before ``prepare`` upgrades it), from
    ``prepare_file``'s record where it prepared that file last, else read."""
    key = _file_key(Path(path))
    if key is not None and _last_file is not None and _last_file[0] == key:
        return _last_file[2]
    return default_opset(load_model(path))


def _prepared_on_disk(model: onnx.ModelProto, source: str, digest: bytes | None
                      ) -> tuple[onnx.ModelProto, bytes | None]:
    """``_prepare(model)`` and its bytes (None where not serialized), from the copy an earlier
    command kept on disk where there is one (qtool/diskcache.py), else prepared now and kept.
    ``digest``: the sha256 of the model's bytes (None: not kept)."""
    if digest is None or diskcache.folder() is None:
        return _prepare(model, source), None
    name = diskcache.key(digest)
    kept = diskcache.read(name)
    if kept is not None:
        try:
            return onnx.load_model_from_string(kept), kept
        except Exception:  # not a model after all: prepared again below
            diskcache.forget(name)
    prepared = _prepare(model, source)
    data = _serialized(prepared)
    if data is not None:  # over 2 GB: not kept
        diskcache.write(name, data)
    return prepared, data


def _prepare(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    check_float_model(model, source)
    opset = default_opset(model)
    if opset < MIN_OPSET:
        try:
            model = _convert_version(model, MIN_OPSET)
        except Exception as e:
            raise QtoolError(f"cannot upgrade {source} from opset {opset} to {MIN_OPSET} "
                             f"(needed for per-channel QDQ): {first_line(e)}") from None
    prepared = _basic_optimized(model, source)
    normalize(prepared)
    if fold_static_shapes(prepared):  # what they fed (a Resize's sizes, a Reshape's shape) folds next
        prepared = _basic_optimized(prepared, source)
        normalize(prepared)
    if hoist_loop_constants(prepared):
        normalize(prepared)
    prepared = _fuse(prepared, source)
    prepared = without_weights(onnx.shape_inference.infer_shapes, prepared)
    release_freed()  # the copies made on the way
    return prepared


def _basic_optimized(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    """The model after onnxruntime's basic graph optimizations (constant folding, BatchNorm into
    Conv, identities removed)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 4  # errors come back as exceptions, told in one line
    with tempfile.TemporaryDirectory(prefix="qtool-prepare-") as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "prepared.onnx")
        source_file = os.path.join(tmp, "source.onnx")
        with open(source_file, "wb") as f:  # read by onnxruntime: no serialized copy held meanwhile
            f.write(model.SerializeToString())
        try:
            ort.InferenceSession(source_file, options, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise QtoolError(f"onnxruntime cannot load {source}: {first_line(e)}") from None
        optimized = onnx.load(options.optimized_model_filepath)
    _declared_opsets_only(optimized, model)
    return optimized


def _declared_opsets_only(optimized: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """In place: the opset imports of ``optimized`` that ``source`` declared or a node uses.
    onnxruntime writes every domain it knows (ai.onnx.ml, ai.onnx.training, com.microsoft.nchwc,
    org.pytorch.aten, ...), and a model that imports them unused is one some runtimes and
    converters refuse."""
    wanted = {o.domain for o in source.opset_import} | {"", "ai.onnx"}
    wanted |= {n.domain for n in all_nodes(optimized.graph)}
    wanted |= {n.domain for f in optimized.functions for n in f.node}
    kept = [o for o in optimized.opset_import if o.domain in wanted]
    if len(kept) < len(optimized.opset_import):
        del optimized.opset_import[:]
        optimized.opset_import.extend(kept)


def fold_static_shapes(model: onnx.ModelProto) -> int:
    """In place: the elements of a Shape that shape inference knows become constants where they
    are read alone: a Gather of constant indices, or a Slice of constant bounds, of a Shape whose
    picked dimensions are all fixed (a 224x224 input's H and W when its batch is open). Such
    values are the same on every run: onnxruntime refuses inputs of other fixed dimensions.
    onnxruntime's constant folding takes a Shape only when every dimension is fixed; the
    arithmetic fed by the folded values (position embeddings resized to the input's patch grid,
    a Reshape's target) then folds too. Main graph only; returns how many nodes became constants."""
    graph = model.graph
    shapes = {n.output[0]: n for n in graph.node if n.op_type == "Shape" and n.domain in ("", "ai.onnx")}
    outputs = {o.name for o in graph.output}
    picks = [n for n in graph.node if n.op_type in ("Gather", "Slice") and n.domain in ("", "ai.onnx")
             and n.input and n.input[0] in shapes and n.output[0] not in outputs]
    if not picks:
        return 0
    dims = _inferred_dims(model)
    fed = {i.name for i in graph.input}  # an initializer that is also an input is a default only
    inits = {t.name: t for t in graph.initializer if t.name not in fed}

    def const(name):
        return onnx.numpy_helper.to_array(inits[name]) if name in inits else None

    folded = {}
    for node in picks:
        shape_node = shapes[node.input[0]]
        known = dims.get(shape_node.input[0])
        if known is None:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in shape_node.attribute}
        rank = len(known)
        start, end = attrs.get("start", 0), attrs.get("end", rank)  # Shape-15's window, clamped
        start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
        known = known[start:end]
        if node.op_type == "Gather":
            indices = const(node.input[1]) if len(node.input) > 1 else None
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if indices is None or axis != 0 or indices.dtype.kind not in "iu" or \
                    not all(-len(known) <= int(i) < len(known) for i in indices.reshape(-1)):
                continue
            picked = np.array([known[int(i)] for i in indices.reshape(-1)], dtype=object).reshape(indices.shape)
        else:
            names = (list(node.input[1:]) + [""] * 4)[:4]  # starts, ends, axes (default 0), steps (1)
            starts, ends, axes, steps = (const(n) if n else (None if d is None else np.int64([d]))
                                         for n, d in zip(names, (None, None, 0, 1)))
            if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)) or \
                    int(axes.reshape(-1)[0]) not in (0, -1) or int(steps.reshape(-1)[0]) == 0:
                continue
            start, end, step = (int(v.reshape(-1)[0]) for v in (starts, ends, steps))
            picked = np.array([known[i] for i in _slice_indices(len(known), start, end, step)], dtype=object)
        values = picked.reshape(-1).tolist()
        if any(v is None or v <= 0 for v in values):
            continue
        folded[node.output[0]] = np.array(values, dtype=np.int64).reshape(picked.shape)
    if not folded:
        return 0
    keep = [n for n in graph.node if not (n.op_type in ("Gather", "Slice") and n.output and n.output[0] in folded)]
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in folded.items())
    return len(folded)


def _slice_indices(dim: int, start: int, end: int, step: int) -> range:
    """The indices ONNX's Slice takes along an axis of ``dim``: negative bounds count from the
    end, then start and end are clamped to [0, dim] for a positive step and to [0, dim - 1] and
    [-1, dim - 1] for a negative one (Python's slice differs there: a start below -dim gives
    nothing going backwards, where ONNX starts at 0)."""
    start, end = (v + dim if v < 0 else v for v in (start, end))
    if step > 0:
        return range(max(0, min(dim, start)), max(0, min(dim, end)), step)
    return range(max(0, min(dim - 1, start)), max(-1, min(dim - 1, end)), step)


# ops of a model that is quantized already (ONNX's and onnxruntime's com.microsoft ones); besides
# these, every op named QLinear* or DynamicQuantize*
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "ConvInteger", "MatMulInteger", "QGemm",
                           "QAttention", "MatMulIntegerToFloat", "QEmbedLayerNormalization",
                           "QOrderedMatMul", "QOrderedLayerNormalization", "QOrderedAttention",
                           "QOrderedGelu", "QOrderedLongformerAttention", "MatMulNBits",
                           "MatMulBnb4", "DequantizeBFP", "QuantizeBFP", "GatherBlockQuantized"})


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs in ``node``'s attributes (If branches, Loop and Scan bodies)."""
    return [sub for attr in node.attribute for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)]


def folded_note(names, model_path) -> str:
    """For a message about ``names`` that the prepared model lacks: where they are node names of
    the model file at ``model_path``, that preparation folded them into other ops ('' otherwise)."""
    try:
        original = load_model(model_path)
    except QtoolError:
        return ""
    in_file = {n.name for n in all_nodes(original.graph) if n.name}
    gone = [n for n in names if n in in_file]
    if not gone:
        return ""
    listed = ", ".join(repr(n) for n in gone)
    return (f"; {listed} {'is a node' if len(gone) == 1 else 'are nodes'} of the model file that preparation "
            f"removed or folded into other ops (a Dropout or Identity removed, a BatchNormalization folded into "
            f"its Conv, a decomposed LayerNorm or GELU fused into one op): name the op that does its work")


def all_nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs, depth first."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from all_nodes(sub)


def subgraph_reason(node: onnx.NodeProto) -> str | None:
    """Why a node with subgraphs (If, Loop, Scan) runs in float, or None for other nodes."""
    graphs = subgraphs(node)
    if not graphs:
        return None
    inner = sum(1 for sub in graphs for _ in all_nodes(sub))
    return (f"control flow: runs in float with the {inner} nodes of its "
            f"{len(graphs)} subgraph{'s' if len(graphs) > 1 else ''}")


def names_read(nodes) -> set[str]:
    """The tensor names ``nodes`` read, their subgraphs' nodes included (a subgraph reads the
    outer graph's tensors and initializers by name, not through its node's inputs)."""
    return {name for node in nodes for inner in [node, *(n for sub in subgraphs(node) for n in all_nodes(sub))]
            for name in inner.input}


def outer_reads(node: onnx.NodeProto) -> list[str]:
    """The names ``node``'s subgraphs read from the scope around the node (main-graph tensors and
    initializers), in first-read order: read inside and defined by none of the subgraph's own
    inputs, initializers or nodes."""
    return graphs_outer_reads(subgraphs(node))


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The names ``node`` reads: its inputs, then what its subgraphs read from around it."""
    return [n for n in [*node.input, *(outer_reads(node) if subgraphs(node) else [])] if n]


def submodel(model: onnx.ModelProto, nodes, inputs: list[onnx.ValueInfoProto],
             outputs: list[onnx.ValueInfoProto], initializers, name: str) -> onnx.ModelProto:
    """A model of ``nodes`` (consecutive ones of ``model``) with these inputs, outputs and
    initializers, under ``model``'s opsets, IR version and local functions."""
    graph = onnx.helper.make_graph(list(nodes), name, inputs, outputs, list(initializers))
    part = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    part.functions.extend(model.functions)
    return part


def graphs_outer_reads(graphs) -> list[str]:
    """``outer_reads`` of these subgraphs (one body, or every body of a node)."""
    found: dict[str, None] = {}

    def visit(graph: onnx.GraphProto, defined: set[str]) -> None:
        defined = defined | {i.name for i in graph.input} | {t.name for t in graph.initializer}
        for inner in graph.node:
            for name in inner.input:
                if name and name not in defined:
                    found.setdefault(name)
            for sub in subgraphs(inner):
                visit(sub, defined)
            defined = defined | set(inner.output)

    for sub in graphs:
        visit(sub, set())
    return list(found)


def check_float_model(model: onnx.ModelProto, source: str) -> None:
    """A model to calibrate or quantize must be float: one already quantized (QDQ, quantized
    operators, dynamic quantization) is refused in one line that names its quantized nodes."""
    found = [n for n in all_nodes(model.graph)
             if n.op_type in QUANTIZED_OPS or n.op_type.startswith(("QLinear", "DynamicQuantize"))]
    if not found:
        return
    named = ", ".join(f"{n.op_type} '{n.name}'" if n.name else n.op_type for n in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    raise QtoolError(f"{source} is already quantized ({named}{more}); qtool calibrates and "
                     f"quantizes float models: give it the float model this one was made from")


# decompositions that become one op (qtool/fusion.py): the finder, the rewrite, the opset it needs
FUSIONS = ((fusion.find_hardswish, fusion.fuse_hardswish, fusion.HARDSWISH_OPSET),
           (fusion.find_layernorm, fusion.fuse_layernorm, fusion.LAYERNORM_OPSET),
           (fusion.find_gelu, fusion.fuse_gelu, fusion.GELU_OPSET),
           (fusion.find_select, fusion.fuse_select, fusion.SELECT_OPSET),
           (fusion.find_softmax, fusion.fuse_softmax, fusion.SOFTMAX_OPSET))


def _fuse(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    """Constant affine ops after a Conv fold into it; HardSwish, LayerNorm and GELU decompositions
    become HardSwish (opset 14), LayerNormalization (opset 17) and Gelu (opset 20) nodes, a Gather
    of an activation by a constant scalar a Slice and a Squeeze
    (qtool/fusion.py), the model upgraded to the highest opset its fusions need. Where onnx cannot
    upgrade it that far, the fusions that need more stay undone: the decomposition still runs,
    with more requantizations."""
    if fusion.fold_affine_into_conv(model):
        _drop_unused_initializers(model)
    needed = sorted({opset for find, _, opset in FUSIONS if find(model)}, reverse=True)
    opset = default_opset(model)
    for target in needed:
        if target <= opset:
            break
        try:
            model = _convert_version(model, target)
        except Exception:
            continue
        normalize(model)
        opset = target
        break
    fused = False
    for find, fuse, needs in FUSIONS:
        matches = find(model) if needs <= opset else []
        if matches:
            fuse(model, matches)
            fused = True
    if fused:
        _drop_unused_initializers(model)
    return model


def upgrade(model: onnx.ModelProto, opset: int, source: str, why: str) -> onnx.ModelProto:
    """The model converted to ``opset`` by onnx's version converter (shapes inferred again), or a
    one-line error saying ``why`` it was needed."""
    try:
        converted = _convert_version(model, opset)
    except Exception as e:
        raise QtoolError(f"cannot upgrade {source} from opset {default_opset(model)} to {opset} ({why}): "
                         f"{first_line(e)}") from None
    normalize(converted)
    return converted


def _convert_version(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    return without_weights(lambda m: onnx.version_converter.convert_version(m, opset), model)


LARGE_TENSOR = 1024  # elements; far more than any shape-like input whose values onnx reads


def _large_float(tensor: onnx.TensorProto, any_type: bool = False) -> bool:
    """A float tensor (``any_type``: of any type) whose bytes ``without_weights`` and
    ``without_weight_bytes`` leave out."""
    return ((any_type or tensor.data_type in FLOAT_TYPES) and tensor.HasField("raw_data")
            and math.prod(tensor.dims) > LARGE_TENSOR)


def without_weights(transform, model: onnx.ModelProto) -> onnx.ModelProto:
    """``transform(model)`` for onnx's version converter and shape inference, run on a copy without
    the bytes of the large float tensors (initializers and Constant nodes), put back after.

    Both copy every tensor through their C++ IR (most of their time on PP-OCR) but read only the
    dims of float weights: values are read for shape-like inputs (Reshape's shape, Slice's starts,
    Resize's scales), all small. The result gets the bytes back by tensor name; when the transform
    failed, or changed a weight, it runs again on the whole model.
    """
    light = onnx.ModelProto()
    light.CopyFrom(model)
    held = {}  # name -> (the emptied tensor given to the transform, the original)
    for (name, tensor), (_, original) in zip(_named_tensors(light), _named_tensors(model)):
        if name not in held and _large_float(tensor):
            tensor.raw_data = b""
            held[name] = (tensor, original)
    if not held:
        return transform(model)
    try:
        result = transform(light)
    except Exception:  # perhaps for want of the bytes: the whole model decides, below
        result = None
    if result is None or not _put_back(result, held):
        result = transform(model)
    return result


def without_weight_bytes(model: onnx.ModelProto, any_type: bool = False) -> onnx.ModelProto:
    """A copy of the model without the bytes of its large float initializers (``any_type``: the
    integer ones too; dims and types stay), for a caller that keeps the graph after onnxruntime
    or the integer executor took the weights (verify's float model: about 90 MB of MiniLM's or a
    ViT-S's peak). A copy, because protobuf keeps a message's memory until the whole message
    goes: the caller lets go of the original. Built field by field: the model is not touched
    (emptying its tensors and putting their bytes back copied the weights twice, a ViT-S's
    verify peaked 150 MB higher for it)."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    for tensor in model.graph.initializer:
        if _large_float(tensor, any_type):
            shell = light.graph.initializer.add()
            shell.name, shell.data_type = tensor.name, tensor.data_type
            shell.dims.extend(tensor.dims)
        else:
            light.graph.initializer.append(tensor)
    return light


def _copy_fields(source, target, skip: str) -> None:
    """Every set field of protobuf message ``source`` but ``skip`` into ``target`` (a new one)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _named_tensors(model: onnx.ModelProto):
    """(name, tensor) for the initializers and the values of Constant nodes (by their output)."""
    for tensor in model.graph.initializer:
        yield tensor.name, tensor
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    yield node.output[0], attr.t


def _put_back(model: onnx.ModelProto, held: dict) -> bool:
    """Give the emptied tensors of ``model`` their bytes; False unless each came back unchanged."""
    found = 0
    for name, tensor in _named_tensors(model):
        if name in held:
            given, original = held[name]
            if tensor != given:
                return False
            tensor.CopyFrom(original)
            found += 1
    return found == len(held)


def normalize(model: onnx.ModelProto) -> None:
    """In place: Constant nodes become initializers, unused initializers go, every node gets a
    unique name. Run after anything that rewrites the graph (the optimizer, an opset upgrade)."""
    constants_to_initializers(model.graph)
    _drop_unused_initializers(model)
    _unique_body_values(model)
    _name_nodes(model)
    _explicit_same_pads(model)
    _name_cell_states(model)


def hoist_loop_constants(model: onnx.ModelProto) -> int:
    """In place: a Loop's carried value that starts as an initializer and that the body hands back
    unchanged (Paddle's exporter carries every weight of a decoder that way) is no longer carried:
    the body reads the initializer from the outer scope, where the integer kernels see a constant
    weight. The Loop's final value of it, where read, is the initializer. Loops in the main graph;
    returns how many values were hoisted."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    hoisted = 0
    for node in graph.node:
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        carried = len(node.input) - 2
        formal = [vi.name for vi in body.input]
        results = [vi.name for vi in body.output]
        invariant = [k for k in range(carried) if node.input[2 + k] in inits and results[1 + k] == formal[2 + k]
                     and node.output[k] not in outputs and results.count(formal[2 + k]) == 1]
        if not invariant:
            continue
        renamed = {formal[2 + k]: node.input[2 + k] for k in invariant}  # body: read the outer initializer
        for inner in all_nodes(body):
            for i, name in enumerate(inner.input):
                if name in renamed:
                    inner.input[i] = renamed[name]
        finals = {node.output[k]: node.input[2 + k] for k in invariant if node.output[k]}
        for other in all_nodes(graph):  # the Loop's final value is the initializer itself
            for i, name in enumerate(other.input):
                if name in finals:
                    other.input[i] = finals[name]
        drop = set(invariant)
        keep_inputs = [vi for i, vi in enumerate(body.input) if i < 2 or (i - 2) not in drop]
        keep_outputs = [vi for i, vi in enumerate(body.output) if i < 1 or (i - 1) not in drop]
        del body.input[:]
        body.input.extend(keep_inputs)
        del body.output[:]
        body.output.extend(keep_outputs)
        inputs = [n for i, n in enumerate(node.input) if i < 2 or (i - 2) not in drop]
        loop_outputs = [n for i, n in enumerate(node.output) if i not in drop]
        del node.input[:]
        node.input.extend(inputs)
        del node.output[:]
        node.output.extend(loop_outputs)
        hoisted += len(invariant)
    return hoisted


def constants_to_initializers(graph: onnx.GraphProto) -> None:
    """In place: the graph's Constant nodes (with a ``value`` tensor) become initializers."""
    keep = []
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value" and a.HasField("t")), None)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and value is not None:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value.t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            keep.append(node)
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)


SAME_PADDED = ("Conv", "MaxPool", "AveragePool")


def _explicit_same_pads(model: onnx.ModelProto) -> None:
    """In place: a Conv or pool with ``auto_pad`` SAME_UPPER/SAME_LOWER gets the explicit ``pads``
    that equal it, the odd one at the end (UPPER) or the start (LOWER). In total per axis
    ``(k - 1) * dilation`` at stride 1, whatever the input size; at stride ``s`` it depends on the
    input size ``n``, ``max((ceil(n / s) - 1) * s + (k - 1) * dilation + 1 - n, 0)``, so only an
    input whose spatial sizes the model fixes gets them (the node stays as it is otherwise). The
    integer kernels take explicit pads."""
    inits = {t.name: t for t in model.graph.initializer}
    shapes = None  # tensor -> dims (ints, None where open), inferred on first need
    for node in model.graph.node:
        if node.op_type not in SAME_PADDED or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: a for a in node.attribute}
        mode = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
        if mode not in ("SAME_UPPER", "SAME_LOWER"):
            continue
        kernel = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else None
        if kernel is None and node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in inits:
            kernel = list(inits[node.input[1]].dims[2:])
        if not kernel:
            continue
        strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * len(kernel)
        dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * len(kernel)
        totals = [(k - 1) * d for k, d in zip(kernel, dilations)]
        if any(s != 1 for s in strides):
            if shapes is None:
                shapes = _inferred_dims(model)
            sizes = (shapes.get(node.input[0]) or [])[2:]
            ceil_mode = "ceil_mode" in attrs and attrs["ceil_mode"].i
            if (len(sizes) != len(kernel) or None in sizes) and not ceil_mode and _ceil_same(node, mode, kernel,
                                                                                           strides, dilations):
                continue
            if len(sizes) != len(kernel) or None in sizes or ceil_mode:
                continue
            totals = [max((-(-n // s) - 1) * s + t + 1 - n, 0) for n, s, t in zip(sizes, strides, totals)]
        small = [t // 2 for t in totals]
        large = [t - t // 2 for t in totals]
        pads = small + large if mode == "SAME_UPPER" else large + small
        keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend(keep)
        node.attribute.append(onnx.helper.make_attribute("pads", pads))


def _ceil_same(node: onnx.NodeProto, mode: str, kernel: list, strides: list, dilations: list) -> bool:
    """In place, where it is the same: a MaxPool whose windows are 2 wide at stride 2 (or 1 at 1)
    with SAME_UPPER padding on inputs of any size as ``ceil_mode`` and no pads. Both give
    ``ceil(n / 2)`` outputs, SAME_UPPER by padding the end with at most one element, which a max
    ignores, ceil_mode by a last window that holds one (MTCNN's P-Net, any image size)."""
    if node.op_type != "MaxPool" or mode != "SAME_UPPER" or any(d != 1 for d in dilations) \
            or any((k, s) not in ((2, 2), (1, 1)) for k, s in zip(kernel, strides)):
        return False
    keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads", "ceil_mode")]
    del node.attribute[:]
    node.attribute.extend(keep)
    node.attribute.append(onnx.helper.make_attribute("ceil_mode", 1))
    return True


def _inferred_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each tensor's dims as shape inference finds them (ints, None where open)."""
    typed = without_weights(onnx.shape_inference.infer_shapes, model)
    return {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
            for vi in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]
            if vi.type.tensor_type.HasField("shape")}


def _unique_body_values(model: onnx.ModelProto) -> None:
    """In place: every value a subgraph defines (its inputs, initializers and node outputs) gets a
    name no other graph of the model uses. ONNX lets sibling bodies reuse a local name (an If's
    two branches each computing 't'); calibration tables and the quantizer key tensors by name, so
    each gets its own (``t`` and ``t_1``). The bodies' inputs and outputs are positional: renaming
    them changes nothing around them."""
    graph = model.graph
    seen = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    seen |= {o for node in graph.node for o in node.output if o}

    def fresh(name: str) -> str:
        k, candidate = 1, f"{name}_1"
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        return candidate

    def rename(sub: onnx.GraphProto, mapping: dict[str, str]) -> None:
        """``mapping`` applied to what ``sub`` and its own bodies read and write."""
        for node in sub.node:
            node.input[:] = [mapping.get(n, n) for n in node.input]
            node.output[:] = [mapping.get(n, n) for n in node.output]
            for inner in subgraphs(node):
                rename(inner, {k: v for k, v in mapping.items() if k not in _defined(inner)})
        for vi in [*sub.input, *sub.output, *sub.value_info]:
            vi.name = mapping.get(vi.name, vi.name)
        for t in sub.initializer:
            t.name = mapping.get(t.name, t.name)

    def visit(sub: onnx.GraphProto) -> None:
        for node in sub.node:
            for body in subgraphs(node):
                defined = _defined(body)
                mapping = {name: fresh(name) for name in defined if name in seen}
                seen.update(mapping.values())
                seen.update(defined - set(mapping))
                if mapping:
                    rename(body, mapping)
                visit(body)

    visit(graph)


def _defined(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` itself defines: its inputs, initializers and node outputs."""
    return ({vi.name for vi in graph.input} | {t.name for t in graph.initializer}
            | {o for node in graph.node for o in node.output if o})


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name: reports and --keep-float refer to nodes by name. A node
    inside an If, Loop or Scan body is named after where it is (``If_3/then_branch/Mul_0``)."""
    seen = set()

    def visit(graph: onnx.GraphProto, prefix: str) -> None:
        for i, node in enumerate(graph.node):
            if not node.name or node.name in seen:
                base, k = f"{prefix}{node.op_type}_{i}", 1
                node.name = base
                while node.name in seen:
                    node.name, k = f"{base}_{k}", k + 1
            seen.add(node.name)
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g, f"{node.name}/{attr.name}/")

    visit(model.graph, "")


def _name_cell_states(model: onnx.ModelProto) -> None:
    """In place: an LSTM that omits its last cell state output (Y_c) gets one, named after the
    node, so that calibration measures the cell's range (the integer LSTM's cell scale,
    qtool/ops/recurrent.py). The float model computes the same."""
    taken = {o for node in all_nodes(model.graph) for o in node.output} | {i.name for i in model.graph.input}
    taken |= {t.name for t in model.graph.initializer}
    for node in all_nodes(model.graph):  # inside If, Loop and Scan bodies too
        if node.op_type != "LSTM" or node.domain not in ("", "ai.onnx") or (len(node.output) > 2 and node.output[2]):
            continue
        name, k = f"{node.name}_Y_c", 1
        while name in taken:
            name, k = f"{node.name}_Y_c_{k}", k + 1
        taken.add(name)
        while len(node.output) < 3:
            node.output.append("")
        node.output[2] = name


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    """Initializers no node reads, in the main graph or in a subgraph (which reads the main
    graph's initializers by name, from the outer scope), and no output is."""
    used = names_read(model.graph.node)
    used.update(o.name for o in model.graph.output)
    initializers = model.graph.initializer
    for i in reversed(range(len(initializers))):  # deleted where they are: the others are not copied
        if initializers[i].name not in used:
            del initializers[i]


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds (initializers listed as inputs are excluded)."""
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def input_shape(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    dims = vi.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]


def fixed_size(dim) -> bool:
    """A dim the model fixes (a positive number, not a name or unknown)."""
    return isinstance(dim, int) and dim > 0


def open_first(dims: list) -> bool:
    """An input's first size is open (a batch, or the frames of a model without one)."""
    return bool(dims) and not fixed_size(dims[0])


def state_inputs(model: onnx.ModelProto) -> set[str]:
    """The inputs fixed above 1 in every size beside an input whose first size is open: states
    fed whole to every run, whose first size is no batch (madmom's beat trackers take frames
    [T, 266] and states [25])."""
    shapes = {vi.name: input_shape(vi) for vi in graph_inputs(model)}
    if not any(open_first(dims) for dims in shapes.values()):
        return set()
    return {name for name, dims in shapes.items() if dims and all(fixed_size(d) for d in dims) and dims[0] > 1}


def float_tensors(model: onnx.ModelProto) -> list[str]:
    """Names of float activations in graph order: inputs, then each node's outputs."""
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    names = [vi.name for vi in graph_inputs(model) if types.get(vi.name) in FLOAT_TYPES]
    for node in model.graph.node:
        names.extend(o for o in node.output if o and types.get(o) in FLOAT_TYPES)
    return list(dict.fromkeys(names))


def batch_hint(feeds: dict) -> str:
    """What to add to an error from a run of several samples: the model may take only one (a
    Reshape to a fixed leading 1 behind an input that says N)."""
    sizes = {np.shape(v)[0] for v in feeds.values() if np.ndim(v)}
    return (f" (on a batch of {max(sizes)} samples; if the model runs one sample at a time, add --batch-size 1)"
            if sizes and max(sizes) > 1 else "")


class FloatRunner:
    """An onnxruntime session on the float model that also returns chosen intermediate tensors."""

    def __init__(self, model: onnx.ModelProto, extra_outputs: list[str] = (), threads: int = 0,
                 arena: bool = True, prepack: bool = True, spinning: bool = True, layouts: bool = True):
        """A session on ``model`` (prepared already, so onnxruntime's default optimizations apply
        on top) returning its outputs plus ``extra_outputs``. ``prepack=False``: onnxruntime keeps
        the weights as given, not also in its GEMM kernels' packed layout (a ViT-S's session: 220
        -> 165 MB, its run about 15% slower). ``spinning=False``: its threads sleep between
        kernels instead of spinning, for a caller that computes on another thread meanwhile.
        ``layouts=False``: without onnxruntime's layout optimizations (its blocked NCHWc convs),
        for a graph that reads every activation (see qtool.stats_graph), and for every float
        tensor that decides what a quantized model holds: the blocked convs add their products
        in blocks of the CPU's vector width (16 channels with AVX-512, 8 with AVX2), so their
        last bits differ between CPUs. On opennsfw (a ResNet-50), 47 of its 50 Conv/Gemm inputs
        differed between this AVX-512 host and an AVX2 one (qemu -cpu EPYC-Rome), and so did its
        calibration table; without them none did (bench/cpus.py)."""
        known = {o.name for o in model.graph.output}
        value_info = {vi.name: vi for vi in model.graph.value_info}
        added = [value_info.get(name) or onnx.ValueInfoProto(name=name)
                 for name in extra_outputs if name not in known]
        # appended to the caller's model for the serialization only: a copy would copy the weights
        outputs = len(model.graph.output)
        model.graph.output.extend(added)
        try:
            serialized = model.SerializeToString()
        finally:
            del model.graph.output[outputs:]
        options = ort.SessionOptions()
        options.log_severity_level = 4  # errors come back as exceptions, told in one line
        # run each node's consumers soon after it, so tensors are freed early: with every tensor
        # an output (or reduced), the default order keeps a whole batch's activations alive
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        if threads:
            options.intra_op_num_threads = threads
        options.enable_cpu_mem_arena = arena
        if not layouts:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        """The outputs (``names`` of them only: onnxruntime then keeps no other tensor)."""
        names = names or self.output_names
        try:
            values = self.session.run(names, feeds)
        except Exception as e:
            raise QtoolError(f"onnxruntime failed on the float model: {first_line(e)}{batch_hint(feeds)}") from None
        return dict(zip(names, values))


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers' values, from their dims and types (nothing is copied: upb's
    ``ByteSize`` serializes the whole model to count)."""
    total = 0
    for t in model.graph.initializer:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type) if t.data_type else np.dtype(np.uint8)
        total += math.prod(t.dims) * dtype.itemsize
    return total


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
