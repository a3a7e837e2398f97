"""Variants of a model that share its nodes up to some point run from there only.

``qtool analyze`` scores dozens of variants of one QDQ model (an op or a run of ops left float),
each over the same samples, with onnxruntime running every node as written. A variant is the
model with some fences bypassed: its nodes are the base model's up to the first one it changed.
The base's tensors at that cut are the same for both, so they are computed once (for a later
cut, by running on from the last one), and the variant runs from the cut only: on PP-OCRv4 rec
the ops analyze scores sit anywhere in the graph, so about half of each variant's work goes.

What a variant reads at the cut is exactly what its own full run would compute there (the same
nodes on the same inputs, run as written), so its outputs are the same numbers.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .model import graph_inputs, node_reads, submodel
from .runs import Runs
from .sizing import one_feed_bytes

MIN_CUT_FRACTION = 0.1  # a variant that changes the base within its first tenth runs whole
# the base's tensors held at a cut, over all the feeds, at most: more (a detector's early feature
# maps for 16 samples, or 64 with --num-samples 64) and the variant runs whole
STATE_BYTES = 256 << 20


def _inputs_like(names: list[str], values: dict) -> list[onnx.ValueInfoProto]:
    """Graph inputs typed as ``values`` (one batch's arrays by name), shapes open."""
    return [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(values[n]).dtype), None)
            for n in names]


class SharedPrefix:
    """Runs variants of ``base`` on ``runs``' feeds from the first node where they differ from it,
    as written (qtool/runs.py)."""

    def __init__(self, base: onnx.ModelProto, runs: Runs):
        self.base = base
        self.runs = runs
        self.batches = runs.feeds
        graph = base.graph
        self.signatures = [n.SerializeToString() for n in graph.node]
        self.inputs = {vi.name for vi in graph_inputs(base)}  # fed by the batches
        self.inits = {t.name: t for t in graph.initializer}
        self.produced_at = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
        self.reads = [node_reads(n) for n in graph.node]
        self.last_read: dict[str, int] = {}
        for i, names in enumerate(self.reads):
            for name in names:
                self.last_read[name] = i
        for o in graph.output:
            self.last_read[o.name] = len(graph.node)
        self.state: tuple[int, list[dict]] | None = None  # (cut, per batch the tensors kept there)
        self._sizes: dict[str, int] | None = None  # bytes of each tensor for one feed (_held_bytes)
        self._inits_bytes: dict[str, bytes] = {}

    def _init_bytes(self, name: str) -> bytes:
        if name not in self._inits_bytes:
            self._inits_bytes[name] = self.inits[name].SerializeToString()
        return self._inits_bytes[name]

    def cut(self, signatures: list[bytes]) -> int:
        """How many first nodes a variant (its nodes' bytes) shares with the base."""
        cut, limit = 0, min(len(signatures), len(self.signatures))
        while cut < limit and signatures[cut] == self.signatures[cut]:
            cut += 1
        return cut

    def shared(self, variant: onnx.ModelProto) -> int:
        """How many first nodes ``variant`` shares with the base, reading the same constants: a
        candidate that changes only initializers (fitted weight integers) leaves the base at the
        first node that reads one of them, not at its end."""
        cut = self.cut([n.SerializeToString() for n in variant.graph.node])
        theirs = {t.name: t for t in variant.graph.initializer}
        for i in range(cut):
            for name in self.reads[i]:
                if name in self.inits and (name not in theirs or
                                           theirs[name].SerializeToString() != self._init_bytes(name)):
                    return i
        return cut

    def run(self, variant: onnx.ModelProto, names: list[str], cut: int | None = None
            ) -> list[list[np.ndarray]] | None:
        """``names`` of ``variant`` on every batch, run from its first node that differs from the
        base's (``cut``, when the caller knows it); None when that is too early to save anything
        (the caller runs it whole)."""
        nodes = variant.graph.node
        if cut is None:
            cut = self.shared(variant)
        if cut < MIN_CUT_FRACTION * len(self.signatures) or cut >= len(self.signatures):
            return None
        prefix_made = {o for i in range(cut) for o in self.base.graph.node[i].output if o}
        variant_inits = {t.name: t for t in variant.graph.initializer}
        # the prefix must read the same constants in both
        for name in {n for i in range(cut) for n in self.reads[i] if n in self.inits}:
            if name not in variant_inits or variant_inits[name].SerializeToString() != self._init_bytes(name):
                return None
        suffix = list(nodes[cut:])
        read_after = {n for node in suffix for n in node_reads(node)} | set(names) | \
            {o.name for o in variant.graph.output}
        needed = sorted(n for n in read_after if n in prefix_made)
        if self._held_bytes(self._keep(cut, needed)) > STATE_BYTES:
            return None
        states = self._state_at(cut, needed)
        given = [n for n in names if n in prefix_made or n in self.inputs]
        wanted = [n for n in names if n not in given]
        if not wanted:
            return [[state[n] if n in state else batch[n] for n in names]
                    for state, batch in zip(states, self.batches)]
        suffix_inputs = sorted(n for n in read_after if n in prefix_made or n in self.inputs)
        tail = submodel(variant, suffix, _inputs_like(suffix_inputs, {**self.batches[0], **states[0]}),
                        [onnx.ValueInfoProto(name=n) for n in wanted],
                        [variant_inits[n] for n in dict.fromkeys(r for node in suffix for r in node_reads(node))
                         if n in variant_inits], f"{variant.graph.name or 'model'}_from_{cut}")
        session = self.runs.session(tail.SerializeToString())
        runs = self.runs.run(session, wanted, [{n: (state[n] if n in state else batch[n]) for n in suffix_inputs}
                                              for state, batch in zip(states, self.batches)])
        out = []
        for state, batch, run in zip(states, self.batches, runs):
            got = dict(zip(wanted, run))
            out.append([got[n] if n in got else (state[n] if n in state else batch[n]) for n in names])
        return out

    def _held_bytes(self, names: list[str]) -> int:
        """What holding ``names`` for every feed takes, by their sizes at the first feed's shapes
        (shape inference, once); 0 where they are not known (held as before the bound)."""
        if self._sizes is None:
            made = {o for n in self.base.graph.node for o in n.output if o}
            self._sizes = one_feed_bytes(self.base, made, self.batches[:1]) or {}
        return sum(self._sizes.get(n, 0) for n in names) * len(self.batches)

    def _keep(self, cut: int, needed: list[str]) -> list[str]:
        """What to hold at ``cut``: ``needed`` and the base's tensors read at or after it. (A
        variant that bypasses or widens a fence changes the fence's nodes, so a fence inside the
        shared prefix is the base's in every variant that shares it: the float tensor behind it
        is never read after the cut.)"""
        made = [o for i in range(cut) for o in self.base.graph.node[i].output if o]
        live = [t for t in made if self.last_read.get(t, -1) >= cut]
        return sorted(set(needed) | set(live))

    def _state_at(self, cut: int, needed: list[str]) -> list[dict]:
        """Per batch, the base's tensors at ``cut`` (at least ``needed``): run on from the last
        cut when what it kept suffices, else from the inputs."""
        keep = self._keep(cut, needed)
        start, held = 0, [dict() for _ in self.batches]
        if self.state is not None and self.state[0] <= cut:
            last, kept = self.state
            made_between = {o for i in range(last, cut) for o in self.base.graph.node[i].output if o}
            reads_before = {n for i in range(last, cut) for n in self.reads[i]
                            if n in self.produced_at and self.produced_at[n] < last}
            if reads_before <= set(kept[0]) and all(n in kept[0] or n in made_between for n in keep):
                start, held = last, kept
        if start < cut:
            part = list(self.base.graph.node[start:cut])
            made = {o for node in part for o in node.output if o}
            reads = list(dict.fromkeys(n for i in range(start, cut) for n in self.reads[i]))
            inputs = [n for n in reads if n not in made and n not in self.inits]
            outputs = [n for n in keep if n in made]
            piece = submodel(self.base, part, _inputs_like(inputs, {**self.batches[0], **held[0]}),
                             [onnx.ValueInfoProto(name=n) for n in outputs],
                             [self.inits[n] for n in reads if n in self.inits],
                             f"{self.base.graph.name or 'model'}_{start}_{cut}")
            runs = [[] for _ in self.batches]
            if outputs:
                runs = self.runs.run(self.runs.session(piece.SerializeToString()), outputs,
                                     [{n: state[n] if n in state else batch[n] for n in inputs}
                                      for state, batch in zip(held, self.batches)])
            new = []
            for state, run in zip(held, runs):
                got = dict(zip(outputs, run))
                new.append({n: (got[n] if n in got else state[n]) for n in keep if n in got or n in state})
            held = new
        self.state = (cut, held)
        return held
