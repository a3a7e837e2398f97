"""Graph rewrites that turn exported decompositions back into the one op they stand for.

PP-LCNet (PP-OCRv4) follows convolutions with a learnable affine block, ``Mul(scalar)`` then
``Add(scalar)``: folded into the convolution's weights and bias, they cost nothing.

PaddlePaddle's exporter (PP-OCR) writes HardSwish as ``x * clip(x + 3, 0, 6) / 6``: four nodes,
three intermediate tensors, and three requantizations if each were quantized on its own. As one
``HardSwish`` node (opset 14) it is one 256-entry lookup table, and calibration has three fewer
tensors to watch. ``Mul(x, HardSigmoid(x))`` with HardSwish's slope and offset is fused alike.

Exporters write LayerNorm as ``(x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta``
(ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add: PP-OCRv4's SVTR blocks). As one
``LayerNormalization`` node (opset 17) it is one integer kernel (qtool/ops/normalization.py) and
one requantization, where the pieces would round the variance and the normalized values to 8 bits.

Exporters write GELU as ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` (PP-OCRv6's SVTR blocks, PyTorch's
``nn.GELU``) or, approximated, ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``: five to
nine nodes, each a requantization. As one ``Gelu`` node (opset 20; ``approximate='tanh'`` for the
second) it is one lookup table (qtool/ops/lut.py). onnxruntime's ``com.microsoft`` Gelu and FastGelu
without a bias are the same functions and become the same node.

PyTorch writes ``x[:, i]`` and ``select`` (the Q, K and V of a packed attention projection) as a
Gather by a constant scalar index; as Slice and Squeeze the same values move by integer
data-movement ops, where a Gather of an activation would run float. A Gather by a constant list
of indices (YOLOX's Focus reorders a SpaceToDepth's channels so) becomes a Slice per run of
consecutive indices and a Concat.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import permutations

import numpy as np
import onnx
from onnx import helper

HARDSWISH_OPSET = 14
LAYERNORM_OPSET = 17
GELU_OPSET = 20
SELECT_OPSET = 13  # Squeeze's axes as an input
SOFTMAX_OPSET = 13  # Softmax over one axis


def _scalar(inits: dict[str, onnx.TensorProto], name: str) -> float | None:
    tensor = inits.get(name)
    if tensor is None:
        return None
    value = onnx.numpy_helper.to_array(tensor)
    return float(value.reshape(-1)[0]) if value.size == 1 else None


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        self.inits = {t.name: t for t in model.graph.initializer}
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in model.graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.outputs = {o.name for o in model.graph.output}
        # ranks where shape inference (or the model) declares them
        self.ranks = {vi.name: len(vi.type.tensor_type.shape.dim)
                      for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]
                      if vi.type.tensor_type.HasField("shape")}

    def private(self, name: str) -> onnx.NodeProto | None:
        """The producer of ``name`` when exactly one node reads it and it is no graph output."""
        if name in self.outputs or len(self.consumers.get(name, [])) != 1:
            return None
        return self.producer.get(name)

    def constant_operand_any(self, node: onnx.NodeProto) -> tuple[str, str] | None:
        """(the other input, the constant's name) for a binary node with one constant input."""
        if len(node.input) != 2:
            return None
        for i in (0, 1):
            if node.input[i] in self.inits and node.input[1 - i] not in self.inits:
                return node.input[1 - i], node.input[i]
        return None

    def constant_operand(self, node: onnx.NodeProto) -> tuple[str, float] | None:
        """(the other input, the value) for a binary node with one scalar constant input."""
        found = self.constant_operand_any(node)
        value = None if found is None else _scalar(self.inits, found[1])
        return None if value is None else (found[0], value)


def _match_clip_form(g: _Graph, div: onnx.NodeProto):
    """``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)`` -> (x, the four nodes) or None."""
    if div.op_type != "Div" or _scalar(g.inits, div.input[1]) != 6.0:
        return None
    mul = g.private(div.input[0])
    if mul is None or mul.op_type != "Mul":
        return None
    for clip_in, x in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
        clip = g.private(clip_in)
        if clip is None or clip.op_type != "Clip" or len(clip.input) != 3:
            continue
        if _scalar(g.inits, clip.input[1]) != 0.0 or _scalar(g.inits, clip.input[2]) != 6.0:
            continue
        add = g.private(clip.input[0])
        if add is None or add.op_type != "Add" or g.constant_operand(add) != (x, 3.0):
            continue
        return x, [add, clip, mul, div]
    return None


def _match_hardsigmoid_form(g: _Graph, mul: onnx.NodeProto):
    """``Mul(x, HardSigmoid(x, alpha=1/6, beta=0.5))`` -> (x, the two nodes) or None."""
    if mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    for hs_in, x in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
        hs = g.private(hs_in)
        if hs is None or hs.op_type != "HardSigmoid" or hs.input[0] != x:
            continue
        attrs = {a.name: a.f for a in hs.attribute}
        if np.isclose(attrs.get("alpha", 0.2), 1 / 6, rtol=1e-6) and attrs.get("beta", 0.5) == 0.5:
            return x, [hs, mul]
    return None


def find_hardswish(model: onnx.ModelProto) -> list[tuple[str, list[onnx.NodeProto]]]:
    g = _Graph(model)
    found = []
    for node in model.graph.node:
        match = _match_clip_form(g, node) or _match_hardsigmoid_form(g, node)
        if match:
            found.append(match)
    return found


def fuse_hardswish(model: onnx.ModelProto, matches) -> None:
    """In place: each match becomes one HardSwish node at the position of its last node, writing
    the last node's output (so tensor names downstream stay). The model must be at opset >= 14."""
    _replace(model, [(nodes, helper.make_node("HardSwish", [x], [nodes[-1].output[0]], name=nodes[-1].name))
                     for x, nodes in matches])


def _replace(model: onnx.ModelProto, groups: list[tuple[list[onnx.NodeProto], onnx.NodeProto | list]]) -> None:
    """In place: each group of nodes gives way to its new node (or nodes, in order), at the place
    of its last."""
    replace = {nodes[-1].name: new if isinstance(new, list) else [new] for nodes, new in groups}
    drop = {n.name for nodes, _ in groups for n in nodes[:-1]}
    kept = [m for n in model.graph.node if n.name not in drop for m in replace.get(n.name, [n])]
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _written_axes(g: _Graph, node: onnx.NodeProto) -> tuple[int, ...] | None:
    """A reduction's axes as written: the attribute, or from opset 18 a constant input; () where
    none is given, None where the input is not a constant."""
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in g.inits:
            return None
        return tuple(int(a) for a in onnx.numpy_helper.to_array(g.inits[node.input[1]]).reshape(-1))
    return tuple(int(a) for a in next((helper.get_attribute_value(a) for a in node.attribute
                                       if a.name == "axes"), []))


def _reduced_axes(g: _Graph, node: onnx.NodeProto) -> tuple[int, ...] | None:
    """A ReduceMean's axes when it keeps dims and they are the last ones, counted from the end
    (-k, ..., -1); None otherwise (positive axes need the rank, which is not read here)."""
    if node.op_type != "ReduceMean":
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axes = _written_axes(g, node)
    if not axes or attrs.get("keepdims", 1) != 1:
        return None
    axes = tuple(sorted(int(a) for a in axes))
    return axes if axes == tuple(range(-len(axes), 0)) else None


def _row_constant(g: _Graph, name: str, k: int) -> np.ndarray | None:
    """A constant as the shape of a row of the last ``k`` dims (leading 1s dropped), if it is one."""
    if name not in g.inits:
        return None
    value = onnx.numpy_helper.to_array(g.inits[name])
    while value.ndim > k and value.shape[0] == 1:
        value = value[0]
    return value if value.ndim == k and value.size > 1 else None


def _raw_axes(g: _Graph, node: onnx.NodeProto) -> tuple[int, ...] | None:
    """A ReduceMean's axes as written (attribute or constant input) when it keeps dims."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axes = _written_axes(g, node)
    if node.op_type != "ReduceMean" or not axes or attrs.get("keepdims", 1) != 1:
        return None
    return tuple(int(a) for a in axes)


def _match_layernorm(g: _Graph, div: onnx.NodeProto):
    """``Div(Sub(x, ReduceMean(x)), Sqrt(Add(ReduceMean(Pow(Sub, 2)), eps)))``, then ``Mul(gamma)``
    and ``Add(beta)`` -> (x, gamma, beta or None, axis, eps, the nodes, perm or None) or None. The
    gamma is required: the row's length comes from it.

    Paddle's exporter also writes the form where the centred tensor is transposed before the
    variance: ``Transpose(Sub(x, ReduceMean(x, axis=a)), perm)`` with ``perm`` moving ``a`` last
    (PP-OCRv6 rec); that is ``LayerNormalization(Transpose(x, perm))`` over the last axis, and
    ``perm`` is returned for it."""
    if div.op_type != "Div":
        return None
    centred, sqrt = g.producer.get(div.input[0]), g.private(div.input[1])
    transpose, sub = None, centred
    if centred is not None and centred.op_type == "Transpose":
        transpose, sub = centred, g.private(centred.input[0])
    if sub is None or sub.op_type != "Sub" or sqrt is None or sqrt.op_type != "Sqrt":
        return None
    add_eps = g.private(sqrt.input[0])
    found = None if add_eps is None or add_eps.op_type != "Add" else g.constant_operand(add_eps)
    if found is None:
        return None
    variance_in, eps = found
    variance = g.private(variance_in)
    square = None if variance is None else g.private(variance.input[0])
    if square is None or not (
            (square.op_type == "Pow" and len(square.input) == 2 and square.input[0] == centred.output[0]
             and _scalar(g.inits, square.input[1]) == 2.0)
            or (square.op_type == "Mul" and list(square.input) == [centred.output[0]] * 2)):
        return None
    mean = g.private(sub.input[1])
    axes = _reduced_axes(g, variance)
    if mean is None or mean.input[0] != sub.input[0] or axes is None:
        return None
    perm = None
    if transpose is None:
        if _reduced_axes(g, mean) != axes:
            return None
    else:
        perm = [int(p) for p in next((helper.get_attribute_value(a) for a in transpose.attribute
                                      if a.name == "perm"), [])]
        mean_axes = _raw_axes(g, mean)
        if (axes != (-1,) or not perm or mean_axes is None or len(mean_axes) != 1
                or not -len(perm) <= mean_axes[0] < len(perm) or perm[-1] != mean_axes[0] % len(perm)):
            return None
    if centred.output[0] in g.outputs or {n.name for n in g.consumers[centred.output[0]]} != {square.name, div.name}:
        return None
    nodes = [mean, sub] + ([transpose] if transpose is not None else []) + [square, variance, add_eps, sqrt, div]
    mul = g.consumers[div.output[0]]
    if len(mul) != 1 or div.output[0] in g.outputs or mul[0].op_type != "Mul":
        return None
    found = g.constant_operand_any(mul[0])
    gamma = None if found is None or found[0] != div.output[0] else _row_constant(g, found[1], len(axes))
    if gamma is None:
        return None
    nodes.append(mul[0])
    beta = None
    add = g.consumers[mul[0].output[0]]
    if len(add) == 1 and mul[0].output[0] not in g.outputs and add[0].op_type == "Add":
        found = g.constant_operand_any(add[0])
        if found is not None and found[0] == mul[0].output[0] and found[1] in g.inits:
            value = onnx.numpy_helper.to_array(g.inits[found[1]])
            if value.size in (1, gamma.size):
                beta = np.broadcast_to(value.reshape(-1), (gamma.size,)).reshape(gamma.shape)
                nodes.append(add[0])
    return sub.input[0], gamma, beta, -len(axes), eps, nodes, perm


def _through_broadcasts(g: _Graph, name: str) -> tuple[str, list[onnx.NodeProto]]:
    """The tensor under a chain of Reshape / Expand / Unsqueeze nodes (each read only by the next;
    jax2tf writes a reduced tensor back to the input's rank so), and those nodes, producers first."""
    nodes = []
    node = g.private(name)
    while node is not None and node.op_type in ("Reshape", "Expand", "Unsqueeze"):
        nodes.insert(0, node)
        name = node.input[0]
        node = g.private(name)
    return name, nodes


def _row_mean(g: _Graph, name: str) -> tuple[str, int, float | None, list[onnx.NodeProto]] | None:
    """(x, axis, 1/N or None, nodes) when ``name`` is ``ReduceSum(x, [axis]) * (1/N)`` (N to be
    checked by the caller) or ``ReduceMean(x, [axis])``, one axis, as written (possibly negative)."""
    node = g.producer.get(name)
    scale, nodes = None, []
    if node is not None and node.op_type == "Mul" and (found := g.constant_operand(node)) is not None:
        scale, nodes = found[1], [node]
        node = g.private(found[0])
    if node is None or node.op_type not in ("ReduceSum", "ReduceMean") or (node.op_type == "ReduceSum") != (
            scale is not None):
        return None
    axes = _written_axes(g, node)
    if not axes or len(axes) != 1:
        return None
    return node.input[0], int(axes[0]), scale, [node, *nodes]


def _match_layernorm_moments(g: _Graph, node: onnx.NodeProto):
    """LayerNorm written from the moments, as jax2tf exports flax's LayerNorm (Magika):
    ``(x - B(m)) * (Reciprocal(Sqrt(B(max(0, m2 - m*m)) + eps)) * gamma) [+ beta]`` with ``m`` and
    ``m2`` the means of ``x`` and ``x*x`` over one axis (``ReduceSum * 1/N`` or ``ReduceMean``) and
    ``B`` Reshape/Expand back to the input's rank. ``gamma`` (and ``beta``) hold one value per row
    position along that axis and 1 elsewhere; their rank is the input's, which gives the axis.
    -> (x, gamma row, beta row or None, eps, the nodes, perm or None): ``perm`` moves the axis last
    when it is not (the group becomes Transpose, LayerNormalization, Transpose back)."""
    if node.op_type != "Mul" or len(node.input) != 2:
        return None
    for centred_name, scale_name in (node.input, node.input[::-1]):
        sub, scale = g.private(centred_name), g.private(scale_name)
        if sub is None or sub.op_type != "Sub" or scale is None or scale.op_type != "Mul":
            continue
        found = g.constant_operand_any(scale)
        if found is None or found[1] not in g.inits:
            continue
        gamma = onnx.numpy_helper.to_array(g.inits[found[1]]).astype(np.float64)
        reciprocal = g.private(found[0])
        sqrt = g.private(reciprocal.input[0]) if reciprocal is not None and reciprocal.op_type == "Reciprocal" else None
        add_eps = g.private(sqrt.input[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
        eps = None if add_eps is None or add_eps.op_type != "Add" else g.constant_operand(add_eps)
        if eps is None or eps[1] < 0:
            continue
        variance, spread = _through_broadcasts(g, eps[0])
        guard = g.private(variance)
        nodes = []
        if guard is not None and guard.op_type == "Max" and (bound := g.constant_operand(guard)) is not None \
                and bound[1] == 0.0:
            nodes.append(guard)
            guard = g.private(bound[0])
        if guard is None or guard.op_type != "Sub":
            continue
        second = _row_mean(g, guard.input[0])
        square = g.producer.get(guard.input[1])
        x_mean, spread_mean = _through_broadcasts(g, sub.input[1])
        first = _row_mean(g, x_mean)
        if second is None or first is None or square is None or square.op_type != "Mul" \
                or list(square.input) != [x_mean, x_mean] or first[0] != sub.input[0]:
            continue
        x, axis, inverse, mean_nodes = first
        x_square = g.private(second[0])
        if (x_square is None or x_square.op_type != "Mul" or list(x_square.input) != [x, x]
                or second[1] != axis or second[2] != inverse):
            continue
        # gamma aligns with x's trailing dims: its one dim of size > 1 must be the reduced axis,
        # counted from the end. x's rank (declared, else gamma's where the axis is counted from
        # the start and equals gamma's own index) places a positive axis and the Transposes.
        rows = [j for j, d in enumerate(gamma.shape) if d > 1]
        if len(rows) != 1 or gamma.shape[rows[0]] != gamma.size:
            continue
        rank = g.ranks.get(x) or (gamma.ndim if axis >= 0 and axis == rows[0] else None)
        from_end = axis if axis < 0 else (axis - rank if rank is not None else None)
        if from_end is None or from_end != rows[0] - gamma.ndim or (rank is not None and rank < gamma.ndim):
            continue
        last = from_end == -1
        if not last and rank is None:  # the Transposes need the rank
            continue
        axis = rank + from_end if rank is not None else -1
        if inverse is not None and not math.isclose(inverse, 1.0 / gamma.size, rel_tol=1e-6):
            continue
        group = [*mean_nodes, *spread_mean, sub, square, x_square, *second[3], guard, *nodes, *spread,
                 add_eps, sqrt, reciprocal, scale, node]
        # every tensor inside is read inside only (the mean twice: its broadcast and its square)
        inside = {n.name for n in group}
        if any(o in g.outputs or any(c.name not in inside for c in g.consumers.get(o, []))
               for n in group[:-1] for o in n.output):
            continue
        beta = None
        readers = g.consumers.get(node.output[0], [])
        if len(readers) == 1 and node.output[0] not in g.outputs and readers[0].op_type == "Add":
            found = g.constant_operand_any(readers[0])
            if found is not None and found[0] == node.output[0]:
                value = onnx.numpy_helper.to_array(g.inits[found[1]]).astype(np.float64)
                if value.size in (1, gamma.size) and (value.size == 1 or value.shape == gamma.shape):
                    beta = np.broadcast_to(value.reshape(-1), (gamma.size,)).copy()
                    group.append(readers[0])
        perm = None if last else [i for i in range(rank) if i != axis] + [axis]
        return x, gamma.reshape(-1), beta, eps[1], group, perm
    return None


def find_layernorm(model: onnx.ModelProto) -> list:
    g = _Graph(model)
    found = [match for node in model.graph.node if (match := _match_layernorm(g, node)) is not None]
    moments = [match for node in model.graph.node if (match := _match_layernorm_moments(g, node)) is not None]
    return found + [("moments", *match) for match in moments]


def fuse_layernorm(model: onnx.ModelProto, matches) -> None:
    """In place: each match becomes one LayerNormalization node (opset >= 17) writing the output
    of its last node, gamma and beta as new initializers (float32); the transposed form becomes
    the Transpose of the input, then the LayerNormalization."""
    inits = {t.name: t for t in model.graph.initializer}
    groups = []
    for match in matches:
        if match[0] == "moments":
            groups.append(_moments_group(model, inits, *match[1:]))
            continue
        x, gamma, beta, axis, eps, nodes, perm = match
        last = nodes[-1]
        new = []
        if perm is not None:
            transposed = _fresh_name(model, f"{last.name}_transposed")
            new.append(helper.make_node("Transpose", [x], [transposed], name=transposed, perm=perm))
            x = transposed
        inputs = [x, _fresh_init(model, inits, f"{last.name}_scale", gamma.astype(np.float32))]
        if beta is not None:
            inputs.append(_fresh_init(model, inits, f"{last.name}_bias", beta.astype(np.float32)))
        new.append(helper.make_node("LayerNormalization", inputs, [last.output[0]], name=last.name,
                                    axis=axis, epsilon=float(eps)))
        groups.append((nodes, new))
    _replace(model, groups)


def _moments_group(model, inits, x, gamma, beta, eps, nodes, perm):
    """The nodes that replace a LayerNorm written from the moments: LayerNormalization over the
    last axis, between two Transposes when the normalized axis is another."""
    last = nodes[-1]
    new, out = [], last.output[0]
    if perm is not None:
        transposed = _fresh_name(model, f"{last.name}_transposed")
        new.append(helper.make_node("Transpose", [x], [transposed], name=transposed, perm=perm))
        x = transposed
        out = _fresh_name(model, f"{last.name}_normalized")
    inputs = [x, _fresh_init(model, inits, f"{last.name}_scale", gamma.astype(np.float32))]
    if beta is not None:
        inputs.append(_fresh_init(model, inits, f"{last.name}_bias", beta.astype(np.float32)))
    new.append(helper.make_node("LayerNormalization", inputs, [out], name=out if perm is not None else last.name,
                                axis=-1, epsilon=float(eps)))
    if perm is not None:
        back = [int(i) for i in np.argsort(perm)]
        new.append(helper.make_node("Transpose", [out], [last.output[0]], name=last.name, perm=back))
    return nodes, new


def _per_channel(value: np.ndarray, channels: int) -> np.ndarray | None:
    """A constant that broadcasts over a Conv output [N, C, H, W] as one value per channel:
    a scalar, [C, 1, 1] or [1, C, 1, 1]."""
    if value.size == 1:
        return np.full(channels, value.reshape(-1)[0], dtype=np.float64)
    if value.ndim in (3, 4) and value.shape[-3] == channels and value.size == channels:
        return value.reshape(-1).astype(np.float64)
    return None


def fold_affine_into_conv(model: onnx.ModelProto) -> int:
    """In place: ``Conv -> Mul(c) -> Add(b)`` with per-channel or scalar constants becomes one Conv
    with ``W' = W * c`` and ``B' = B * c + b`` (PP-LCNet's learnable affine blocks); likewise an
    inference BatchNormalization (``c = gamma / sqrt(var + eps)``, ``b = beta - mean c``), and
    after a ConvTranspose of one group (PP-OCRv4 det's upsampling: ConvTranspose, Add(bias),
    BatchNormalization, which onnxruntime's optimizer does not fold). Exact up to float rounding,
    and one requantization instead of three. Returns the number of folds.

    One pass in graph order: a fold only changes what nodes after the folded one see (the conv now
    writes the folded node's output), so the indices are updated in place, not rebuilt.
    """
    g = _Graph(model)
    nodes = list(model.graph.node)
    folded = set()  # positions in nodes
    for i, node in enumerate(nodes):
        match = _affine_after_conv(g, node)
        if match is None:
            continue
        conv, weight, scale, shift = match
        axis = 1 if conv.op_type == "ConvTranspose" else 0  # the output channels of the weight
        bias = np.zeros(weight.shape[axis], np.float64)
        if len(conv.input) > 2 and conv.input[2]:
            bias = onnx.numpy_helper.to_array(g.inits[conv.input[2]]).astype(np.float64)
        shape = [1] * weight.ndim
        shape[axis] = -1
        weight = weight * scale.reshape(shape).astype(weight.dtype)
        bias = bias * scale + shift
        w_name = _fresh_init(model, g.inits, f"{conv.name}_w_folded", weight.astype(np.float32))
        b_name = _fresh_init(model, g.inits, f"{conv.name}_b_folded", bias.astype(np.float32))
        new_inputs = [conv.input[0], w_name, b_name]
        del conv.input[:]
        conv.input.extend(new_inputs)
        conv.output[0] = node.output[0]
        g.producer[node.output[0]] = conv
        folded.add(i)
    if folded:
        kept = [n for i, n in enumerate(nodes) if i not in folded]
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return len(folded)


def _affine_after_conv(g: _Graph, node: onnx.NodeProto):
    """(the conv, its weight, per-channel scale and shift) when ``node`` is a Mul or Add of a
    constant that broadcasts per channel, or an inference BatchNormalization, over the output of a
    Conv (or a one-group ConvTranspose) with constant weights, read only by it."""
    if node.op_type == "BatchNormalization":
        if len(node.output) > 1 or not all(n in g.inits for n in node.input[1:5]):
            return None
        x = node.input[0]
    elif node.op_type in ("Mul", "Add"):
        operand = g.constant_operand_any(node)
        if operand is None:
            return None
        x, const_name = operand
    else:
        return None
    conv = g.private(x)
    if conv is None or conv.op_type not in ("Conv", "ConvTranspose") or conv.input[1] not in g.inits:
        return None
    if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in g.inits:
        return None
    weight = onnx.numpy_helper.to_array(g.inits[conv.input[1]])
    if weight.ndim != 4:
        return None
    if conv.op_type == "ConvTranspose":
        if any(a.name == "group" and a.i != 1 for a in conv.attribute):
            return None
        channels = weight.shape[1]
    else:
        channels = weight.shape[0]
    if node.op_type == "BatchNormalization":
        gamma, beta, mean, var = (onnx.numpy_helper.to_array(g.inits[n]).astype(np.float64).reshape(-1)
                                  for n in node.input[1:5])
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        if gamma.size != channels:
            return None
        scale = gamma / np.sqrt(var + np.float64(np.float32(eps)))
        return conv, weight, scale, beta - mean * scale
    values = _per_channel(onnx.numpy_helper.to_array(g.inits[const_name]), channels)
    if values is None:
        return None
    if node.op_type == "Mul":
        return conv, weight, values, np.zeros(channels)
    return conv, weight, np.ones(channels), values


def _fresh_name(model: onnx.ModelProto, base: str) -> str:
    """``base`` (or ``base_1``, ...): the first name no node, tensor or initializer has."""
    taken = ({n.name for n in model.graph.node} | {t for n in model.graph.node for t in n.output}
             | {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer})
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _fresh_init(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto], base: str,
                array: np.ndarray) -> str:
    """Add ``array`` as an initializer named ``base`` (or ``base_1``, ...: the first name not in
    ``inits``, the graph's initializers, which it joins)."""
    name, k = base, 1
    while name in inits:
        name, k = f"{base}_{k}", k + 1
    model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
    inits[name] = model.graph.initializer[-1]
    return name


def _near(g: _Graph, name: str, target: float) -> bool:
    """``name`` is a scalar constant equal to ``target`` up to float32 rounding and the digits an
    exporter prints (1.4142135, 0.7978845)."""
    value = _scalar(g.inits, name)
    return value is not None and math.isclose(value, target, rel_tol=1e-6)


def _private_op(g: _Graph, name: str, op_type: str) -> onnx.NodeProto | None:
    node = g.private(name)
    return node if node is not None and node.op_type == op_type else None


def _scaled(g: _Graph, name: str, factor: float, x: str | None = None) -> tuple[str, onnx.NodeProto] | None:
    """(the operand, the node) when ``name`` is written only by ``Mul(operand, factor)`` (either
    order) or ``Div(operand, 1 / factor)``, for the operand ``x`` when given."""
    node = g.private(name)
    if node is None or len(node.input) != 2:
        return None
    if node.op_type == "Div" and node.input[0] not in g.inits and _near(g, node.input[1], 1.0 / factor):
        operand = node.input[0]
    elif node.op_type == "Mul" and (found := g.constant_operand_any(node)) and _near(g, found[1], factor):
        operand = found[0]
    else:
        return None
    return (operand, node) if x is None or operand == x else None


def _mul_factors(g: _Graph, mul: onnx.NodeProto, inner: list[onnx.NodeProto]) -> list[str]:
    """The factors of ``mul`` with at most one more Mul that only it reads expanded (appended to
    ``inner``): ``Mul(Mul(a, b), c)``, ``Mul(a, Mul(b, c))`` -> [a, b, c]."""
    factors = []
    for name in mul.input:
        node = _private_op(g, name, "Mul") if not inner else None
        if node is not None and len(node.input) == 2:
            inner.append(node)
            factors += list(node.input)
        else:
            factors.append(name)
    return factors


def _cube(g: _Graph, name: str, x: str) -> list[onnx.NodeProto] | None:
    """The nodes of ``x^3`` written as ``Pow(x, 3)`` or ``Mul(x, Mul(x, x))`` (either order)."""
    node = g.private(name)
    if node is None or len(node.input) != 2:
        return None
    if node.op_type == "Pow":
        return [node] if node.input[0] == x and _scalar(g.inits, node.input[1]) == 3.0 else None
    if node.op_type != "Mul" or x not in node.input:
        return None
    square = _private_op(g, node.input[1] if node.input[0] == x else node.input[0], "Mul")
    return [square, node] if square is not None and list(square.input) == [x, x] else None


def _product(g: _Graph, name: str, depth: int = 4) -> tuple[list[str], list[onnx.NodeProto]]:
    """The factors of ``name`` through Mul nodes only their product reads (at most ``depth``
    levels), and those nodes in graph order (producers first)."""
    node = _private_op(g, name, "Mul")
    if node is None or depth == 0 or len(node.input) != 2:
        return [name], []
    leaves, nodes = [], []
    for operand in node.input:
        more, inner = _product(g, operand, depth - 1)
        leaves += more
        nodes += inner
    return leaves, nodes + [node]


def _gelu_inner(g: _Graph, name: str, x: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(approximate, the nodes) when ``name`` is ``1 + Erf(x / sqrt(2))`` or ``1 + Tanh(sqrt(2/pi)
    * (x + 0.044715 * x^3))``, every intermediate read only by the next node."""
    add = _private_op(g, name, "Add")
    found = None if add is None else g.constant_operand(add)
    if found is None or found[1] != 1.0:
        return None
    inner = g.private(found[0])
    if inner is not None and inner.op_type == "Erf":
        scaled = _scaled(g, inner.input[0], 1.0 / math.sqrt(2.0), x)
        return None if scaled is None else ("none", [scaled[1], inner, add])
    if inner is None or inner.op_type != "Tanh":
        return None
    scaled = _scaled(g, inner.input[0], math.sqrt(2.0 / math.pi))
    total = None if scaled is None else _private_op(g, scaled[0], "Add")
    if total is None or x not in total.input:
        return None
    term = total.input[1] if total.input[0] == x else total.input[0]
    cubic = _scaled(g, term, 0.044715)
    cube = None if cubic is None else _cube(g, cubic[0], x)
    if cube is not None:
        return "tanh", [*cube, cubic[1], total, scaled[1], inner, add]
    leaves, nodes = _product(g, term)  # 0.044715 innermost (jax2tf: x * (x * (0.044715 * x)))
    constants = [name for name in leaves if name in g.inits]
    if sorted(n for n in leaves if n not in g.inits) != [x, x, x] or len(constants) != 1 \
            or not _near(g, constants[0], 0.044715):
        return None
    return "tanh", [*nodes, total, scaled[1], inner, add]


def _match_gelu(g: _Graph, node: onnx.NodeProto):
    """The last Mul of ``x * 0.5 * (1 + f(x))`` in any grouping and operand order, f the erf or
    tanh inner part -> (x, approximate, the nodes, the last one last) or None. A com.microsoft
    Gelu, or FastGelu without a bias, -> (x, approximate, [node])."""
    if node.domain == "com.microsoft" and node.op_type in ("Gelu", "FastGelu"):
        if len([name for name in node.input if name]) != 1:
            return None
        return node.input[0], "tanh" if node.op_type == "FastGelu" else "none", [node]
    if node.op_type != "Mul" or len(node.input) != 2:
        return None
    inner: list[onnx.NodeProto] = []
    factors = _mul_factors(g, node, inner)
    if len(factors) != 3 or len(inner) != 1:
        return None
    for x, half, one_plus in permutations(factors):
        if x in g.inits or not _near(g, half, 0.5):
            continue
        found = _gelu_inner(g, one_plus, x)
        if found is not None:
            return x, found[0], [*found[1], *inner, node]
    return None


def find_gelu(model: onnx.ModelProto) -> list:
    if not onnx.defs.has("Gelu"):
        return []
    g = _Graph(model)
    return [match for node in model.graph.node if (match := _match_gelu(g, node)) is not None]


def fuse_gelu(model: onnx.ModelProto, matches) -> None:
    """In place: each match becomes one Gelu node (opset >= 20) writing its last node's output."""
    groups = []
    for x, approximate, nodes in matches:
        attrs = {"approximate": approximate} if approximate != "none" else {}
        groups.append((nodes, helper.make_node("Gelu", [x], [nodes[-1].output[0]], name=nodes[-1].name, **attrs)))
    _replace(model, groups)


def _one_axis(g: _Graph, node: onnx.NodeProto) -> int | None:
    """The single axis a reduction reads (attribute or constant input), or None."""
    axes = _written_axes(g, node)
    return axes[0] if axes is not None and len(axes) == 1 else None


def _match_softmax(g: _Graph, div: onnx.NodeProto):
    """``Div(e, B(ReduceSum(e)))`` with ``e = Exp(Sub(x, B(max(ReduceMax(x), -inf))))`` over one
    axis (``B``: Reshape/Expand back to the input's rank; jax2tf's softmax) -> (x, axis, nodes)."""
    if div.op_type != "Div" or len(div.input) != 2:
        return None
    total, spread_total = _through_broadcasts(g, div.input[1])
    reduce_sum = g.private(total)
    exp = g.producer.get(div.input[0])
    if reduce_sum is None or reduce_sum.op_type != "ReduceSum" or exp is None or exp.op_type != "Exp" \
            or reduce_sum.input[0] != exp.output[0]:
        return None
    sub = g.private(exp.input[0])
    if sub is None or sub.op_type != "Sub":
        return None
    peak, spread_peak = _through_broadcasts(g, sub.input[1])
    guard, nodes = g.private(peak), []
    if guard is not None and guard.op_type == "Max" and (bound := g.constant_operand(guard)) is not None \
            and bound[1] == -math.inf:
        nodes.append(guard)
        guard = g.private(bound[0])
    x = sub.input[0]
    if guard is None or guard.op_type != "ReduceMax" or guard.input[0] != x:
        return None
    axis = _one_axis(g, guard)
    if axis is None or _one_axis(g, reduce_sum) != axis:
        return None
    keep = {a.name: helper.get_attribute_value(a) for a in guard.attribute}.get("keepdims", 1)
    keep_sum = {a.name: helper.get_attribute_value(a) for a in reduce_sum.attribute}.get("keepdims", 1)
    if (keep == 0) != bool(spread_peak) or (keep_sum == 0) != bool(spread_total):
        return None  # a reduced tensor without its axis must be broadcast back, one with it need not
    group = [guard, *nodes, *spread_peak, sub, exp, reduce_sum, *spread_total, div]
    inside = {n.name for n in group}
    if any(o in g.outputs or any(c.name not in inside for c in g.consumers.get(o, []))
           for n in group[:-1] for o in n.output):
        return None
    return x, axis, group


def find_softmax(model: onnx.ModelProto) -> list:
    g = _Graph(model)
    return [match for node in model.graph.node if (match := _match_softmax(g, node)) is not None]


def fuse_softmax(model: onnx.ModelProto, matches) -> None:
    """In place: each match becomes one Softmax node (opset >= 13) writing its Div's output."""
    _replace(model, [(nodes, helper.make_node("Softmax", [x], [nodes[-1].output[0]], name=nodes[-1].name,
                                              axis=axis)) for x, axis, nodes in matches])


def _match_select(g: _Graph, node: onnx.NodeProto):
    """(index, axis) of a Gather that picks one slice of an activation by a constant scalar index
    (PyTorch's ``select``, ``x[:, 1]``): the Q, K and V of a packed projection."""
    if node.op_type != "Gather" or len(node.input) != 2 or node.input[0] in g.inits:
        return None
    data = g.producer.get(node.input[0])
    index = g.inits.get(node.input[1])
    if data is None or data.op_type == "Shape" or index is None or index.dims:  # shapes stay as they are
        return None
    value = onnx.numpy_helper.to_array(index)
    if value.dtype.kind not in "iu":
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return int(value), axis


def _match_pick(g: _Graph, node: onnx.NodeProto):
    """(runs, axis) of a Gather that picks slices of an activation by a constant 1-D list of
    non-negative indices (YOLOX's Focus: the channels of a SpaceToDepth reordered): ``runs`` are
    the [start, end) ranges of consecutive indices, in order."""
    if node.op_type != "Gather" or len(node.input) != 2 or node.input[0] in g.inits:
        return None
    data = g.producer.get(node.input[0])
    index = g.inits.get(node.input[1])
    if data is None or data.op_type == "Shape" or index is None or len(index.dims) != 1:
        return None
    value = onnx.numpy_helper.to_array(index).reshape(-1)
    if value.dtype.kind not in "iu" or not value.size or value.min() < 0:
        return None
    runs = []
    for i in value.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return [tuple(r) for r in runs], axis


def find_select(model: onnx.ModelProto) -> list:
    g = _Graph(model)
    return [(node, match) for node in model.graph.node
            if (match := _match_select(g, node) or _match_pick(g, node)) is not None]


def fuse_select(model: onnx.ModelProto, matches) -> None:
    """In place: ``Gather(x, i, axis=a)`` with a constant scalar ``i`` becomes
    ``Squeeze(Slice(x, [i], [i + 1], [a]), [a])``: the same values, by data-movement ops that run
    integer (qtool/ops/layout.py), where a Gather of an activation would run float. The Squeeze
    keeps the Gather's name and output."""
    inits = {t.name: t for t in model.graph.initializer}
    replaced = {}
    for node, (index, axis) in matches:
        base = node.name or node.output[0]
        if isinstance(index, list):  # a list of indices: a Slice per run of them, joined by a Concat
            replaced[id(node)] = _picked(model, inits, node, base, index, axis)
            continue
        ints = {}
        for key, value in (("start", index), ("end", index + 1 if index != -1 else np.iinfo(np.int64).max),
                           ("axis", axis)):
            ints[key] = _fresh_init(model, inits, f"{base}/{key}", np.array([value], np.int64))
        sliced = f"{node.output[0]}/slice"
        replaced[id(node)] = [
            helper.make_node("Slice", [node.input[0], ints["start"], ints["end"], ints["axis"]], [sliced],
                             name=f"{base}/slice"),
            helper.make_node("Squeeze", [sliced, ints["axis"]], [node.output[0]], name=node.name)]
    kept = [new for n in model.graph.node for new in replaced.get(id(n), [n])]
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _picked(model, inits, node, base, runs, axis) -> list[onnx.NodeProto]:
    """``Gather(x, [i0, i1, ...], axis)``: one Slice a run of consecutive indices, a Concat of
    them along the axis (one run: the Slice alone, writing the Gather's output)."""
    axis_name = _fresh_init(model, inits, f"{base}/axis", np.array([axis], np.int64))
    nodes, parts = [], []
    for k, (start, end) in enumerate(runs):
        out = node.output[0] if len(runs) == 1 else f"{node.output[0]}/part{k}"
        nodes.append(helper.make_node(
            "Slice", [node.input[0], _fresh_init(model, inits, f"{base}/start{k}", np.array([start], np.int64)),
                      _fresh_init(model, inits, f"{base}/end{k}", np.array([end], np.int64)), axis_name],
            [out], name=node.name if len(runs) == 1 else f"{base}/slice{k}"))
        parts.append(out)
    if len(runs) > 1:
        nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=node.name, axis=axis))
    return nodes
