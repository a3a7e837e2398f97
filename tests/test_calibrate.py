"""calibrate as a whole: methods and parameters, shards and merge, data folders and images."""

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from qtool.calibrate import calibrate, collect, merge
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.model import FloatRunner, load_model, prepare

runner = CliRunner()
METHODS = ["minmax", "kl", "percentile", "mse", "aciq_gauss", "aciq_laplace"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_calibrates_the_demo(demo_model, demo_calib, method):
    table = calibrate(demo_model, demo_calib, method, progress=False)
    assert table.method == method and len(table.tensors) == 14
    for name, e in table.tensors.items():
        assert e.method == method and e.min <= 0 <= e.max and e.threshold > 0, name


def test_minmax_table_matches_a_direct_run(demo_model, demo_calib):
    table = calibrate(demo_model, demo_calib, progress=False)
    model = prepare(load_model(demo_model))
    x = np.load(demo_calib)["input"]
    outputs = FloatRunner(model, list(table.tensors), layouts=False).run({"input": x})  # the statistics session's kernels
    for name, e in table.tensors.items():
        assert (e.min, e.max) == (float(outputs[name].min()), float(outputs[name].max())), name


@pytest.mark.parametrize("method", ["minmax", "kl", "percentile"])
def test_shards_merge_to_the_single_pass(tmp_path, demo_model, demo_calib, method):
    x = np.load(demo_calib)["input"]
    np.savez(tmp_path / "a.npz", input=x[:100])
    np.savez(tmp_path / "b.npz", input=x[100:])
    for shard in ("a", "b"):
        collect(demo_model, tmp_path / f"{shard}.npz", method, progress=False).save(tmp_path / f"{shard}.stats.npz")
    merged = merge([tmp_path / "a.stats.npz", tmp_path / "b.stats.npz"])
    single = calibrate(demo_model, demo_calib, method, progress=False, batch_size=100)
    assert merged.samples == single.samples == 256
    assert merged.tensors == single.tensors  # exact: min/max and power-of-two histograms


def test_merge_refuses_other_methods(tmp_path, demo_model, demo_calib):
    collect(demo_model, demo_calib, "kl", progress=False).save(tmp_path / "kl.npz")
    collect(demo_model, demo_calib, "minmax", progress=False).save(tmp_path / "mm.npz")
    with pytest.raises(QtoolError, match="method 'minmax' differs from 'kl'"):
        merge([tmp_path / "kl.npz", tmp_path / "mm.npz"])


def test_merge_takes_a_default_spelled_out(tmp_path, demo_model, demo_calib):
    """Sweep 9: percentile=99.99 given in one shard and left at its default in the other are the
    same calibration (refused as 'params differs'); another value is still refused."""
    x = np.load(demo_calib)["input"]
    np.savez(tmp_path / "a.npz", input=x[:100])
    np.savez(tmp_path / "b.npz", input=x[100:])
    collect(demo_model, tmp_path / "a.npz", "percentile", progress=False).save(tmp_path / "a.stats.npz")
    collect(demo_model, tmp_path / "b.npz", "percentile", {"percentile": 99.99},
            progress=False).save(tmp_path / "b.stats.npz")
    collect(demo_model, tmp_path / "b.npz", "percentile", {"percentile": 99.9},
            progress=False).save(tmp_path / "c.stats.npz")
    merged = merge([tmp_path / "a.stats.npz", tmp_path / "b.stats.npz"])
    assert merged.tensors == calibrate(demo_model, demo_calib, "percentile", progress=False, batch_size=100).tensors
    with pytest.raises(QtoolError, match="params .*99.9.* differs from"):
        merge([tmp_path / "a.stats.npz", tmp_path / "c.stats.npz"])


def test_cli_stats_out_and_merge(tmp_path, demo_model, demo_calib):
    result = invoke("calibrate", demo_model, "-d", demo_calib, "--stats-out", tmp_path / "s.npz",
                    "--method", "percentile", "--param", "percentile=99.9", "-q")
    assert result.exit_code == 0, result.output
    result = invoke("merge", tmp_path / "s.npz", "-o", tmp_path / "t.yaml")
    assert result.exit_code == 0, result.output
    table = yaml.safe_load((tmp_path / "t.yaml").read_text())
    assert table["method"] == "percentile" and table["params"] == {"percentile": 99.9}
    assert table["input_shapes"] == {"input": ["N", 1, 8, 8]}


def test_params_are_recorded_as_numbers_whether_typed_or_given_as_text(tmp_path, demo_model, demo_calib):
    """--param's text and a job's (or the API's) numbers are the same parameters: the table and the
    statistics record them typed, so shards made either way merge."""
    x = np.load(demo_calib)["input"]
    np.savez(tmp_path / "a.npz", input=x[:64])
    np.savez(tmp_path / "b.npz", input=x[64:128])
    given = invoke("calibrate", demo_model, "-d", tmp_path / "a.npz", "--stats-out", tmp_path / "sa.npz",
                   "-o", tmp_path / "ta.yaml", "--method", "percentile", "--param", "percentile=99", "--param",
                   "bins=1024", "-q")
    assert given.exit_code == 0, given.output
    collect(demo_model, tmp_path / "b.npz", "percentile", {"percentile": 99, "bins": 1024},
            progress=False).save(tmp_path / "sb.npz")
    recorded = yaml.safe_load((tmp_path / "ta.yaml").read_text())["params"]
    assert recorded == {"bins": 1024, "percentile": 99.0}
    assert isinstance(recorded["percentile"], float) and isinstance(recorded["bins"], int)
    merged = merge([tmp_path / "sa.npz", tmp_path / "sb.npz"])
    assert merged.params == recorded and merged.samples == 128


def test_merge_refuses_a_shard_given_twice(tmp_path, demo_model, demo_calib):
    stats = tmp_path / "s.npz"
    assert invoke("calibrate", demo_model, "-d", demo_calib, "--stats-out", stats, "-q").exit_code == 0
    (tmp_path / "copy.npz").write_bytes(stats.read_bytes())
    (tmp_path / "sub").mkdir()
    disjoint = "merge takes the statistics of disjoint shards, each once"
    for again, said in ((stats, "it is given twice"), (tmp_path / "sub" / ".." / "s.npz", f"it is '{stats}' again"),
                        (tmp_path / "copy.npz", f"it has the same content as '{stats}'")):
        line = one_line_error(invoke("merge", stats, again, "-o", tmp_path / "t.yaml"))
        assert line == f"error: cannot merge '{again}': {said}; {disjoint}"
    assert not (tmp_path / "t.yaml").exists()


def test_params_reach_the_calibrator(demo_model, demo_calib):
    loose = calibrate(demo_model, demo_calib, "percentile", params={"percentile": "90"}, progress=False)
    tight = calibrate(demo_model, demo_calib, "percentile", params={"percentile": 99.999}, progress=False)
    assert loose.tensors["logits"].threshold < tight.tensors["logits"].threshold


@pytest.mark.parametrize("args, fragments", [
    (["--method", "kl", "--param", "nosuch=1"], ["unknown parameter 'nosuch'", "bins, levels, variant"]),
    (["--method", "kl", "--param", "variant=other"], ["unknown kl variant 'other'", "tensorrt"]),
    (["--method", "percentile", "--param", "percentile=abc"], ["must be float", "'abc'"]),
    (["--method", "percentile", "--param", "percentile=150"], ["percentile must be in (0, 100]"]),
    (["--param", "novalue"], ["NAME=VALUE", "'novalue'"]),
])
def test_bad_params_are_user_errors(tmp_path, demo_model, demo_calib, args, fragments):
    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml", *args, "-q")
    one_line_error(result, *fragments)
    assert list(tmp_path.iterdir()) == []


def test_calibrate_needs_an_output(demo_model, demo_calib):
    one_line_error(invoke("calibrate", demo_model, "-d", demo_calib), "-o TABLE", "--stats-out")


def test_merge_errors(tmp_path, demo_calib):
    one_line_error(invoke("merge", demo_calib, "-o", tmp_path / "t.yaml"), "not a qtool statistics file")
    one_line_error(invoke("merge", tmp_path / "none.npz", "-o", tmp_path / "t.yaml"), "not found")


def test_folder_of_npy_files_equals_the_npz(tmp_path, demo_model, demo_calib):
    x = np.load(demo_calib)["input"][:20]
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, sample in enumerate(x):
        np.save(folder / f"{i:03d}.npy", sample)
    np.savez(tmp_path / "x.npz", input=x)
    from_folder = calibrate(demo_model, folder, progress=False, batch_size=8)
    from_npz = calibrate(demo_model, tmp_path / "x.npz", progress=False, batch_size=8)
    assert from_folder.tensors == from_npz.tensors and from_folder.samples == 20


def test_folder_of_images_with_preprocessing(tmp_path, demo_model):
    from PIL import Image

    from qtool.data import Preprocess, load_dataset

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(3, 16, 16), dtype=np.uint8)
    for i, p in enumerate(pixels):
        Image.fromarray(p).save(folder / f"img{i}.png")
    pre = Preprocess(resize=(8, 8), mean=(0.5,), std=(0.25,), channels="gray")
    data = load_dataset(folder, prepare(load_model(demo_model)), pre)
    batch = data.batch(0, 3)["input"]
    assert batch.shape == (3, 1, 8, 8) and batch.dtype == np.float32
    expected = (np.asarray(Image.fromarray(pixels[0]).resize((8, 8), Image.BILINEAR), np.float32) / 255 - 0.5) / 0.25
    assert np.allclose(batch[0, 0], expected)
    table = calibrate(demo_model, folder, progress=False, preprocess=pre)
    assert table.samples == 3


def test_cli_image_folder_errors(tmp_path, demo_model):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "a.png")
    (folder / "b.png").write_bytes(b"not a png")
    out = tmp_path / "t.yaml"
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", out, "--channels", "gray", "-q"),
                   "image", "b.png", "cannot be read")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", out, "--channels", "cmyk", "-q"),
                   "unknown channel order 'cmyk'")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", out, "--resize", "8by8", "-q"),
                   "--resize takes HEIGHTxWIDTH")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", out, "--channels", "gray",
                          "--mean", "0.5,0.5,0.5", "-q"),
                   "preprocess mean [0.5, 0.5, 0.5] has 3 values but --channels gray has 1 channel: give one value")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", out, "--channels", "rgb",
                          "--std", "0.5,0.5", "-q"),
                   "preprocess std [0.5, 0.5] has 2 values but --channels rgb has 3 channels: give 1 or 3 values")
    assert not out.exists()


def test_dynamic_dims_are_reported(tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    import onnx

    w = np.ones((2, 3, 1, 1), np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "h", "w"])],
        [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((4, 3, 5, 7), np.float32))
    result = invoke("calibrate", tmp_path / "m.onnx", "-d", tmp_path / "d.npz", "-o", tmp_path / "t.json")
    assert result.exit_code == 0, result.output
    assert "input 'x': dims ['N', 3, 'h', 'w'] fixed to ['N', 3, 5, 7] from the data" in result.stderr
    assert json.loads((tmp_path / "t.json").read_text())["input_shapes"] == {"x": ["N", 3, 5, 7]}


def test_images_of_another_size_than_the_models_fixed_one_get_the_error_alone(tmp_path, demo_model):
    """The demo's input is fixed at 8x8: images resized to 16x16 are refused, without a log line
    saying the data fixed its dims to 16x16 first (it did not: only open dims are fixed)."""
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((16, 16), 40 * i, np.uint8)).save(folder / f"im{i}.png")
    result = invoke("calibrate", demo_model, "-d", folder, "--channels", "gray", "--resize", "16x16",
                    "-o", tmp_path / "t.yaml")
    one_line_error(result, "has shape [3, 1, 16, 16]; model expects [N,1,8,8] (axis 2 differs)")


def test_third_party_calibrator_through_entry_points(monkeypatch, demo_model, demo_calib):
    import calibrators
    from calibrators import Range

    class Half:
        """A plugin: the range of min/max halved."""

        name = "half"

        def __init__(self):
            self.lo, self.hi = np.inf, -np.inf

        def update(self, x):
            self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

        def merge(self, other):
            self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

        def result(self):
            return Range(self.lo / 2, self.hi / 2, max(-self.lo, self.hi) / 2)

    class EntryPoint:
        name = "half"

        def load(self):
            return Half

    monkeypatch.setattr(calibrators, "entry_points", lambda group: [EntryPoint()] if group == "qtool.calibrators" else [])
    monkeypatch.setattr(calibrators, "REGISTRY", dict(calibrators.REGISTRY))  # undone after the test
    assert "half" in calibrators.names()
    half = calibrate(demo_model, demo_calib, "half", progress=False)  # full tensors: no reductions
    full = calibrate(demo_model, demo_calib, "minmax", progress=False)
    assert half.tensors["logits"].max == full.tensors["logits"].max / 2


def _job(tmp_path, demo_model, demo_calib, demo_heldout, calibrate_section):
    job = {"model": str(demo_model), "output_dir": str(tmp_path / "out"),
           "calibrate": {"data": str(demo_calib), **calibrate_section},
           "verify": {"data": str(demo_heldout)}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_job_with_method_params(tmp_path, demo_model, demo_calib, demo_heldout):
    path = _job(tmp_path, demo_model, demo_calib, demo_heldout,
                {"method": "percentile", "params": {"percentile": 99.9}})
    result = invoke("run", path, "-q")
    assert result.exit_code == 0, result.output
    table = yaml.safe_load((tmp_path / "out" / "digits_cnn.table.yaml").read_text())
    assert table["method"] == "percentile" and table["params"] == {"percentile": 99.9}


@pytest.mark.parametrize("section, fragments", [
    ({"method": "kl", "params": {"nosuch": 1}}, ["calibrate.params", "unknown parameter 'nosuch'"]),
    ({"params": [1]}, ["calibrate.params", "expected a mapping"]),
    ({"preprocess": {"channels": "cmyk"}}, ["calibrate.preprocess.channels", "unknown 'cmyk'"]),
    ({"preprocess": {"resize": [48]}}, ["calibrate.preprocess.resize", "[height, width]"]),
    ({"preprocess": {"mean": ["a"]}}, ["calibrate.preprocess.mean", "expected numbers"]),
    ({"preprocess": {"gamma": 2}}, ["calibrate.preprocess.gamma", "unknown key"]),
])
def test_job_rejects_bad_calibrate_settings(tmp_path, demo_model, demo_calib, demo_heldout, section, fragments):
    path = _job(tmp_path, demo_model, demo_calib, demo_heldout, section)
    one_line_error(invoke("run", path, "-q"), f"job file '{path}'", *fragments)
    assert not (tmp_path / "out").exists()


def test_histogram_samples_flag(tmp_path, demo_model, demo_calib):
    one_line_error(invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml",
                          "--histogram-samples", "-1", "-q"), "--histogram-samples must be >= 0")
    result = invoke("calibrate", demo_model, "-d", demo_calib, "-o", tmp_path / "t.yaml",
                    "--method", "kl", "--histogram-samples", "0", "-q")
    assert result.exit_code == 0, result.output


def test_stats_out_needs_calibrator_state(tmp_path, monkeypatch, demo_model, demo_calib):
    import calibrators

    class Stateless:
        name = "stateless"

        def __init__(self):
            self.peak = 0.0

        def update(self, x):
            self.peak = max(self.peak, float(np.abs(x).max()))

        def merge(self, other):
            self.peak = max(self.peak, other.peak)

        def result(self):
            return calibrators.Range(-self.peak, self.peak, self.peak)

    monkeypatch.setattr(calibrators, "REGISTRY", {**calibrators.REGISTRY, "stateless": Stateless})
    result = invoke("calibrate", demo_model, "-d", demo_calib, "--stats-out", tmp_path / "s.npz",
                    "--method", "stateless", "-q")
    one_line_error(result, "method 'stateless' cannot save its statistics")
    assert not (tmp_path / "s.npz").exists()


def test_images_cannot_feed_a_two_input_model(tmp_path):
    from onnx import TensorProto, helper
    import onnx
    from PIL import Image

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"], name="add")], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 3, 4, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
              tmp_path / "m.onnx")
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(folder / "a.png")
    result = invoke("calibrate", tmp_path / "m.onnx", "-d", folder, "-o", tmp_path / "t.yaml",
                    "--input", "a", "-q")
    one_line_error(result, f"data folder '{folder}'", "no data for model input 'b'")


def _expand_model(tmp_path):
    """A model whose largest tensor only a run sizes: an Expand to a shape computed at run time,
    as a ViT's attention behind run-time reshapes. (model, its data, that tensor's bytes a sample)"""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qtool.data import load_dataset

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Mul", ["rows", "scale"], ["r"]),  # computed: inference does not follow it
             helper.make_node("Concat", ["n", "r", "width"], ["shape"], axis=0),
             helper.make_node("Expand", ["x", "shape"], ["big"]),
             helper.make_node("ReduceMean", ["big"], ["y"], axes=[1], keepdims=0)]
    inits = [numpy_helper.from_array(np.array(v, np.int64), k)
             for k, v in (("zero", [0]), ("one", [1]), ("rows", [1024]), ("scale", [4]), ("width", [256]))]
    graph = helper.make_graph(nodes, "expand", [helper.make_tensor_value_info("x", f, ["N", 1, 256])],
                              [helper.make_tensor_value_info("y", f, ["N", 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((3, 1, 256), np.float32))
    return model, load_dataset(tmp_path / "d.npz", model), 4096 * 256 * 4


def test_the_batch_estimate_counts_tensors_inference_cannot_size(tmp_path):
    """A tensor whose size only a run tells counts in the per-sample estimate: measured on sample 0."""
    from qtool.sizing import activation_sizes, sample_bytes

    model, data, expanded = _expand_model(tmp_path)
    assert sum(activation_sizes(model, data)[0].values()) < expanded  # inference alone misses it
    assert sample_bytes(model, data) >= expanded


def test_the_batch_estimate_of_an_int16_model_needs_no_run(demo_model, demo_table, demo_calib, monkeypatch):
    # int16 QDQ is written with com.microsoft QuantizeLinear, where onnx's inference stops: the
    # estimate once counted a third of the tensors (det at 320: 29 MB a sample, batch 8, 1 GB
    # peak), then measured the rest by running the quantized model in onnxruntime (exec of one
    # rec line: 0.8 s and 200 MB more). Inference now goes through those nodes as Casts: every tensor
    # is sized without a run, the same float tensors as the int8 model's.
    import qtool.sizing as sizing
    from qtool.data import load_dataset
    from qtool.quantize import QuantizeOptions, quantize

    def refuse(*args, **kwargs):
        raise AssertionError("onnxruntime was run to size the tensors")

    monkeypatch.setattr(sizing, "FloatRunner", refuse)
    estimates = {}
    for width in ("int8", "int16"):
        qmodel, _ = quantize(demo_model, demo_table, QuantizeOptions(activation_type=width))
        assert any(n.domain == "com.microsoft" for n in qmodel.graph.node) == (width == "int16")
        data = load_dataset(demo_calib, qmodel)
        sizes, unsized = sizing.activation_sizes(qmodel, data)
        assert unsized == []
        estimates[width] = (sizes, sizing.sample_bytes(qmodel, data))
    assert estimates["int16"] == estimates["int8"] and estimates["int8"][1] > 0


def test_the_batch_estimate_goes_on_when_onnxruntime_cannot_run_the_probe(tmp_path, monkeypatch):
    # exec runs the integer executor, not onnxruntime: a model onnxruntime refuses still gets an
    # estimate (the typed tensors' bytes) instead of an error from the probe
    import qtool.sizing as sizing

    model, data, _ = _expand_model(tmp_path)
    sizes, unsized = sizing.activation_sizes(model, data)
    assert unsized

    def refuse(*args, **kwargs):
        raise RuntimeError("onnxruntime: no kernel for this op")

    monkeypatch.setattr(sizing, "FloatRunner", refuse)
    assert sizing.sample_bytes(model, data) == sum(sizes.values()) > 0


def test_the_probe_runs_the_nodes_up_to_the_last_unsized_tensor(tmp_path):
    # a session on the whole model returning every tensor held a sample's activations all at
    # once (onnxruntime keeps a run's outputs alive): the probe stops at the last tensor to size
    import onnx
    from onnx import helper

    from qtool.data import load_dataset
    from qtool.sizing import activation_sizes, probe_model, tensor_sizes

    model, _, expanded = _expand_model(tmp_path)
    # three more nodes after it, one of them far larger than anything before
    tail = [helper.make_node("Tile", ["y", "reps"], ["wide"]), helper.make_node("Relu", ["wide"], ["z"]),
            helper.make_node("ReduceMax", ["z"], ["out"], axes=[1], keepdims=0)]
    model.graph.node.extend(tail)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 4096], np.int64), "reps"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["N"]))
    onnx.save(model, tmp_path / "m2.onnx")
    data = load_dataset(tmp_path / "d.npz", model)
    sizes, unsized = activation_sizes(model, data)
    assert "big" in unsized and not {"wide", "z"} & set(unsized)
    probe = probe_model(model, unsized)
    assert [n.op_type for n in probe.graph.node][-1] == "Expand"  # Tile, Relu and ReduceMax not run
    assert [o.name for o in probe.graph.output] == list(dict.fromkeys(unsized))
    assert "reps" not in {t.name for t in probe.graph.initializer}  # what its nodes do not read
    found = tensor_sizes(model, data)
    assert found["big"] == expanded and found["wide"] == sizes["wide"]


def test_without_weight_bytes_leaves_the_model_as_it_was(demo_model, demo_table):
    import onnx

    from qtool.model import load_model, without_weight_bytes
    from qtool.quantize import quantize

    for model, any_type in ((load_model(demo_model), False), (quantize(demo_model, demo_table)[0], True)):
        before = model.SerializeToString()
        light = without_weight_bytes(model, any_type)
        assert model.SerializeToString() == before
        emptied = [t for t in light.graph.initializer if not t.raw_data]
        whole = {t.name: t for t in model.graph.initializer}
        assert emptied and all(list(t.dims) == list(whole[t.name].dims) and t.data_type == whole[t.name].data_type
                               for t in emptied)
        if any_type:  # the int8 weights too
            assert any(t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) for t in emptied)
        # the rest of the model is copied as it is
        for t in light.graph.initializer:
            t.raw_data = whole[t.name].raw_data
        assert light.SerializeToString() == before


@pytest.mark.parametrize("method, spinning", [("minmax", "1"), ("kl", "0"), ("percentile", "0")])
def test_onnxruntime_threads_sleep_while_histograms_are_binned(demo_model, demo_calib, method, spinning,
                                                                monkeypatch):
    # the binning thread works while onnxruntime runs the next batch: onnxruntime's threads do not
    # spin between kernels then (they took its core); minmax bins nothing and keeps them spinning
    import qtool.calibrate as calibrate_module

    sessions = []
    real = calibrate_module.FloatRunner

    def recorded(*args, **kwargs):
        runner = real(*args, **kwargs)
        sessions.append(runner.session)
        return runner

    monkeypatch.setattr(calibrate_module, "FloatRunner", recorded)
    table = calibrate(demo_model, demo_calib, method=method, progress=False)
    assert table.tensors and len(sessions) == 1
    options = sessions[0].get_session_options()
    try:
        entry = options.get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # not set: onnxruntime's default, spinning
        entry = "1"
    assert entry == spinning


def test_the_statistics_session_runs_without_onnxruntimes_layout_optimizations(demo_model, demo_calib, monkeypatch):
    """Every activation is read by a reduction, so onnxruntime's blocked (NCHWc) convs would copy
    each one back out of their layout, and the copies outlive the early frees: an NHWC ResNet-50
    held 4x the memory the batch was chosen for. The session is built without them (EXTENDED),
    and two runs give the same table."""
    import onnxruntime as ort

    import qtool.calibrate as calibrate_module
    levels = []
    built = ort.InferenceSession.__init__

    def recording(self, model, options=None, *args, **kwargs):
        if options is not None and not options.optimized_model_filepath:
            levels.append(options.graph_optimization_level)
        built(self, model, options, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", recording)
    first = calibrate_module.calibrate(demo_model, demo_calib, progress=False)
    assert levels and set(levels) == {ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}
    again = calibrate_module.calibrate(demo_model, demo_calib, progress=False)
    assert first.tensors == again.tensors


def _nhwc_model(tmp_path):
    """A channels-last model as Keras exports it: x [N, h, w, 3] -> Transpose -> Conv."""
    from onnx import TensorProto, helper, numpy_helper
    import onnx

    w = np.random.default_rng(0).normal(0, 1, (2, 3, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t"], name="to_nchw", perm=[0, 3, 1, 2]),
         helper.make_node("Conv", ["t", "w"], ["y"], name="conv")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "h", "w", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, "h", "w"])],
        [numpy_helper.from_array(w, "w")])
    path = tmp_path / "nhwc.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path


def _rgb_images(folder, count=3):
    from PIL import Image

    folder.mkdir()
    for i in range(count):
        Image.fromarray(np.full((6, 6, 3), 40 * i, np.uint8)).save(folder / f"im{i}.png")
    return folder


def test_images_for_a_channels_last_input_ask_for_layout_nhwc(tmp_path):
    model, folder, out = _nhwc_model(tmp_path), _rgb_images(tmp_path / "images"), tmp_path / "t.yaml"
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).random((4, 6, 6, 3), np.float32))
    qmodel = tmp_path / "q.onnx"  # quantized from arrays: it records no image preprocessing
    assert invoke("calibrate", model, "-d", tmp_path / "d.npz", "-o", tmp_path / "a.yaml", "-q").exit_code == 0
    assert invoke("quantize", model, "-t", tmp_path / "a.yaml", "-o", qmodel, "-q").exit_code == 0
    message = ("input 'x' is [N,h,w,3]: it looks NHWC (channels last) but the images are laid out NCHW; "
               "give --layout nhwc")
    for extra in ([], ["--resize", "6x6"]):
        line = one_line_error(invoke("calibrate", model, "-d", folder, "-o", out, *extra, "-q"))
        assert line == f"error: {message}"
        line = one_line_error(invoke("verify", model, qmodel, "-d", folder, *extra, "-q"))
        assert line == f"error: {message}"
    assert not out.exists()
    result = invoke("calibrate", model, "-d", folder, "-o", out, "--resize", "6x6", "--layout", "nhwc", "-q")
    assert result.exit_code == 0, result.output


def test_images_of_other_channels_than_the_input_are_one_line(tmp_path, demo_model):
    folder = _rgb_images(tmp_path / "images")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", tmp_path / "t.yaml", "-q"),
                   "input 'input' is [N,1,8,8]: it takes 1 channel but the images are read as rgb (3); "
                   "give --channels gray")
    one_line_error(invoke("calibrate", _nhwc_model(tmp_path), "-d", folder, "-o", tmp_path / "t.yaml",
                          "--layout", "nhwc", "--channels", "gray", "--resize", "6x6", "-q"),
                   "input 'x' is [N,h,w,3]: it takes 3 channels but the images are read as gray (1); "
                   "give --channels rgb or bgr")


@pytest.mark.parametrize("batch, where", [
    ([], "data folder '{folder}' batch of files 'im0.png' to 'im2.png' for input 'input'"),
    (["--batch-size", "1"], "data folder '{folder}' file 'im0.png' for input 'input'")])
def test_a_folder_batch_of_the_wrong_size_names_the_folder(tmp_path, demo_model, batch, where):
    folder = _rgb_images(tmp_path / "images")
    one_line_error(invoke("calibrate", demo_model, "-d", folder, "-o", tmp_path / "t.yaml", "--channels", "gray",
                          "--resize", "6x6", *batch, "-q"),
                   where.format(folder=folder), "model expects [N,1,8,8] (axis 2 differs)")
