"""``qtool calibrate`` and ``qtool merge``: stream per-tensor statistics over a dataset.

One onnxruntime session on the prepared float model computes, next to every tensor that
``qtool quantize`` may need, the few statistics the method reads (``qtool.stats_graph``); each
batch updates one calibrator per tensor and is dropped, so memory holds about one batch of
activations. The statistics can be saved (``--stats-out``) and merged across shards.

Which tensors: the graph inputs and outputs and every float activation read or written by a node
that has an integer kernel (``qtool.ops.REGISTRY``) accepting its attributes; tensors only inside
float regions (LayerNorm's ReduceMean/Pow/Sqrt, Shape arithmetic) get no statistics.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import queue
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

import calibrators

from . import __version__, control, masks, stats_graph
from .batching import CALIBRATE_BATCH_CAP, CALIBRATE_FACTOR, DEFAULT_MEMORY_MB, OneAtATime, check_memory, \
    fixed_bytes, run_or_one_at_a_time
from .data import Dataset, check_sampling, load_dataset
from .errors import DataError, QtoolError
from .fileio import atomic_write
from .model import (FloatRunner, file_digest, first_line, float_tensors, graph_inputs, input_shape,
                    load_model, node_reads, prepare_file, weight_bytes)
from .report import progress_bar
from .sizing import _fix_dims, batch_is_chosen, default_batch, fixed_batch
from .table import Table, TensorEntry

STATS_VERSION = 1


def make_calibrator(method: str, params: dict | None = None):
    """A calibrator of ``method`` with ``params``; string values (from the command line) are
    converted to the type of the parameter's default."""
    return calibrator_factory(method, params)()


def calibrator_factory(method: str, params: dict | None = None):
    """A function making calibrators of ``method`` with ``params`` (see ``make_calibrator``): the
    parameters are checked once, not once per tensor."""
    cls, kwargs = _calibrator_class(method), typed_params(method, params)

    def make():
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise QtoolError(f"method '{method}': {e}") from None

    return make


def _calibrator_class(method: str):
    try:
        return calibrators.get(method)
    except KeyError as e:
        raise QtoolError(e.args[0]) from None


def typed_params(method: str, params: dict | None) -> dict:
    """``params`` checked against ``method``'s parameters, strings (from the command line) turned
    into the type of the parameter's default: what a table and a statistics file record, so that
    ``--param percentile=99.9`` and a job's ``percentile: 99.9`` are the same parameters."""
    allowed = _defaults(method)
    kwargs = {}
    for name, value in (params or {}).items():
        if name not in allowed:
            listed = ", ".join(allowed) or "none"
            raise QtoolError(f"unknown parameter '{name}' for method '{method}'; parameters: {listed}")
        default = allowed[name]
        if isinstance(value, str) and default is not None and not isinstance(default, str):
            try:
                value = type(default)(value)
            except ValueError:
                raise QtoolError(f"parameter '{name}' of method '{method}' must be "
                                 f"{type(default).__name__}, got '{value}'") from None
        elif isinstance(value, str) and default is None:  # (minmax's moving_average) a number when it reads as one
            value = _number(value)
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # a job's 'percentile: 99' is --param percentile=99's 99.0
        kwargs[name] = value
    return kwargs


def _defaults(method: str) -> dict:
    """``method``'s parameters and their defaults."""
    signature = inspect.signature(_calibrator_class(method).__init__)
    return {n: p.default for n, p in signature.parameters.items() if n != "self"}


def _with_defaults(method: str, params: dict) -> dict:
    """``params`` of ``method`` with every parameter it leaves out at its default."""
    try:
        return {**_defaults(method), **params}
    except QtoolError:
        return dict(params)


def _number(text: str):
    """``text`` as an int or a float where it reads as one, else as it is."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(items: list[str]) -> dict[str, str]:
    """``["percentile=99.9", ...]`` -> ``{"percentile": "99.9"}``."""
    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise QtoolError(f"--param takes NAME=VALUE, got '{item}'")
        params[name.strip()] = value.strip()
    return params


@dataclass
class Statistics:
    """Per-tensor calibrator state plus what it was computed on."""

    model: str
    model_sha256: str
    method: str
    params: dict
    samples: int
    input_shapes: dict[str, list]
    calibrators: dict = field(default_factory=dict)  # tensor name -> calibrator
    preprocess: dict = field(default_factory=dict)  # Preprocess.to_dict() when DATA was images
    # tensors inside If/Loop/Scan bodies: the ones a shard may lack (a branch its data never took)
    body_tensors: set = field(default_factory=set)
    # per-channel (axis 1) min and max of the tensors ``collect`` was asked for (``channels``), as
    # float64 vectors, where the pass measured them (not kept with the table)
    channel_ranges: dict = field(default_factory=dict)

    def table(self) -> Table:
        """The table; a tensor that held inf or NaN is listed as ``unbounded`` instead (the data's
        inputs are finite, checked as read, so the model computed it: ops around it stay float)."""
        tensors, unbounded = {}, []
        for name, calibrator in self.calibrators.items():
            r = calibrator.result()
            if not (math.isfinite(r.min) and math.isfinite(r.max) and math.isfinite(r.threshold)):
                unbounded.append(name)
                continue
            tensors[name] = TensorEntry(float(r.min), float(r.max), float(r.threshold), self.method)
        return Table(self.model, self.model_sha256, self.method, self.samples, __version__, tensors,
                     params=dict(sorted(self.params.items())), input_shapes=self.input_shapes,
                     preprocess=self.preprocess, unbounded=unbounded)

    def table_keeping_ends(self, ends: set[str]) -> Table:
        """``table()``, with the tensors of ``ends`` (``past_last_layer``) at their whole observed
        range: there a clipping method cuts the signal itself (YOLOv8n's class logits, whose
        few positive values are the detections, cut by percentile to at most -4.2)."""
        table = self.table()
        for name in ends & set(table.tensors):
            hist = getattr(self.calibrators[name], "hist", None)
            if hist is not None and hist.finite:
                lo, hi = float(hist.min), float(hist.max)
                table.tensors[name] = TensorEntry(lo, hi, max(-lo, hi), "minmax")
        return table

    def header(self) -> dict:
        return {"qtool_stats": STATS_VERSION, "model": self.model, "model_sha256": self.model_sha256,
                "method": self.method, "params": self.params, "samples": self.samples,
                "input_shapes": self.input_shapes, "qtool_version": __version__,
                "tensors": list(self.calibrators), "preprocess": self.preprocess,
                "body_tensors": sorted(self.body_tensors)}

    def save(self, path: str | Path) -> None:
        if any(not hasattr(c, "state") for c in self.calibrators.values()):
            raise QtoolError(f"method '{self.method}' cannot save its statistics (its calibrator "
                             "has no state()); calibrate without --stats-out")
        arrays = {"header": np.array(json.dumps(self.header()))}
        for i, calibrator in enumerate(self.calibrators.values()):
            for key, value in calibrator.state().items():
                arrays[f"{i}.{key}"] = np.asarray(value)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        atomic_write(path, buffer.getvalue())

    @classmethod
    def load(cls, path: str | Path) -> "Statistics":
        from .data import read_npz

        if not Path(path).exists():
            raise QtoolError(f"statistics file '{path}' not found")
        arrays = read_npz(path)
        try:
            header = json.loads(str(arrays["header"]))
            version = header["qtool_stats"]
        except (KeyError, ValueError, TypeError):
            version = None
        if version != STATS_VERSION:
            raise QtoolError(f"'{path}' is not a qtool statistics file (from calibrate --stats-out)")
        for key, kind in (("model", str), ("model_sha256", str), ("method", str), ("params", dict),
                          ("samples", int), ("input_shapes", dict), ("tensors", list)):
            if not isinstance(header.get(key), kind):
                raise QtoolError(f"statistics file '{path}' is damaged: header key '{key}' is "
                                 f"missing or not a {kind.__name__}")
        stats = cls(header["model"], header["model_sha256"], header["method"], header["params"],
                    header["samples"], header["input_shapes"],
                    preprocess=header["preprocess"] if isinstance(header.get("preprocess"), dict) else {},
                    body_tensors=set(header.get("body_tensors") or ()))
        new_calibrator = calibrator_factory(stats.method, stats.params)
        for i, name in enumerate(header["tensors"]):
            calibrator = new_calibrator()
            try:
                calibrator.load_state({k.split(".", 1)[1]: v for k, v in arrays.items()
                                       if k.startswith(f"{i}.")})
            except (KeyError, IndexError, TypeError, ValueError) as e:
                what = f"no '{e.args[0]}'" if isinstance(e, KeyError) else first_line(e)
                raise QtoolError(f"statistics file '{path}' is damaged: the state of tensor "
                                 f"'{name}' is incomplete ({what})") from None
            stats.calibrators[name] = calibrator
        return stats

    def read_as(self, method: str) -> "Statistics":
        """These statistics read by ``method``'s calibrators (default parameters), whose
        ``shared_key`` must equal this method's: percentile's histograms give mse's table."""
        new_calibrator = calibrator_factory(method)
        out = replace(self, method=method, params={}, calibrators={}, body_tensors=set(self.body_tensors))
        for name, calibrator in self.calibrators.items():
            mine = new_calibrator()
            mine.load_state(calibrator.state())
            out.calibrators[name] = mine
        return out

    def merge(self, other: "Statistics", other_name: str = "shard") -> None:
        for key in ("model_sha256", "method", "params", "preprocess"):
            if key == "params" and self.method == other.method and \
                    _with_defaults(self.method, self.params) == _with_defaults(other.method, other.params):
                continue  # one spelled out a default the other left out: the same calibration
            if getattr(self, key) != getattr(other, key):
                raise QtoolError(f"cannot merge {other_name}: its {key} {getattr(other, key)!r} "
                                 f"differs from {getattr(self, key)!r}")
        # the same model: a tensor only one of them holds is inside a branch or loop only its data
        # ran (an If on the sample rate, given 16 kHz in one shard and 8 kHz in the other)
        self.body_tensors |= other.body_tensors
        mine, theirs = set(self.calibrators), set(other.calibrators)
        odd = sorted((mine ^ theirs) - self.body_tensors)
        if odd:
            raise QtoolError(f"cannot merge {other_name}: it holds other tensors ('{odd[0]}' is in one "
                             f"file only, outside any If/Loop/Scan body)")
        for name, calibrator in other.calibrators.items():
            if name not in self.calibrators:
                self.calibrators[name] = calibrator
                continue
            try:
                self.calibrators[name].merge(calibrator)
            except (TypeError, ValueError) as e:  # states that load but do not fit together
                raise QtoolError(f"cannot merge {other_name}: tensor '{name}': {first_line(e)}") from None
        self.samples += other.samples


def needed_tensors(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """The tensors of ``names`` that ``qtool quantize`` may need a range for: graph inputs and
    outputs, and the activations of every node with an integer kernel that accepts the node
    (``qtool.ops.REGISTRY`` and the op's ``check``), whatever becomes of its constants.
    Attention masks and the masked scores a Softmax reads (qtool/masks.py) are never quantized:
    they are left out, with their -inf or -3.4e38 entries."""
    from .ops import REGISTRY, Unsupported, node_attrs

    plan = masks.find(model)
    unquantized = plan.tensors | {j.output for j in plan.joins.values()}
    inits = {i.name for i in model.graph.initializer}
    needed = {vi.name for vi in model.graph.input} | {vi.name for vi in model.graph.output}
    for node in model.graph.node:
        op = REGISTRY.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if op is None:
            continue
        try:
            op.check(node, node_attrs(node))
        except Unsupported:
            continue
        except Exception:  # a check that fails otherwise: keep the node's tensors
            pass
        needed.update(n for n in (*node.input, *node.output) if n and n not in inits)
    return [n for n in names if n in needed and n not in unquantized]


def _model_and_data(model_path, data_path, preprocess):
    """The prepared model and the dataset, read concurrently (the data is matched to the model's
    inputs, which preparation leaves as they are); errors come in that order."""
    source = load_model(model_path)
    loaded: dict = {}

    def read():
        try:
            loaded["data"] = load_dataset(data_path, source, preprocess)
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the model's errors)
            loaded["error"] = e

    reader = threading.Thread(target=read, name="qtool-read-data", daemon=True)
    reader.start()
    try:
        model = prepare_file(model_path, loaded=source)  # a judged step's again: the kept preparation
    finally:
        reader.join()
    if "error" in loaded:
        raise loaded["error"]
    return model, loaded["data"]


def collect(model_path: str | Path, data_path: str | Path, method: str = "minmax",
            params: dict | None = None, num_samples: int | None = None, batch_size: int | None = None,
            progress: bool = True, preprocess=None, log=None,
            histogram_samples: int = stats_graph.DEFAULT_SAMPLES_PER_TENSOR,
            memory_mb: int = DEFAULT_MEMORY_MB, feeds=None, shard: tuple[int, int] | None = None,
            channels: list[str] = ()) -> Statistics:
    """``batch_size`` None: chosen from ``memory_mb`` (qtool/batching.py) and told to ``log``;
    when its first batch fails, one sample at a time (``OneAtATime``), told too.
    ``feeds`` (qtool.analyze.Batches): these batches of DATA's samples instead of DATA in order
    (a data-driven step calibrating on its fit samples only). ``shard``: samples [first, stop) of
    DATA only, in batches from ``first`` (a part of a calibration spread by qtool/cluster.py).
    ``channels``: tensors whose per-channel min and max the pass also keeps, where its reductions
    keep the channels anyway (``Statistics.channel_ranges``: the same numbers as
    qtool.channels.channel_ranges, without another pass over DATA)."""
    args = (model_path, data_path, method, params, num_samples)
    rest = dict(progress=progress, preprocess=preprocess, log=log, histogram_samples=histogram_samples,
                memory_mb=memory_mb, feeds=feeds, shard=shard, channels=channels)
    return run_or_one_at_a_time(lambda size: _collect(*args, size, **rest), batch_size, log)


def collect_methods(model_path: str | Path, data_path: str | Path, methods: list[str], **kwargs
                    ) -> dict[str, Statistics]:
    """``collect`` of each of ``methods`` (default parameters; ``kwargs`` as for ``collect``), one
    pass over the data for the methods whose calibrators keep the same state (``shared_key``:
    percentile and mse keep the same histograms), read by each one's own calibrators."""
    def key(method: str):
        probe = make_calibrator(method)
        return probe.shared_key() if hasattr(probe, "shared_key") else None

    out: dict[str, Statistics] = {}
    for method in methods:
        mine = key(method)
        donor = next((m for m in out if mine is not None and key(m) == mine), None)
        out[method] = out[donor].read_as(method) if donor is not None else \
            collect(model_path, data_path, method, **kwargs)
    return out


def _collect(model_path, data_path, method, params, num_samples, batch_size, progress, preprocess, log,
             histogram_samples, memory_mb, feeds, shard, channels) -> Statistics:
    new_calibrator = calibrator_factory(method, params)
    new_calibrator()  # validate before any work
    check_sampling(num_samples, batch_size)
    check_memory(memory_mb)
    model, data = _model_and_data(model_path, data_path, preprocess)
    first, total = shard or (0, len(data) if num_samples is None else min(num_samples, len(data)))
    if feeds is not None:
        total = feeds.samples
    chosen = batch_is_chosen(model, batch_size) and feeds is None and shard is None
    typed, shapes, batch_size, note = _batching(model, data, total - first, batch_size, memory_mb)
    if log is not None:
        for vi in graph_inputs(model):
            axis = data.sample_axis(vi.name)  # None: fed whole, no axis of samples
            declared = ["N" if i == axis else (d if d else "?") for i, d in enumerate(input_shape(vi))]
            differ = [(d, s) for d, s in zip(declared, shapes[vi.name]) if d != s]
            # open dims the data fixes (a fixed one the data contradicts is the data's error, not a fix)
            if differ and all(not isinstance(d, int) for d, _ in differ) and len(declared) == len(shapes[vi.name]):
                log(f"input '{vi.name}': dims {declared} fixed to {shapes[vi.name]} from the data")
    names = needed_tensors(model, float_tensors(typed))
    stats = Statistics(Path(model_path).name, file_digest(model_path), method, typed_params(method, params),
                       0, shapes, {name: new_calibrator() for name in names},
                       data.preprocess.to_dict() if data.preprocess is not None else {})
    bodies = _bodies(model, typed, stats.calibrators, new_calibrator)
    update = _updater(model, typed, names, {n: stats.calibrators[n] for n in names}, histogram_samples, bodies,
                      stats.channel_ranges if channels else None, channels)
    with progress_bar(total - first, "calibrate", progress) as bar:
        try:
            for batch in (data.batches(batch_size, total, first) if feeds is None else feeds):
                try:
                    update(batch)
                except QtoolError as e:
                    if chosen and batch_size > 1 and stats.samples == 0 and data.samples_in(batch) > 1 \
                            and not isinstance(e, DataError):
                        raise OneAtATime(batch_size, e) from None
                    raise
                n = data.samples_in(batch)
                stats.samples += n
                bar.update(n)
        except BaseException:
            update.close(check=False)
            raise
        update.close()
    if bodies is not None:  # a branch the data never took has no statistics: quantize keeps it float
        stats.body_tensors = set(bodies.names())
        for name in bodies.unseen():
            stats.calibrators.pop(name, None)
    if log is not None and note and total > 1:
        log(note)
    return stats


def _batching(model, data: Dataset, samples: int, batch_size: int | None, memory_mb: int):
    """(``_fix_dims``'s typed model, the input shapes, the batch size, its log line) of a
    calibration of ``samples`` samples."""
    shape_batch = min(fixed_batch(model) or batch_size or CALIBRATE_BATCH_CAP, samples)
    typed, shapes = _fix_dims(model, data, shape_batch)
    batch_size, note = default_batch(model, data, batch_size, CALIBRATE_FACTOR, memory_mb,
                                     CALIBRATE_BATCH_CAP, (typed, shape_batch), held=fixed_bytes(weight_bytes(model)),
                                     live=True)
    return typed, shapes, batch_size, note


def batch_plan(model_path: str | Path, data_path: str | Path, num_samples: int | None = None,
               batch_size: int | None = None, memory_mb: int = DEFAULT_MEMORY_MB, preprocess=None
               ) -> tuple[int, int, str]:
    """(samples, batch size, its log line) of ``collect`` with these arguments: qtool/cluster.py
    cuts its shards at these batches, so that each batch is the one a single process runs."""
    check_sampling(num_samples, batch_size)
    check_memory(memory_mb)
    model, data = _model_and_data(model_path, data_path, preprocess)
    total = len(data) if num_samples is None else min(num_samples, len(data))
    return total, *_batching(model, data, total, batch_size, memory_mb)[2:]


class _Updates:
    """Feeds batches to onnxruntime and their statistics to the calibrators. With ``threaded``,
    the calibrators update on a worker thread: numpy bins batch i while onnxruntime runs batch
    i + 1. One worker, in batch order, so the result is the same as updating in line."""

    def __init__(self, run, apply, threaded: bool = True):
        self.run, self.apply = run, apply
        self.error: BaseException | None = None
        self.abandoned = False  # an error or an interrupt is on its way: no more updates wanted
        self.worker = None
        if threaded:
            self.pending: queue.Queue = queue.Queue(maxsize=1)
            self.worker = threading.Thread(target=self._work, name="qtool-calibrate", daemon=True)
            self.worker.start()

    def _work(self):
        while True:
            item = self.pending.get()
            if item is None:
                return
            if self.error is None and not self.abandoned:
                try:
                    self.apply(item)
                except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                    self.error = e

    def __call__(self, feeds):
        outputs = self.run(feeds)
        if self.worker is None:
            self.apply(outputs)
            return
        self._raise()
        self.pending.put(outputs)

    def close(self, check: bool = True):
        """Wait for the pending updates; raise what they raised. With ``check`` False (an error
        or an interrupt is on its way) nothing is waited for: the worker, a daemon, drops what it
        still gets. Waiting there could hang: a Ctrl-C that came inside the queue's own code
        left the worker asleep beside a value it was never told of (a run --jobs worker stopped
        in its calibrate waited for a minute, 1 stop in 20)."""
        if self.worker is not None and self.worker.is_alive():
            if not check:
                self.abandoned = True
                with contextlib.suppress(queue.Full):
                    self.pending.put_nowait(None)
                return
            self.pending.put(None)
            self.worker.join()
        if check:
            self._raise()

    def _raise(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _bodies(model, typed, calibrators_by_name: dict, new_calibrator) -> control.BodyStats | None:
    """The calibration of the tensors inside the model's If, Loop and Scan bodies (calibrators
    added to ``calibrators_by_name``), or None when it has none to calibrate."""
    if not any(control.is_control(node) for node in model.graph.node):
        return None
    types = {vi.name: vi.type for vi in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]}
    # the initializers the control nodes and their bodies read (the others would be copies for nothing)
    read = {n for node in model.graph.node if control.is_control(node) for n in node_reads(node)}
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name in read}
    bodies = control.BodyStats(model, needed_tensors, new_calibrator, calibrators_by_name, constants, types)
    return bodies if bodies.tensors() else None


def _updater(model, typed, names: list[str], calibrators_by_name: dict, histogram_samples: int,
             bodies: control.BodyStats | None = None, channel_ranges: dict | None = None,
             channels: list[str] = ()) -> _Updates:
    """A function feeding one batch to every calibrator: through statistics reduced inside
    onnxruntime when the method declares them, else through the full tensors. ``bodies``: the
    tensors inside control-flow bodies too (the run then also returns what their nodes read).
    ``channel_ranges``: filled with the per-channel min and max of ``channels`` where the reduced
    statistics keep a tensor's channels (rank 3 or more, known: ``stats_graph.build``)."""
    prototype = next(iter(calibrators_by_name.values()), None)
    reductions = getattr(prototype, "reductions", None)
    extra = list(bodies.feeds_needed) if bodies is not None else []

    def update_bodies(outputs):
        if bodies is not None:
            bodies.update(outputs)

    if not reductions or not hasattr(prototype, "update_reduced"):
        runner = FloatRunner(model, list(dict.fromkeys(names + extra)), layouts=False)

        def update_full(outputs):
            for name, calibrator in calibrators_by_name.items():
                calibrator.update(outputs[name])
            update_bodies(outputs)

        return _Updates(runner.run, update_full, threaded=False)  # full tensors: one batch at a time
    infos = [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]
    types = {vi.name: vi.type.tensor_type.elem_type for vi in infos}
    shapes = {vi.name: input_shape(vi) for vi in infos}
    cap = histogram_samples if histogram_samples > 0 else np.iinfo(np.int64).max
    stats_model, layout = stats_graph.build(model, names, types, shapes, set(reductions), cap)
    # without onnxruntime's blocked (NCHWc) convs: every activation read by a reduction is copied
    # back out of their layout, and the copies outlive the priority-based order's early frees.
    # Peak RSS at batch 8 with them, without: an NHWC ResNet-50 (opennsfw) 1169 -> 323 MB, so
    # the memory estimate (0.5 x a sample's activations) held 4x low; PP-OCRv4 rec 375 -> 231 MB,
    # det 475 -> 374 MB, PP-LCNet 538 -> 238 MB. Their 512-sample runs: within noise to 16% slower
    # (rec 7.6 -> 8.8 s on a quiet machine; bench/throughput.py 1.57x -> 1.45x of onnxruntime on a
    # busy one), 16-sample runs faster (a simpler session to build). And the tables are the same
    # on every CPU: with the blocked convs opennsfw's differed between an AVX-512 and an AVX2 host
    # (FloatRunner's note). The ordering is onnxruntime's: the nodes its layout pass adds (the
    # copies, and any reduction rewritten into the blocked form) get the highest indices, and its
    # priority order runs lower indices first, so they all wait for the end of the graph
    # histograms are binned on the worker thread while onnxruntime runs the next batch: its threads
    # spinning between kernels took the core the binning needed (PP-OCRv4 rec, kl over 512 lines:
    # 10.0-18.0 s, bimodal, against 9.4-10.6 s without spinning); minmax bins nothing and runs
    # faster with them spinning (7.1-7.2 against 7.7-7.8 s)
    runner = FloatRunner(stats_model, extra, spinning="sample" not in reductions, layouts=False)

    names_in_order = list(calibrators_by_name)
    ordered = [calibrators_by_name[n] for n in names_in_order]
    many = getattr(type(prototype), "update_reduced_many", None)
    per_channel = {t: layout[t] for t in channels if t in layout and len(shapes.get(t) or ()) >= 3}

    def update_reduced(outputs):
        for t, made in per_channel.items():
            lo, hi = (np.asarray(outputs[made[k]], np.float64) for k in ("min", "max"))
            if channel_ranges is not None and lo.ndim == 1 and lo.size:
                old = channel_ranges.get(t)
                channel_ranges[t] = (lo, hi) if old is None else (np.minimum(old[0], lo), np.maximum(old[1], hi))
        batch = stats_graph.unpack(outputs, layout)  # a tensor with no elements gives nothing
        if many is not None:  # one vectorised update for every tensor (histogram binning)
            present = [i for i, n in enumerate(names_in_order) if n in batch]
            many([ordered[i] for i in present], [batch[names_in_order[i]] for i in present])
        else:
            for name, calibrator in calibrators_by_name.items():
                if name in batch:
                    calibrator.update_reduced(batch[name])
        update_bodies(outputs)

    return _Updates(runner.run, update_reduced)


def calibrate(model_path: str | Path, data_path: str | Path, method: str = "minmax",
              num_samples: int | None = None, batch_size: int | None = None, progress: bool = True,
              params: dict | None = None, preprocess=None) -> Table:
    return collect(model_path, data_path, method, params, num_samples, batch_size, progress,
                   preprocess).table()


LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulInteger", "ConvInteger")


def past_last_layer(model: onnx.ModelProto) -> set[str]:
    """The main graph's tensors from which no Conv, ConvTranspose, MatMul or Gemm can be reached:
    a model's head after its last layer (scores, logits, decoded boxes)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)
    feeds_layer: dict[str, bool] = {}

    def reaches(reader: onnx.NodeProto) -> bool:  # a layer, a body that may hold one, or on the way
        return (reader.op_type in LAYERS or any(a.type == onnx.AttributeProto.GRAPH for a in reader.attribute)
                or any(feeds_layer.get(o, True) for o in reader.output))

    for node in reversed(model.graph.node):  # topological order: a node's readers come after it
        for out in node.output:
            feeds_layer[out] = any(reaches(r) for r in readers.get(out, []))
    return {t for t, reached in feeds_layer.items() if not reached}


def merge(paths: list[str | Path]) -> Table:
    if not paths:
        raise QtoolError("merge needs at least one statistics file")
    _each_once(paths)
    stats = Statistics.load(paths[0])
    for path in paths[1:]:
        stats.merge(Statistics.load(path), f"'{path}'")
    return stats.table()


def _each_once(paths: list[str | Path]) -> None:
    """A one-line error where a statistics file is given twice (the same path, another path to the
    same file, or a copy of its bytes): its samples would count twice. Files are hashed only where
    their sizes match; one that cannot be read is left to ``Statistics.load`` to report."""
    seen: list[tuple[str | Path, Path, int]] = []
    digests: dict[Path, str] = {}

    def digest(where: Path) -> str:
        if where not in digests:
            digests[where] = file_digest(where)
        return digests[where]

    for path in paths:
        try:
            where, size = Path(path).resolve(), Path(path).stat().st_size
        except OSError:
            continue
        for given, other, other_size in seen:
            if where == other or (size == other_size and digest(where) == digest(other)):
                same = ("is given twice" if str(given) == str(path) else f"is '{given}' again" if where == other
                        else f"has the same content as '{given}'")
                raise QtoolError(f"cannot merge '{path}': it {same}; merge takes the statistics of "
                                 f"disjoint shards, each once")
        seen.append((path, where, size))
