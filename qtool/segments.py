"""The float model in consecutive segments, one onnxruntime session each, for a caller that wants
many intermediate tensors but not all of them alive at once (verify under ``--memory``).

onnxruntime keeps every graph output of a run alive until the run ends, whether the caller asks
for it or not: a ViT-S session returning the ~400 tensors verify compares holds 230 MB of them
for each sample. Cut into segments, each session's outputs are only the tensors it computes that
the caller wants and the ones later segments read; the caller takes a segment's tensors and lets
them go before the next segment runs.

A segment ends where the last tensor of a group (the caller's, in its own order) is computed, in
the float graph's node order. Each segment gets the initializers its nodes read; a tensor read by
later segments is carried to them and let go after the last of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx

from .model import FloatRunner, node_reads, submodel, without_weight_bytes


class NotSegmented(Exception):
    """This model cannot be cut here (a tensor the segments pass on has no known type)."""


class FloatSegments:
    """The float model as consecutive sessions: ``parts`` yields, segment by segment, the tensors
    of ``wanted`` each one computed (and the graph's outputs), ``run`` returns chosen names."""

    def __init__(self, model: onnx.ModelProto, groups: list[list[str]], also: list[str] = (),
                 threads: int = 0, arena: bool = True, prepack: bool = True):
        """``groups``: the wanted tensors, in the caller's order, a segment ending after each
        group's last; ``also``: tensors wanted too, wherever they are computed."""
        nodes = list(model.graph.node)
        inits = {t.name: t for t in model.graph.initializer}
        graph_outputs = [o.name for o in model.graph.output]
        producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
        reads = [node_reads(node) for node in nodes]
        # the node index each segment ends after: where its group's last tensor is computed
        ends, last = [], -1
        for group in groups[:-1]:
            last = max([last, *(producer[n] for n in group if n in producer)])
            ends.append(last)
        ends.append(len(nodes) - 1)
        bounds = [(a + 1, b + 1) for a, b in zip([-1, *ends[:-1]], ends) if b > a]
        if len(bounds) < 2:
            raise NotSegmented("one segment")
        segment_of = [0] * len(nodes)
        for s, (a, b) in enumerate(bounds):
            segment_of[a:b] = [s] * (b - a)
        last_reader: dict[str, int] = {}  # tensor -> the last segment that reads it
        for i, names in enumerate(reads):
            for name in names:
                last_reader[name] = segment_of[i]
        wanted = {n for group in groups for n in group} | set(graph_outputs) | set(also)
        self.wanted = wanted
        types = _types(model)
        graph_input_infos = {vi.name: vi for vi in model.graph.input}
        # (its index among the cuts, its session, its inputs, its outputs)
        self.segments: list[tuple[int, FloatRunner, list[str], list[str]]] = []
        self.carried_until: dict[str, int] = {}
        for s, (a, b) in enumerate(bounds):
            part = nodes[a:b]
            made = {o for node in part for o in node.output if o}
            read = list(dict.fromkeys(n for i in range(a, b) for n in reads[i]))
            inputs = [n for n in read if n not in made and n not in inits]
            outputs = [o for node in part for o in node.output
                       if o and (o in wanted or last_reader.get(o, s) > s)]
            if not outputs:  # nodes nobody reads (a dead end after the last wanted tensor)
                continue
            for name in outputs:
                if last_reader.get(name, s) > s:
                    self.carried_until[name] = last_reader[name]
            segment = submodel(model, part, [graph_input_infos.get(n) or _info(n, types) for n in inputs],
                               [_info(n, types) for n in dict.fromkeys(outputs)],
                               [inits[n] for n in read if n in inits], f"{model.graph.name or 'model'}_{s}")
            self.segments.append((s, FloatRunner(segment, threads=threads, arena=arena, prepack=prepack), inputs,
                                  list(dict.fromkeys(outputs))))
            del segment
        self.output_names = graph_outputs

    def parts(self, feeds: dict[str, np.ndarray], names: set[str] | None = None) -> Iterator[dict]:
        """Each segment's tensors in turn, the wanted ones (``names`` of them, when given: the
        others are computed and let go inside onnxruntime); the first also gives the wanted
        inputs."""
        names = self.wanted if names is None else names
        carried = dict(feeds)
        for first, (s, runner, inputs, outputs) in enumerate(self.segments):
            fetch = [n for n in outputs if n in self.carried_until or n in names]
            # nothing asked of it and nothing carried from it: not run (an empty list would
            # ask onnxruntime for every output)
            values = runner.run({n: carried[n] for n in inputs}, fetch) if fetch else {}
            for name in [n for n, until in self.carried_until.items() if until <= s and n in carried]:
                del carried[name]
            carried.update((n, v) for n, v in values.items() if n in self.carried_until)
            given = {n: v for n, v in values.items() if n in names}
            if first == 0:
                given.update((n, v) for n, v in feeds.items() if n in names)
            del values
            yield given
            del given

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs, or ``names``: every segment run, the rest let go."""
        wanted = set(names or self.output_names)
        found = {}
        for values in self.parts(feeds, wanted):
            found.update(values)
        return {n: found[n] for n in (names or self.output_names)}


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type the model says or onnx's inference finds (on a copy without the
    weights' bytes: types need none)."""
    typed = {vi.name: vi.type for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]
             if vi.type.tensor_type.elem_type}
    made = {o for node in model.graph.node for o in node.output if o}
    if made - set(typed):
        try:
            inferred = onnx.shape_inference.infer_shapes(without_weight_bytes(model))
        except Exception:
            inferred = None
        if inferred is not None:
            for vi in [*inferred.graph.value_info, *inferred.graph.output]:
                if vi.type.tensor_type.elem_type:
                    typed.setdefault(vi.name, vi.type)
    return typed


def _info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    if name not in types:
        raise NotSegmented(f"no type for '{name}'")
    vi = onnx.ValueInfoProto(name=name)
    vi.type.tensor_type.elem_type = types[name].tensor_type.elem_type  # shapes may be the data's: left open
    return vi
