"""Weight rounding fitted to the layer's inputs (``quantize --data``): GPTQ's closed form.

Rounding each int8 weight to its nearest step is optimal weight by weight, not for the layer's
output ``y = x W``: the errors of one output channel add up over its inputs, and inputs are
correlated. GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", after OBQ, Frantar & Alistarh 2022) rounds the rows of ``W`` [K, N]
one at a time and moves each row's rounding error onto the rows not yet rounded, weighted by the
inverse of the inputs' Gram matrix ``H = X^T X`` (X: the layer's float inputs on the fit samples,
[samples * positions, K]), so that ``|X W - X Q|`` stays small:

    U = cholesky(inverse(H + damp I)) (upper)
    for k in 0 .. K-1:  Q[k] = round(W[k] / s);  e = (W[k] - s Q[k]) / U[k, k];
                        W[k+1:] -= U[k, k+1:]^T e

``s`` are the per-output-channel scales quantize computes anyway (qtool.qparams), so only the
integers change, never the scales or the model's form. ``damp`` is 1% of H's mean diagonal; the
rows go in the order of H's diagonal, largest first (GPTQ's act-order).

The layers: MatMul and Gemm whose weight is a constant matrix (transformers' dense layers). The
rounding is judged like every data-driven step: the model with it scored on held-out samples
against the model without, and kept only where at least ``GAIN_DB`` higher there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import onnx

from .analyze import Evaluator
from .model import FloatRunner, prepare_file
from .qparams import per_channel_symmetric, symmetric
from .quantize import quantize
from .report import progress_bar
from .search import JudgedStep
from .table import Table

DAMP = 0.01
# the held-out gain that keeps fitted rounding: on PP-OCRv4 rec it scored 0.04 dB higher on 16
# judging samples and 0.75 dB lower on the job's evaluation set; a gain that small is noise
GAIN_DB = 0.5


@dataclass(frozen=True)
class Rounded:
    """A weight's integers and the scales they were fitted on."""

    scale: np.ndarray
    values: np.ndarray  # int8, the weight's shape


def layers(model: onnx.ModelProto) -> dict[str, tuple[str, str, bool]]:
    """node name -> (input tensor, weight name, transposed) of each MatMul/Gemm whose weight is a
    2-D constant (a Gemm's transB: the weight is [N, K])."""
    inits = {i.name: i for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        if node.input[0] in inits or len(inits[node.input[1]].dims) != 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0):
            continue
        found[node.name] = (node.input[0], node.input[1], bool(attrs.get("transB", 0)))
    return found


def gptq(weight: np.ndarray, scale: np.ndarray, gram: np.ndarray, qmin: int = -128, qmax: int = 127) -> np.ndarray:
    """The integers of ``weight`` [K, N] with per-column ``scale`` [N] (or one), rounded row by row
    with each row's error moved onto the later rows through the Gram matrix ``gram`` [K, K]."""
    w = np.array(weight, dtype=np.float64)
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), w.shape[1:])
    h = np.array(gram, dtype=np.float64)
    dead = np.diag(h) == 0  # an input that is always zero: its weights do not matter
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h[np.diag_indices_from(h)] += DAMP * np.mean(np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable")  # the inputs of most energy first (act-order)
    w, h = w[order], h[np.ix_(order, order)]
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: inverse(h) = u^T u
    q = np.empty(w.shape, dtype=np.int64)
    for k in range(w.shape[0]):
        q[k] = np.clip(np.rint(w[k] / s), qmin, qmax)
        error = (w[k] - q[k] * s) / u[k, k]
        w[k + 1:] -= np.outer(u[k, k + 1:], error)
    out = np.empty_like(q)
    out[order] = q
    return out


def grams(float_model: onnx.ModelProto, found: dict, batches) -> dict[str, np.ndarray]:
    """``X^T X`` of each layer's input over ``batches`` (float64, summed batch by batch)."""
    inputs = sorted({x for x, _, _ in found.values()})
    runner = FloatRunner(float_model, inputs)
    sums: dict[str, np.ndarray] = {}
    for feeds in batches:
        values = runner.run(feeds)
        for x in inputs:
            rows = np.asarray(values[x], dtype=np.float64)
            rows = rows.reshape(-1, rows.shape[-1])
            sums[x] = sums.get(x, 0.0) + rows.T @ rows
    return sums


@dataclass
class RoundingPick(JudgedStep):
    BEFORE: ClassVar[str] = "nearest"
    AFTER: ClassVar[str] = "fitted"
    layers: int = 0
    gain_db: float = GAIN_DB

    def to_dict(self) -> dict:
        return {"layers": self.layers, **self.judged_dict()}


def fit(model_path, table: Table, options, table_name: str, data_path, num_samples: int | None = None,
        batch_size: int = 8, progress: bool = True, preprocess=None, holdout: int | None = None,
        bias_corrections=None, channel_ranges=None) -> tuple[dict[str, Rounded] | None, RoundingPick]:
    """The fitted integers of every MatMul/Gemm weight (see the module's docstring), or None where
    they do not score higher on the held-out samples (or there is nothing to fit or judge)."""
    start = time.perf_counter()
    pick = RoundingPick()
    float_model = prepare_file(model_path)
    found = layers(float_model)
    pick.layers = len(found)
    if not found:
        pick.reason = "no MatMul or Gemm with a constant weight"
        return None, pick
    fit_batches, held = pick.split(float_model, data_path, num_samples, holdout, batch_size, preprocess, start)
    if held is None:
        return None, pick
    inits = {i.name: i for i in float_model.graph.initializer}
    sums = grams(float_model, found, fit_batches)
    rounded: dict[str, Rounded] = {}
    with progress_bar(len(found), "weight rounding", progress, unit="layer") as bar:
        for x, name, transposed in found.values():
            if name in rounded:
                bar.update(1)
                continue
            w = onnx.numpy_helper.to_array(inits[name]).astype(np.float32)
            kn = w.T if transposed else w  # [K, N]
            qp = per_channel_symmetric(w, 0 if transposed else 1) if options.per_channel else \
                symmetric(float(np.abs(w).max(initial=0.0)), "int8")
            q = gptq(kn, qp.scale, sums[x], qp.qmin, qp.qmax)
            rounded[name] = Rounded(np.asarray(qp.scale), (q.T if transposed else q).astype(np.int8))
            bar.update(1)
    judge = Evaluator(float_model, held)
    pick.heldout, pick.scored = held.samples, judge.scored
    plain = replace(options, format="qdq", strict=False)
    pick.judge(*judge.sqnrs(quantize(model_path, table, plain, table_name, bias_corrections,
                                     channel_ranges=channel_ranges, scored_only=True)[0],
                            quantize(model_path, table, plain, table_name, bias_corrections, rounded,
                                     channel_ranges, scored_only=True)[0]))
    pick.seconds = time.perf_counter() - start
    return (rounded if pick.kept else None), pick
