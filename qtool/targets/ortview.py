"""What onnxruntime makes of a quantized model on this machine, for ``verify --ort``: the CPU it
runs on, what the graph its default session options built says (fused QDQ groups, float weights
it quantized), and why it disagrees with the integer executor when saturation explains it."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections import Counter

import onnx
import onnxruntime as ort

from ..qoperator_exec import QOPERATOR_TYPES
from . import x86
from .form import exposed_float_ops

# a disagreement larger than this share of unequal elements, or than 1 LSB, gets a cause
AGREEMENT = 0.99
_FUSED = ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearAveragePool",
          "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat",
          "QLinearSoftmax", "QLinearWhere", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


# passes that report a change on nearly every graph without changing what it computes
_TRIVIAL_PASSES = ("ConstantSharing",)


def deployed_session(model: onnx.ModelProto, config: dict[str, str] | None = None
                     ) -> tuple[ort.InferenceSession, onnx.ModelProto | None, list[str]]:
    """onnxruntime's CPU session for ``model`` as a user creates it (default options, plus the
    session config entries ``config``), the graph it built (None if unreadable) and the names of
    the graph passes that changed the model, read from its INFO log ("GraphTransformer NAME
    modified: 1"), which onnxruntime writes to the process's file descriptor 2 while the session
    is built. Raises onnxruntime's own error when it cannot load the model."""
    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.log_severity_level = 1
    with tempfile.TemporaryDirectory(prefix="qtool-ort-") as folder:
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        log = os.path.join(folder, "log.txt")
        with fd2_to(log):
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
        with open(log, errors="replace") as f:
            passes = re.findall(r"GraphTransformer (\S+) modified: 1", f.read())
        try:  # only a description of what onnxruntime runs
            optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
        except Exception:
            optimized = None
    names = list(dict.fromkeys(p for p in passes if p not in _TRIVIAL_PASSES))
    return session, optimized, names


@contextlib.contextmanager
def fd2_to(path: str):
    """The process's file descriptor 2 (where onnxruntime's logger writes) sent to ``path`` for the
    duration: a deployed session logs at INFO (its passes), and at run time its warnings (an
    output's declared shape, once per batch) would reach the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(target)
        os.close(saved)


def graph_changes(model: onnx.ModelProto, optimized: onnx.ModelProto, passes: list[str]) -> list[str]:
    """onnxruntime's rewrites named by what they left: fused integer ops, and float-kept
    Conv/ConvTranspose/Gemm whose float weights it quantized (its WeightBiasQuantization pass,
    which runs even at ORT_ENABLE_BASIC: named in ``passes`` when the log was read, else seen as a
    node that now reads its weight from a DequantizeLinear)."""
    before = Counter(n.op_type for n in model.graph.node)
    after = Counter(n.op_type for n in optimized.graph.node)
    notes = []
    fused = {t: after[t] - before[t] for t in _FUSED if after[t] > before[t]}
    if fused:
        notes.append("onnxruntime fused QDQ groups into " +
                     ", ".join(f"{n} {t}" for t, n in fused.items()))
    exposed = [n.name for n in exposed_float_ops(model)]
    if "WeightBiasQuantization" in passes:
        requantized = exposed
    else:
        producer = {o: n for n in optimized.graph.node for o in n.output}
        now = {n.name: n for n in optimized.graph.node}
        requantized = [name for name in exposed if name in now and len(now[name].input) > 1
                       and getattr(producer.get(now[name].input[1]), "op_type", "") == "DequantizeLinear"]
    if requantized:
        notes.append(f"onnxruntime quantized the float weights of {len(requantized)} float-kept "
                     f"node(s) ({', '.join(requantized[:3])}{' ...' if len(requantized) > 3 else ''}; "
                     f"its WeightBiasQuantization pass: session option session.disable_quant_qdq=1 "
                     f"or disabled_optimizers=['WeightBiasQuantization'] runs them as written, and "
                     f"qtool quantize writes them guarded)")
    return notes


def ort_notes(qmodel: onnx.ModelProto, optimized: onnx.ModelProto | None, executor, checks,
              passes: list[str] = ()) -> list[str]:
    """``optimized``: the graph onnxruntime built for ``qmodel`` with the user's session options;
    ``passes``: onnxruntime's graph passes that changed it."""
    notes = [x86.describe_host()]
    if passes:
        notes.append("onnxruntime's graph passes that changed the model: " + ", ".join(passes))
    if optimized is not None:
        notes += graph_changes(qmodel, optimized, passes)
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


def first_parting(qmodel: onnx.ModelProto, executor, feeds: dict, config: dict[str, str] | None = None
                  ) -> str | None:
    """Where onnxruntime and the integer executor first part, in graph order: onnxruntime runs
    ``qmodel`` on ``feeds`` with every integer tensor (a QuantizeLinear's or fused group's output)
    as an extra output, and each is compared with the executor's integers. A line naming the
    first tensor that differs by more than 1 LSB, its op and how much, and why where that is
    known; None when none does. Extra outputs keep onnxruntime from fusing the groups they leave,
    so this is onnxruntime's unfused arithmetic there, as with session.disable_quant_qdq."""
    import numpy as np

    pairs = [(key, out, step) for step in executor.steps if step.kind in ("integer", "quantize")
             for key, out in zip(step.keys, step.outputs) if key]
    known = {o for node in qmodel.graph.node for o in node.output}
    pairs = [(k, o, s) for k, o, s in pairs if o in known]
    if not pairs:
        return None
    wide = onnx.ModelProto()
    wide.CopyFrom(qmodel)
    present = {o.name for o in wide.graph.output}
    wide.graph.output.extend(onnx.ValueInfoProto(name=o) for _, o, _ in pairs if o not in present)
    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(wide.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {n: feeds[n] for n in names})))
    except Exception:  # onnxruntime cannot take the widened graph: nothing to say
        return None
    mine = executor.run(feeds, keep_integer=True).integer
    for key, out, step in pairs:
        a, b = mine.get(key), got.get(out)
        if a is None or b is None or np.shape(a) != np.shape(b):
            continue
        diff = np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
        if diff.max(initial=0) > 1:
            op = step.node.op_type if step.kind == "integer" else "QuantizeLinear"
            float_part = (f"onnxruntime's {op} kernel requantizes in float, rounding half to even"
                          if op in QOPERATOR_TYPES else
                          "onnxruntime computes this op in float between DequantizeLinear and QuantizeLinear")
            why = (" (u8 x s8 saturation on this CPU: --target host reproduces it)"
                   if x86.ort_saturates() and executor.arithmetic == "exact" and step.kind == "integer"
                   and x86.saturating(step.node, *x86.stored_types(executor, step.node)) is not None
                   else f" ({float_part}; the executor in integers: a rounding rule)" if step.kind == "integer"
                   else "")
            return (f"first tensor where onnxruntime and the executor part: '{key}' ({op} node "
                    f"'{step.node.name}'), max diff {int(diff.max())} LSB, {100 * np.mean(diff == 0):.2f}% "
                    f"equal, on the first batch{why}")
    return None

