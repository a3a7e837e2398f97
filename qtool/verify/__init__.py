"""``qtool verify``: the float model (onnxruntime) against the integer executor, tensor by tensor
(qtool/verify/core.py), with the running comparisons in qtool/verify/compare.py."""

from .compare import Comparison
from .core import (ANALYSIS_TOP, DEFAULT_TOLERANCE, OrtCheck, VerifyReport, format_diff, format_report, parse_tolerance,
                   tolerance_rule, verify)

__all__ = ["ANALYSIS_TOP", "Comparison", "DEFAULT_TOLERANCE", "OrtCheck", "VerifyReport", "format_diff", "format_report",
           "parse_tolerance", "tolerance_rule", "verify"]
