"""Helpers the test modules share to make their small models and data: a graph saved as a checked
ONNX file, normal-noise samples, and a module's fit/held-out split with its calibration table."""

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtool.calibrate import calibrate


def saved_model(path, name: str, nodes, inits, inputs: dict, outputs: dict, opset: int = 17):
    """The graph of ``nodes`` and ``inits`` (float inputs and outputs: name -> shape) as a model of
    ``opset``, checked and saved at ``path``; returns ``path``."""
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def normal_samples(path, n: int, seed: int, shape: tuple):
    """``n`` samples of standard normal noise of ``shape`` as input ``x`` of an .npz; returns ``path``."""
    np.savez(path, x=np.random.default_rng(seed).normal(0, 1, (n, *shape)).astype(np.float32))
    return path


def fit_and_held(folder, model, samples) -> tuple:
    """``samples(path, n, seed)``: 32 fit samples (seed 1) and 16 held-out ones (seed 2) in
    ``folder``, and the table calibrated on the fit ones."""
    data, held = samples(folder / "data.npz", 32, 1), samples(folder / "held.npz", 16, 2)
    return data, held, calibrate(model, data, progress=False)
