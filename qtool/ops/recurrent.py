"""LSTM and GRU as integers (TFLite's integer LSTM is the anchor: 8-bit activations and weights,
16-bit gates and cell state, fixed-point rescaling between them).

Per direction and time step, with ``x`` and ``h`` int8/uint8 (``h`` at the hidden state's (S, Z):
output Y's, else Y_h's), ``W``/``R`` int8 per gate row, and ``c`` int16 at ``2**-k``:

* gate pre-activations, int16 at ``2**-12`` (Q3.12, +-8): the input part
  ``requant(sum W (x - Z_x) + Wb)`` with ``M / 2**r = S_x * S_W / 2**-12`` (for every step at
  once), plus the recurrent part ``requant(sum R (h - Z_h) + Rb)`` with ``S_h * S_R / 2**-12``,
  saturated to int16; B's two halves are int32 at those accumulator scales;
* ``i, o, f = sigmoid``, ``g = tanh`` of the gates: 65536-entry tables from Q3.12 to Q0.15
  (``round(f(q / 2**12) * 2**15)``, 1.0 saturating to 32767);
* ``c = sat16(rshift(f * c, 15) + rshift(i * g, 30 - k))``, the shifts rounding;
* ``h = sat(requant(o * tanh(c)) + Z_h)``: tanh of the cell from a 65536-entry table at ``2**-k``
  to Q0.15, the Q0.30 product rescaled with ``M / 2**r = 2**-30 / S_h``;
* peepholes (P, as TFLite's cell-to-gate weights): ``requant(P_q * c)`` added to the i and f
  gates' pre-activations (the cell before the step) and to o's (the cell after it), P int8 one
  scale per column of [D, 3*H] (the directions share it), rescaled with
  ``M / 2**r = S_P * 2**-k / 2**-12``.

The cell's exponent ``k``: the smallest power of two above twice the largest magnitude the model
gives the cell state (Y_c's and initial_c's (S, Z); qtool's preparation names Y_c so calibration
measures it: the last step's cell, in both directions its end), at least 1; 32 (``k = 10``) when
the model says nothing. ``qtool quantize`` gives initial_h, Y and Y_h one (S, Z), and initial_c
and Y_c another (``tied``); a model quantized otherwise has its states rescaled in and out.

GRU (gates z, r, h) shares the gate arithmetic. Its h is the memory too (an LSTM's is ``c``), so
the kernel carries it 8 bits finer than Y's grid, as ``u = (h - Z_h) * 2**8`` at ``S_h / 2**8``:
rounded back to 8 bits on every step, ``z * h`` drifts where ``z`` is near 1 (plcmos_v2's two
BiGRUs: 21.1 dB at the output, 32.1 dB carried finer, 34.7 dB with the GRUs float). With ``r``
at Q0.15 and ``h8 = rshift(u, 8)`` (the 8-bit state, what the matmuls and Y see):

* ``linear_before_reset=1``: the h gate is ``gx_h + rshift(r * requant(sum R_h h8 + Rb_h), 15)``;
* ``linear_before_reset=0``: ``rshift(r * u, 15 + 8)`` (the reset state, 8-bit) goes through
  ``R_h`` instead;
* ``u = sat(requant((2**15 - z) * tanh(gate)) + rshift(z * u, 15))``, the first term rescaled
  with ``2**-30 / (S_h / 2**8)``, saturated to the 8-bit range times ``2**8``.

Handled: forward, reverse and bidirectional, initial states, the default activations (Sigmoid,
Tanh[, Tanh]). Not handled (the node stays float, the reason reported): other activations,
``clip``, LSTM's ``input_forget``, ``sequence_lens`` and ``layout=1`` (which onnxruntime does not
run either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..fixedpoint import Requant, quantize_multipliers, requantize, rounding_rshift
from ..qparams import QParams
from . import (DUMPED_WHEN_SET, NOT_DUMPED, Bias, IntegerOp, NodeView, Raw, Rescale, Unsupported, Weight,
               check_integer, per_tensor, register, rescale)
from .conv import in_accumulator_units, weight_scales
from .intmatmul import int_matmul
from .lut import round_real

GATE_BITS = 12  # gate pre-activations: int16 at 2**-12
UNIT_BITS = 15  # sigmoid/tanh outputs: int16 at 2**-15
STATE_BITS = 8  # GRU's hidden state: carried at S_h / 2**8
DEFAULT_CELL_BOUND = 32.0
INT16 = (-(2**15), 2**15 - 1)


def _table(f, input_bits: int) -> np.ndarray:
    """``f`` on every int16 at ``2**-input_bits``, as int16 at ``2**-15``, indexed by ``q + 32768``."""
    q = np.arange(INT16[0], INT16[1] + 1, dtype=np.float64)
    return np.clip(round_real(f(np.ldexp(q, -input_bits)) * 2.0**UNIT_BITS, "half_to_even"),
                   -(2**UNIT_BITS - 1), 2**UNIT_BITS - 1).astype(np.int16)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact identity; no overflow for large |x|


_TABLES: dict[tuple[str, int], np.ndarray] = {}


def table(name: str, input_bits: int) -> np.ndarray:
    """The sigmoid or tanh table for int16 inputs at ``2**-input_bits`` (built once each)."""
    key = (name, input_bits)
    if key not in _TABLES:
        _TABLES[key] = _table(_sigmoid if name == "sigmoid" else np.tanh, input_bits)
    return _TABLES[key]


def look(t: np.ndarray, q: np.ndarray) -> np.ndarray:
    return t[q.astype(np.int64) + 2**15].astype(np.int64)


def cell_exponent(bound: float) -> int:
    """``k`` of the int16 cell at ``2**-k``: ``2**(15 - k)`` is the smallest power of two of at
    least ``bound`` (at least 1), so ``k`` lies in [0, 15]."""
    return 15 - min(max(math.ceil(math.log2(max(bound, 1.0))), 0), 15)


def qp_extent(qp: QParams) -> float:
    """The largest magnitude an 8-bit (S, Z) represents."""
    return float(qp.scale) * qp.max_offset


@dataclass(frozen=True)
class Direction:
    weight: np.ndarray  # int8 [I, G*H] (W transposed)
    recurrent: np.ndarray = field(metadata=NOT_DUMPED)  # int8 [H, G*H]: R, a weight of the model
    bias_x: np.ndarray  # int64 [G*H]: Wb - Z_x * sum(W)
    bias_h: np.ndarray  # int64 [G*H]: Rb (the state is kept as h - Z_h)
    reverse: bool
    # LSTM's P, a weight of the model: int64 [3*H] (i, o, f), int8 values
    peephole: np.ndarray | None = field(default=None, metadata=NOT_DUMPED)
    # per column of P [3*H]: S_P * 2**-k / 2**-12
    requant_peephole: Requant | None = field(default=None, metadata=DUMPED_WHEN_SET)


@dataclass(frozen=True)
class RecurrentParams:
    directions: tuple[Direction, ...]
    hidden: QParams  # the state h's (S, Z): Y's, else Y_h's
    requant_x: Requant  # per gate row [G*H]: S_x * S_W / 2**-12
    requant_h: Requant  # per gate row [G*H]: S_h * S_R / 2**-12
    requant_out: Requant  # 2**-30 / (S_h / 2**state_bits)
    # the tables (module note: a function of an int16 at 2**-bits to Q0.15, rounded to nearest,
    # ties to even), left out of the written parameters: gate_bits and cell_bits define them
    sigmoid: np.ndarray = field(metadata=NOT_DUMPED)
    tanh_gate: np.ndarray = field(metadata=NOT_DUMPED)
    initial_h: Rescale | None  # initial_h to the hidden state's (S, Z), if given
    outputs: tuple  # per present output: (its name in the op: "Y", "Y_h", "Y_c"; Rescale to it)
    rounding: str
    gate_bits: int = GATE_BITS
    # LSTM
    cell_bits: int = 0  # k
    tanh_cell: np.ndarray | None = field(default=None, metadata=NOT_DUMPED)
    initial_c: Rescale | None = None  # initial_c to the cell's int16 at 2**-k, if given
    # GRU
    linear_before_reset: bool = False
    # the hidden state carried at S_h / 2**state_bits (GRU: STATE_BITS; None: at S_h, an LSTM's)
    state_bits: int | None = field(default=None, metadata=DUMPED_WHEN_SET)


class Recurrent(IntegerOp):
    """What LSTM and GRU share: weights, biases and the gates' pre-activations."""

    gates: int  # 4 (LSTM: i, o, f, c) or 3 (GRU: z, r, h)
    state_bits: int | None = None  # the hidden state carried 2**state_bits finer (GRU)
    output_names: tuple[str, ...]
    accepts_constants = True  # initial states given as initializers

    def constants(self, node):
        return {1: Weight(axis=1), 2: Weight(axis=1), 3: Bias(activation=0, weight=1, recurrent=2),
                4: Raw()}

    def tied(self, node):
        """The hidden state in and out (initial_h, Y, Y_h) at one (S, Z), and LSTM's cell state
        (initial_c, Y_c): the kernel carries the state at that scale from the first step, and a
        state fed back from one run to the next keeps it."""
        inputs, outputs = list(node.input) + [""] * 8, list(node.output) + [""] * 3
        initial_h, initial_c = inputs[5], inputs[6] if self.op_type == "LSTM" else ""
        if initial_h == initial_c:  # one tensor for both (zeros): tying it would join h and c
            initial_h = initial_c = ""
        groups = [[initial_h, *outputs[:2]], [initial_c, outputs[2]] if self.op_type == "LSTM" else []]
        return [[n for n in group if n] for group in groups]

    def check(self, node, attrs):
        if node.input[4:5] not in ([], [""]):
            raise Unsupported("sequence_lens is not supported")
        if attrs.get("clip") is not None:
            raise Unsupported("clip is not supported")
        if attrs.get("activation_alpha") or attrs.get("activation_beta"):
            raise Unsupported("activation_alpha/beta are not supported")
        acts = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
        default = ["sigmoid", "tanh", "tanh"][:self.gates - 1] * 2
        if acts and [a.lower() for a in acts] != default[:len(acts)]:
            raise Unsupported(f"activations {acts} are not the defaults")
        if not any(node.output[:2]):
            raise Unsupported("neither Y nor Y_h is an output")
        if attrs.get("layout", 0):
            raise Unsupported("layout=1 (batch first) is not supported")  # nor by onnxruntime

    def derive(self, view: NodeView) -> RecurrentParams:
        node = view.node
        self.check(node, view.attrs)
        x = per_tensor(view.inputs[0].qparams, f"{self.op_type} input X")
        names = list(node.output) + [""] * (len(self.output_names) - len(node.output))
        outs = list(view.outputs) + [None] * (len(self.output_names) - len(view.outputs))
        hidden = per_tensor(outs[0] if names[0] else outs[1], f"{self.op_type} hidden state")
        if x.dtype not in ("int8", "uint8") or hidden.dtype not in ("int8", "uint8"):
            raise Unsupported("X and the hidden state must be 8-bit")
        w, r = view.inputs[1].value, view.inputs[2].value
        if w is None or r is None or w.ndim != 3 or r.ndim != 3:
            raise Unsupported("W and R must be 3-D quantized constants")
        dirs, rows, _ = w.shape
        if r.shape != (dirs, rows, rows // self.gates):
            raise Unsupported(f"R's shape {list(r.shape)} does not match W's {list(w.shape)}")
        direction = view.attr("direction", "forward")
        if dirs != (2 if direction == "bidirectional" else 1):
            raise Unsupported(f"W has {dirs} directions for direction='{direction}'")
        gate = 2.0**-GATE_BITS
        x_scale = x.scale * weight_scales(view, 1, rows, 1)
        h_scale = hidden.scale * weight_scales(view, 2, rows, 1)
        bias_x, bias_h = self._biases(view, dirs, rows, x_scale, h_scale)
        directions = tuple(
            Direction(weight=np.ascontiguousarray(w[d].T), recurrent=np.ascontiguousarray(r[d].T),
                      bias_x=bias_x[d] - x.zero_point * w[d].astype(np.int64).sum(axis=1), bias_h=bias_h[d],
                      reverse=direction == "reverse" or d == 1)
            for d in range(dirs))
        bits = view.multiplier_bits
        k, cell = self._cell(view, outs)
        states = {"Y": hidden, "Y_h": hidden, "Y_c": cell}
        outputs = tuple((kind, rescale(states[kind], per_tensor(qp, f"{self.op_type} output {kind}"), view))
                        for kind, name, qp in zip(self.output_names, names, outs) if name)
        return RecurrentParams(
            directions=directions, hidden=hidden,
            requant_x=quantize_multipliers(x_scale / gate, bits),
            requant_h=quantize_multipliers(h_scale / gate, bits),
            requant_out=quantize_multipliers(2.0**-30 / (np.float64(hidden.scale) * 2.0**-(self.state_bits or 0)),
                                             bits),
            sigmoid=table("sigmoid", GATE_BITS), tanh_gate=table("tanh", GATE_BITS),
            initial_h=self._from_state(view, 5, hidden), outputs=outputs,
            rounding=view.rounding, cell_bits=k, tanh_cell=table("tanh", k) if cell else None,
            initial_c=self._from_state(view, 6, cell) if cell else None,
            linear_before_reset=bool(view.attr("linear_before_reset", 0)), state_bits=self.state_bits)

    def _cell(self, view: NodeView, outs) -> tuple[int, QParams | None]:
        return 0, None

    @staticmethod
    def _from_state(view: NodeView, index: int, state: QParams) -> Rescale | None:
        """The initial state at input ``index``, if given, rescaled to ``state``'s (S, Z)."""
        operand = view.inputs[index] if len(view.inputs) > index else None
        if operand is None:
            return None
        return rescale(per_tensor(operand.qparams, f"{view.node.op_type} initial state"), state, view)

    @staticmethod
    def _biases(view: NodeView, dirs: int, rows: int, x_scale, h_scale):
        """B's halves in the two accumulators' units (int64 [D, G*H] each); zeros without B."""
        operand = view.inputs[3] if len(view.inputs) > 3 else None
        if operand is None:
            return np.zeros((dirs, rows), np.int64), np.zeros((dirs, rows), np.int64)
        if operand.qparams is None or operand.value is None:
            raise Unsupported("B must be a quantized constant")
        if np.any(np.asarray(operand.qparams.zero_point) != 0):
            raise Unsupported("B's zero point must be 0")
        stored = operand.value.astype(np.int64).reshape(dirs, 2 * rows)
        scale = np.broadcast_to(np.asarray(operand.qparams.scale, np.float64).reshape(-1), (2 * rows,))
        return [in_accumulator_units(stored[:, part], scale[part], target)
                for part, target in ((slice(0, rows), x_scale), (slice(rows, 2 * rows), h_scale))]

    def run(self, p: RecurrentParams, x: np.ndarray, *states: np.ndarray) -> list[np.ndarray]:
        check_integer(x, *states)
        states = list(states)
        h0 = states.pop(0) if p.initial_h is not None else None
        c0 = states.pop(0) if p.initial_c is not None else None
        steps, batch, _ = x.shape
        h_size = p.directions[0].recurrent.shape[0]
        hidden = p.hidden
        y = np.empty((steps, len(p.directions), batch, h_size), dtype=hidden.dtype)
        last_h, last_c = [], []
        for d, dr in enumerate(p.directions):
            acc = int_matmul(x.reshape(steps * batch, -1), dr.weight) + dr.bias_x
            gx = requantize(acc, p.requant_x.multiplier, p.requant_x.rshift, p.rounding).reshape(steps, batch, -1)
            h = np.zeros((batch, h_size), np.int64)  # (h - Z_h) * 2**state_bits
            if h0 is not None:
                h = (p.initial_h(h0[d]).astype(np.int64) - hidden.zero_point) << (p.state_bits or 0)
            c = np.zeros((batch, h_size), np.int64) if c0 is None else p.initial_c(c0[d]).astype(np.int64)
            for t in (range(steps - 1, -1, -1) if dr.reverse else range(steps)):
                h, c = self.step(p, dr, gx[t], h, c)
                y[t, d] = self.coarse(p, h) + hidden.zero_point
            last_h.append(self.coarse(p, h) + hidden.zero_point)
            last_c.append(c)
        values = {"Y": y, "Y_h": np.stack(last_h).astype(hidden.dtype), "Y_c": np.stack(last_c).astype(np.int16)}
        return [to_output(values[kind]) for kind, to_output in p.outputs]

    def step(self, p: RecurrentParams, dr: Direction, gx: np.ndarray, h: np.ndarray, c: np.ndarray):
        """One time step: ``gx`` the input part of the gates, ``h`` the carried state
        ``(h - Z_h) * 2**state_bits`` (int64); returns the new carried state and cell."""
        raise NotImplementedError

    @staticmethod
    def coarse(p: RecurrentParams, h: np.ndarray) -> np.ndarray:
        """The carried state ``(h - Z_h) * 2**state_bits`` on the 8-bit grid: ``h - Z_h``."""
        return rounding_rshift(h, p.state_bits, p.rounding) if p.state_bits else h

    @staticmethod
    def recurrent_part(p: RecurrentParams, dr: Direction, h: np.ndarray, rows: slice) -> np.ndarray:
        """R's part of the gates' pre-activations from ``h - Z_h`` (8-bit)."""
        acc = int_matmul(h, dr.recurrent[:, rows]) + dr.bias_h[rows]
        return requantize(acc, p.requant_h.multiplier[rows], p.requant_h.rshift[rows], p.rounding)

    @staticmethod
    def hidden_from(p: RecurrentParams, product: np.ndarray, extra=0) -> np.ndarray:
        """The carried state from a Q0.30 product (plus ``extra``, already carried), saturated to
        the hidden state's 8-bit range."""
        out = requantize(product, p.requant_out.multiplier, p.requant_out.rshift, p.rounding) + extra
        hidden, bits = p.hidden, p.state_bits or 0
        return np.clip(out, (hidden.qmin - hidden.zero_point) << bits, (hidden.qmax - hidden.zero_point) << bits)


@register
class LSTM(Recurrent):
    op_type = "LSTM"
    gates = 4
    output_names = ("Y", "Y_h", "Y_c")

    def constants(self, node):
        # P [D, 3*H]: one int8 scale per column (per gate and cell channel, the directions sharing it)
        return {**super().constants(node), 7: Weight(axis=1)}

    def check(self, node, attrs):
        super().check(node, attrs)
        if attrs.get("input_forget", 0):
            raise Unsupported("input_forget is not supported")

    def derive(self, view: NodeView) -> RecurrentParams:
        p = super().derive(view)
        operand = view.inputs[7] if len(view.inputs) > 7 else None
        if operand is None:
            return p
        if operand.value is None or operand.qparams is None or np.any(np.asarray(operand.qparams.zero_point) != 0):
            raise Unsupported("P must be a quantized constant of zero point 0")
        dirs = len(p.directions)
        rows = 3 * p.directions[0].recurrent.shape[0]
        values = operand.value.astype(np.int64).reshape(dirs, rows)
        scale = np.broadcast_to(np.asarray(operand.qparams.scale, np.float64).reshape(-1), (rows,))
        requant = quantize_multipliers(scale * 2.0**-p.cell_bits / 2.0**-GATE_BITS, view.multiplier_bits)
        directions = tuple(replace(dr, peephole=values[d], requant_peephole=requant)
                           for d, dr in enumerate(p.directions))
        return replace(p, directions=directions)

    def _cell(self, view: NodeView, outs) -> tuple[int, QParams | None]:
        """The cell's exponent from what the model says of Y_c and initial_c, doubled (Y_c is
        one step's), and its (S, Z)."""
        initial = view.inputs[6] if len(view.inputs) > 6 else None
        known = [qp_extent(per_tensor(qp, "LSTM cell state"))
                 for qp in (outs[2], initial.qparams if initial is not None else None) if qp is not None]
        k = cell_exponent(2.0 * max(known) if known else DEFAULT_CELL_BOUND)
        return k, QParams(2.0**-k, 0, "int16")

    def step(self, p, dr, gx, h, c):
        n = dr.recurrent.shape[0]
        pre = gx + self.recurrent_part(p, dr, h, slice(None))
        if dr.peephole is not None:  # i and f see the cell before the step
            pre[:, :n] += self.peephole(p, dr, c, slice(0, n))
            pre[:, 2 * n:3 * n] += self.peephole(p, dr, c, slice(2 * n, 3 * n))
        gates = np.clip(pre, *INT16)
        i = look(p.sigmoid, gates[:, :n])
        f = look(p.sigmoid, gates[:, 2 * n:3 * n])
        g = look(p.tanh_gate, gates[:, 3 * n:])
        c = np.clip(rounding_rshift(f * c, UNIT_BITS, p.rounding)
                    + rounding_rshift(i * g, 2 * UNIT_BITS - p.cell_bits, p.rounding), *INT16)
        if dr.peephole is not None:  # o sees the cell after it
            gates[:, n:2 * n] = np.clip(pre[:, n:2 * n] + self.peephole(p, dr, c, slice(n, 2 * n)), *INT16)
        o = look(p.sigmoid, gates[:, n:2 * n])
        return self.hidden_from(p, o * look(p.tanh_cell, c)), c

    @staticmethod
    def peephole(p: RecurrentParams, dr: Direction, c: np.ndarray, rows: slice) -> np.ndarray:
        """P's part of a gate's pre-activation at 2**-12: the int8 weights times the int16 cell."""
        r = dr.requant_peephole
        return requantize(dr.peephole[rows] * c, r.multiplier[rows], r.rshift[rows], p.rounding)


@register
class GRU(Recurrent):
    op_type = "GRU"
    gates = 3
    state_bits = STATE_BITS
    output_names = ("Y", "Y_h")

    def step(self, p, dr, gx, h, c):
        n = dr.recurrent.shape[0]
        h8 = self.coarse(p, h)
        zr = np.clip(gx[:, :2 * n] + self.recurrent_part(p, dr, h8, slice(0, 2 * n)), *INT16)
        z, r = look(p.sigmoid, zr[:, :n]), look(p.sigmoid, zr[:, n:])
        if p.linear_before_reset:
            reset = rounding_rshift(r * self.recurrent_part(p, dr, h8, slice(2 * n, None)), UNIT_BITS, p.rounding)
        else:
            reset_state = rounding_rshift(r * h, UNIT_BITS + p.state_bits, p.rounding)  # to 8 bits, rounded once
            reset = self.recurrent_part(p, dr, reset_state, slice(2 * n, None))
        candidate = look(p.tanh_gate, np.clip(gx[:, 2 * n:] + reset, *INT16))
        keep = rounding_rshift(z * h, UNIT_BITS, p.rounding)
        return self.hidden_from(p, (2**UNIT_BITS - z) * candidate, keep), c
