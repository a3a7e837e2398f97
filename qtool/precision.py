"""Precision tables (``quantize --precision-table FILE``): the type of chosen ops, one per line.

The form is TPU-MLIR's quantization table (qtable): a node name (or an op type, for every node of
it) and a type, ``#`` starting a comment::

    # node             type
    p2o.Conv.12        INT16
    p2o.Add.14         int16
    Softmax            F32

``INT16`` gives the op's activations (its inputs and outputs) int16 fences; ``F32``, ``F16`` and
``BF16`` keep the op float (as ``--keep-float``); ``INT8`` is the default and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from .errors import QtoolError
from .model import all_nodes, folded_note

TYPES = {"int16": "int16", "int8": "int8", "f32": "float", "f16": "float", "bf16": "float",
         "float": "float"}


@dataclass(frozen=True)
class Precisions:
    int16: tuple[str, ...] = ()
    keep_float: tuple[str, ...] = ()

    def options(self, keep_float=()) -> dict:
        """QuantizeOptions' fields for this table beside --keep-float's ``keep_float``: every name
        kept float, those only the table names (their reason credits it), and the int16 ones."""
        keep_float = tuple(keep_float)
        return {"keep_float": keep_float + self.keep_float,
                "table_float": tuple(n for n in self.keep_float if n not in keep_float), "int16": self.int16}


def read_precision_table(path: str | Path, model: onnx.ModelProto, model_path=None) -> Precisions:
    """The table at ``path``, every name checked against ``model``'s node names and op types
    (``model_path``: its file, to say which names preparation folded away)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QtoolError(f"precision table '{path}' is not a text file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise QtoolError(f"precision table '{path}': {e.strerror or e}") from None
    names = {n.name for n in all_nodes(model.graph)} | {n.op_type for n in all_nodes(model.graph)}  # bodies too
    int16, floats = [], []
    given: dict[str, tuple[int, str, str]] = {}  # name -> (line, type, as written)
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"precision table '{path}' line {number}"
        if len(fields) != 2:
            raise QtoolError(f"{where}: expected 'NODE TYPE', got {line.strip()!r}")
        name, kind = fields[0], TYPES.get(fields[1].lower())
        if kind is None:
            raise QtoolError(f"{where}: unknown type '{fields[1]}'; choose one of "
                             f"{', '.join(t.upper() for t in TYPES if t != 'float')}")
        if name not in names:
            note = folded_note([name], model_path) if model_path is not None else ""
            raise QtoolError(f"{where}: the model has no node or op type '{name}'{note}")
        if name in given and given[name][1] != kind:
            raise QtoolError(f"{where}: '{name}' is {fields[1]} here and {given[name][2]} on line {given[name][0]}: "
                             f"give one type")
        given.setdefault(name, (number, kind, fields[1]))
        if kind == "int16":
            int16.append(name)
        elif kind == "float":
            floats.append(name)
    return Precisions(tuple(dict.fromkeys(int16)), tuple(dict.fromkeys(floats)))
