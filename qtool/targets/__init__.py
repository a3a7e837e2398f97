"""Targets: what a quantized model is written for, and whose integer arithmetic it meets.

qtool's integer executor accumulates exactly (int32, int64 where the bound needs it). onnxruntime on
x86 runs 8-bit products as u8 x s8: without VNNI (AVX2, AVX-512 before Cascade Lake) it adds each
adjacent pair of products into int16 with saturation (VPMADDUBSW, seed 002), so a model with
full-range int8 weights can compute something else there. A model's *target* fixes its form:

* ``portable`` (the default): uint8 activations and uint8 weights with zero point 128. The integers
  are those of the int8 model shifted by 128 (same accuracy as written); onnxruntime fuses the QDQ
  groups into u8 x u8 kernels, which widen to int16 before multiplying and are exact on every x86-64
  CPU, VNNI or not, and on arm64.
* ``x86-vnni``: int8 weights and activations; onnxruntime's u8 x s8 kernels, exact with AVX512-VNNI
  or AVX-VNNI, and saturating without (``qtool quantize`` lists the layers at risk).
* ``exact``: the same int8 form, for an integer device that accumulates in int32 with no pair limit.

An *arithmetic* is what the executor emulates (``qtool exec --target``): ``exact``, or ``x86-avx2``
(onnxruntime's u8 x s8 kernels on a CPU without VNNI; qtool/targets/x86.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QtoolError

METADATA_KEY = "qtool.target"


@dataclass(frozen=True)
class Target:
    name: str
    unsigned: bool  # activations and weights stored as uint8 (weights with zero point 128)
    summary: str


TARGETS = {t.name: t for t in (
    Target("portable", True, "uint8 activations and weights (zero point 128): onnxruntime's u8 x u8 "
                             "kernels, exact on every x86-64 and arm64 CPU"),
    Target("x86-vnni", False, "int8 weights and activations: onnxruntime's u8 x s8 kernels, exact "
                              "only on CPUs with VNNI"),
    Target("exact", False, "int8 weights and activations, for an integer device with int32 "
                           "accumulation"),
)}
DEFAULT_TARGET = "portable"
# what the executor can emulate; "host" is whichever of them this machine's onnxruntime computes
ARITHMETICS = ("exact", "x86-avx2", "host")


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise QtoolError(f"unknown target '{name}'; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def check_arithmetic(name: str) -> str:
    if name not in ARITHMETICS:
        raise QtoolError(f"unknown target '{name}'; choose one of {', '.join(ARITHMETICS)}")
    return name
