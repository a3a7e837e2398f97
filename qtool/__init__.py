"""qtool: calibrate, quantize and verify ONNX models with exact integer derivations."""

__version__ = "0.1.0"
