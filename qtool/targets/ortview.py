"""What onnxruntime makes of a quantized model on this machine, for ``verify --ort``: the CPU it
runs on, what the graph its default session options built says (fused QDQ groups, float weights
it quantized), and why it disagrees with the integer executor when saturation explains it."""

from __future__ import annotations

from collections import Counter

import onnx

from . import x86

# a disagreement larger than this share of unequal elements, or than 1 LSB, gets a cause
AGREEMENT = 0.99
_FUSED = ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearAveragePool",
          "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat",
          "QLinearSoftmax", "QLinearWhere", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


def graph_changes(model: onnx.ModelProto, optimized: onnx.ModelProto) -> list[str]:
    """onnxruntime's rewrites named by what they left: fused integer ops, and float-kept
    Conv/ConvTranspose/Gemm whose float weights now come from a DequantizeLinear (its
    WeightBiasQuantization pass, which runs even at ORT_ENABLE_BASIC)."""
    before = Counter(n.op_type for n in model.graph.node)
    after = Counter(n.op_type for n in optimized.graph.node)
    notes = []
    fused = {t: after[t] - before[t] for t in _FUSED if after[t] > before[t]}
    if fused:
        notes.append("onnxruntime fused QDQ groups into " +
                     ", ".join(f"{n} {t}" for t, n in fused.items()))
    inits = {i.name for i in model.graph.initializer}
    float_weights = {n.name for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm")
                     and len(n.input) > 1 and n.input[1] in inits}
    producer = {o: n for n in optimized.graph.node for o in n.output}
    requantized = [n.name for n in optimized.graph.node if n.name in float_weights and len(n.input) > 1
                   and getattr(producer.get(n.input[1]), "op_type", "") == "DequantizeLinear"]
    if requantized:
        notes.append(f"onnxruntime quantized the float weights of {len(requantized)} float-kept "
                     f"node(s) ({', '.join(requantized[:3])}{' ...' if len(requantized) > 3 else ''}; "
                     f"its WeightBiasQuantization pass: session option session.disable_quant_qdq=1 "
                     f"or disabled_optimizers=['WeightBiasQuantization'] runs them as written)")
    return notes


def ort_notes(qmodel: onnx.ModelProto, optimized: onnx.ModelProto | None, executor, checks) -> list[str]:
    """``optimized``: the graph onnxruntime built for ``qmodel`` with default session options."""
    notes = [x86.describe_host()]
    if optimized is not None:
        notes += graph_changes(qmodel, optimized)
    disagree = any(c.equal_fraction < AGREEMENT or (c.unit == "lsb" and c.max_diff > 1) for c in checks)
    if disagree and executor.arithmetic == "exact" and x86.ort_saturates():
        layers = x86.hazards(executor)
        if layers:
            names = ", ".join(h.node for h in layers[:3]) + (" ..." if len(layers) > 3 else "")
            notes.append(f"cause: u8 x s8 saturation. {len(layers)} layer(s) of this model can leave "
                         f"int16 in onnxruntime's pair sums on this CPU ({names}); qtool verify "
                         f"--target host reproduces what it computes; quantize with --target "
                         f"portable (or run onnxruntime with session.x64quantprecision=1) to avoid it")
    return notes
