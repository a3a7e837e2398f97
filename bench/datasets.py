"""Deterministic, offline datasets for the PP-OCR models shipped in the `rapidocr-onnxruntime` wheel.

Every builder returns float32 NCHW arrays preprocessed exactly as rapidocr 1.4.4 feeds its models
(read from its `ch_ppocr_rec/text_recognize.py`, `ch_ppocr_cls/text_cls.py`,
`ch_ppocr_det/utils.py` and `config.yaml`):

- images are in **BGR** channel order (rapidocr loads with OpenCV);
- rec / cls: resize to height 48 keeping the aspect ratio (width `ceil(48*w/h)`, squeezed to the
  target width if wider), `x/255`, `(x-0.5)/0.5`, then pad on the right with 0 (mid-grey after
  normalisation) to the target width (320 for rec, 192 for cls);
- det: `x/255`, `(x-mean)/std` with rapidocr's `mean = std = [0.5, 0.5, 0.5]` (its config.yaml and
  `DetPreProcess` defaults; PaddleOCR itself trains det with ImageNet mean/std, available here as
  `norm="imagenet"`), side lengths multiples of 32.

Builders (each seed draws from its own random stream, and the strings of seeds 0..15 are pairwise
disjoint; use seed 0 for calibration, 1 for evaluation):

    text_lines(n, seed, width=320) -> (x [n,3,48,width], strings)      # PP-OCRv4 rec
    cls_lines(n, seed)             -> (x [n,3,48,192], labels int64)   # 0 upright, 1 rotated 180
    det_crops(n, seed, size=640)   -> x [n,3,size,size]                # PP-OCRv4 det

Text is rendered with Pillow and the DejaVu TTF fonts in /usr/share/fonts/truetype/dejavu/;
photos come from `skimage.data` (only images shipped inside scikit-image, no download).
The first k samples of a set do not depend on n.

Helpers: `model_path("rec"|"det"|"cls")`, `rec_charset()` (the dictionary stored in the rec model's
metadata under key `character`, with rapidocr's blank at index 0 and space appended last),
`ctc_decode(logits, charset)` (greedy CTC).

Run `python bench/datasets.py` to write a sample grid to /tmp/bench_samples.png and check the float
models on the data (rec exact-string accuracy, cls accuracy, det output statistics);
`--no-models` skips the check.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import math
import os
import string
import zlib

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONT_DIR = "/usr/share/fonts/truetype/dejavu"
FONTS = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansCondensed.ttf", "DejaVuSansCondensed-Bold.ttf",
    "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
    "DejaVuSerifCondensed.ttf", "DejaVuSerif-BoldItalic.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
)
REC_HEIGHT = 48
CLS_WIDTH = 192
# skimage.data images that ship inside the scikit-image wheel (no pooch download)
PHOTOS = (
    "astronaut", "coffee", "chelsea", "rocket", "page", "text", "camera", "brick", "grass",
    "gravel", "coins", "moon", "hubble_deep_field", "immunohistochemistry", "clock", "cell",
    "colorwheel",
)
DET_NORMS = {"rapidocr": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
             "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
# a string belongs to seed s only if crc32(string) % SEED_BUCKETS == s % SEED_BUCKETS, so seeds
# 0..SEED_BUCKETS-1 give pairwise disjoint strings (rendering differs for every seed anyway)
SEED_BUCKETS = 16
# stream tags so text_lines(seed=0) and cls_lines(seed=0) differ
_TAG_REC, _TAG_CLS, _TAG_DET = 101, 202, 303

WORDS = """
account address after again air almost also always amount animal answer apple april area around
august autumn baby back bank basket battery beach bench best better bicycle bird black blue board
boat body book bottle box bread bridge bright brown build business butter button cable camera
candle capital card carry castle center chair change chapter cheese chicken child circle city class
clean clock close cloud coffee cold color corner cotton country cover credit cross current dance
dark daughter day december delivery design desk dinner direct doctor door double dream drive early
earth east easy edge energy engine evening exit family farm fast father february field figure
final finger fire first floor flower follow forest form free friday friend front fruit full garden
glass gold good green ground group guide hand happy harbor heart heavy help high history holiday
home hope horse hospital hotel hour house invoice island january july june kitchen label lake
large later leaf left letter level light limit line little local lunch machine magic main march
market may meeting member message metal middle minute monday money month morning mountain music
name nature near network never news night north note november number object ocean october office
open orange order page paper park party pencil people phone picture piece place plant plate please
point police price print public purple quick quiet radio rain receipt record river road room round
saturday school science season second service seven shop short signal silver simple small smile
snow south space speed spring square station stone store street summer sunday supply table ticket
total tower town train travel tree tuesday under union update valley value village visit voice
water wednesday week west white window winter world yellow young zero
""".split()
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_REC_ALPHABET = set(string.printable[:95])  # printable ASCII incl. space; all in the rec charset


# ---------------------------------------------------------------- models and decoding

def model_dir() -> str:
    """Folder holding the PP-OCR .onnx files inside the installed rapidocr-onnxruntime wheel."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        raise FileNotFoundError("rapidocr-onnxruntime is not installed "
                                "(pip install --no-deps rapidocr-onnxruntime==1.4.4)")
    return os.path.join(spec.submodule_search_locations[0], "models")


def model_path(kind: str) -> str:
    """Path of the shipped model: kind is "rec", "det" or "cls"."""
    names = {"rec": "ch_PP-OCRv4_rec_infer.onnx", "det": "ch_PP-OCRv4_det_infer.onnx",
             "cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx"}
    if kind not in names:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(names)}")
    return os.path.join(model_dir(), names[kind])


@functools.lru_cache(maxsize=4)
def rec_charset(path: str | None = None) -> tuple[str, ...]:
    """The rec model's output alphabet, index-aligned with its last axis.

    The dictionary (6623 entries, one per line) is stored in the ONNX metadata_props under key
    `character`; like rapidocr's CTCLabelDecode we append " " and insert the CTC blank at 0,
    giving 6625 = the model's output width.
    """
    import onnx

    model = onnx.load(path or model_path("rec"), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if "character" not in meta:
        raise ValueError(f"{path}: no 'character' key in metadata_props (keys: {sorted(meta)})")
    return ("blank", *meta["character"].splitlines(), " ")


def ctc_decode(logits: np.ndarray, charset) -> list[str]:
    """Greedy CTC: argmax per step, collapse repeats, drop the blank (index 0). logits [N,T,C]."""
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[2] != len(charset):
        raise ValueError(f"logits shape {logits.shape} does not match charset of {len(charset)}")
    best = logits.argmax(axis=2)
    keep = np.ones_like(best, dtype=bool)
    keep[:, 1:] = best[:, 1:] != best[:, :-1]
    keep &= best != 0
    return ["".join(charset[i] for i in row[k]) for row, k in zip(best, keep)]


# ---------------------------------------------------------------- text content

def _word(rng) -> str:
    w = WORDS[rng.integers(len(WORDS))]
    style = rng.random()
    return w.upper() if style < 0.2 else w.capitalize() if style < 0.5 else w


def _token(rng) -> str:
    kind = rng.choice(["word"] * 6 + ["int", "date", "price", "time", "code", "pct", "phone"])
    r = rng.integers
    if kind == "word":
        return _word(rng)
    if kind == "int":
        return str(r(0, 10 ** int(r(1, 7))))
    if kind == "date":
        d = datetime.date(1990, 1, 1) + datetime.timedelta(days=int(r(0, 15000)))
        fmt = r(3)
        return (d.isoformat() if fmt == 0 else d.strftime("%d/%m/%Y") if fmt == 1
                else f"{MONTHS[d.month - 1]} {d.day}, {d.year}")
    if kind == "price":
        v = f"{r(0, 2000)}.{r(0, 100):02d}"
        return rng.choice([f"${v}", f"{v} EUR", f"USD {v}", f"{v}"])
    if kind == "time":
        return f"{r(0, 24):02d}:{r(0, 60):02d}"
    if kind == "code":
        letters = "".join(rng.choice(list(string.ascii_uppercase), size=int(r(1, 4))))
        return rng.choice([f"{letters}-{r(10, 100000)}", f"No.{r(1, 1000)}", f"#{r(1, 10000)}"])
    if kind == "pct":
        return f"{r(0, 100)}.{r(0, 10)}%"
    return f"{r(100, 1000)}-{r(0, 10000):04d}"


def _line_text(rng, max_tokens: int) -> str:
    text = " ".join(_token(rng) for _ in range(int(rng.integers(1, max_tokens + 1))))
    assert set(text) <= _REC_ALPHABET, text
    return text


# ---------------------------------------------------------------- rendering

@functools.lru_cache(maxsize=512)
def _font(name: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(os.path.join(FONT_DIR, name), size)


def _light(rng) -> tuple:
    base = rng.integers(200, 256)
    return tuple(int(np.clip(base + rng.integers(-25, 26), 170, 255)) for _ in range(3))


def _dark(rng) -> tuple:
    base = rng.integers(0, 70)
    return tuple(int(np.clip(base + rng.integers(-30, 31), 0, 110)) for _ in range(3))


def _render_line(rng, text: str) -> np.ndarray:
    """One text line, cropped like a detector box: the font's line height plus small margins.

    Side margins stay under ~1/8 of the line height: PP-OCRv4 rec reads wider blank margins as
    leading/trailing spaces (at 1/3 of the line height a third of the lines gain one).
    """
    font = _font(FONTS[rng.integers(len(FONTS))], int(rng.integers(22, 49)))
    ascent, descent = font.getmetrics()
    left, _, right, _ = font.getbbox(text)
    line_h = ascent + descent
    top, bottom = (int(rng.integers(1, max(2, line_h // 6))) for _ in range(2))
    lm, rm = (int(rng.integers(1, max(2, line_h // 8))) for _ in range(2))
    canvas = Image.new("RGB", (right - left + lm + rm, line_h + top + bottom), _light(rng))
    ImageDraw.Draw(canvas).text((lm - left, top), text, font=font, fill=_dark(rng))
    img = np.asarray(canvas, dtype=np.float32)
    sigma = rng.uniform(0, 4)
    img = img + rng.normal(0, sigma, img.shape) if sigma > 0.5 else img
    return np.clip(img, 0, 255).astype(np.uint8)


def _resized_width(img: np.ndarray, height: int = REC_HEIGHT) -> int:
    h, w = img.shape[:2]
    return int(math.ceil(height * w / h))


def _line_to_tensor(img_rgb: np.ndarray, width: int, height: int = REC_HEIGHT) -> np.ndarray:
    """rapidocr's rec/cls resize_norm_img on a BGR image: [3,height,width] float32."""
    resized_w = min(width, _resized_width(img_rgb, height))
    resized = Image.fromarray(img_rgb).resize((resized_w, height), Image.BILINEAR)
    chw = np.asarray(resized, dtype=np.float32)[:, :, ::-1].transpose(2, 0, 1)
    out = np.zeros((3, height, width), dtype=np.float32)
    out[:, :, :resized_w] = (chw / 255.0 - 0.5) / 0.5
    return out


def _fitting_line(rng, seed: int, width: int, max_tokens: int, seen: set) -> tuple[np.ndarray, str]:
    """Render a new string of the seed's bucket whose aspect-preserved width fits unsqueezed."""
    while True:
        text = _line_text(rng, max_tokens)
        if text in seen or zlib.crc32(text.encode()) % SEED_BUCKETS != seed % SEED_BUCKETS:
            continue
        img = _render_line(rng, text)
        if _resized_width(img) <= width:
            seen.add(text)
            return img, text


# ---------------------------------------------------------------- builders

def text_lines(n: int, seed: int, width: int = 320) -> tuple[np.ndarray, list[str]]:
    """n rendered single text lines for PP-OCRv4 rec: (x [n,3,48,width] float32, strings).

    Strings are distinct within a set, disjoint between seeds 0..15 (see SEED_BUCKETS), and fit
    `width` at height 48 without squeezing.
    """
    rng = np.random.default_rng([seed, _TAG_REC])
    x = np.zeros((n, 3, REC_HEIGHT, width), dtype=np.float32)
    seen: set = set()
    strings = []
    for i in range(n):
        img, text = _fitting_line(rng, seed, width, max_tokens=4, seen=seen)
        x[i] = _line_to_tensor(img, width)
        strings.append(text)
    return x, strings


def cls_lines(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n text lines for the 0/180 degree classifier: (x [n,3,48,192] float32, labels [n] int64).

    Exactly one of each consecutive pair is rotated by 180 degrees (label 1), which one is random.
    """
    rng = np.random.default_rng([seed, _TAG_CLS])
    x = np.zeros((n, 3, REC_HEIGHT, CLS_WIDTH), dtype=np.float32)
    labels = np.zeros(n, dtype=np.int64)
    seen: set = set()
    for i in range(n):
        if i % 2 == 0:
            flip_first = bool(rng.integers(2))
        labels[i] = int(flip_first == (i % 2 == 0))
        img, _ = _fitting_line(rng, seed, CLS_WIDTH, max_tokens=2, seen=seen)
        if labels[i]:
            img = np.ascontiguousarray(img[::-1, ::-1])
        x[i] = _line_to_tensor(img, CLS_WIDTH)
    return x, labels


@functools.lru_cache(maxsize=None)
def _photo(name: str) -> np.ndarray:
    import skimage.data

    img = getattr(skimage.data, name)()
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3])


def _photo_crop(rng, size: int) -> np.ndarray:
    img = Image.fromarray(_photo(PHOTOS[rng.integers(len(PHOTOS))]))
    w, h = img.size
    scale = size / min(w, h) * rng.uniform(1.0, 1.6)
    img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
    x0 = int(rng.integers(0, img.size[0] - size + 1))
    y0 = int(rng.integers(0, img.size[1] - size + 1))
    return np.asarray(img.crop((x0, y0, x0 + size, y0 + size)))


def _text_page(rng, size: int) -> np.ndarray:
    """A page of paragraphs: blocks of lines, each block with its own font, size and colour."""
    page = Image.new("RGB", (size, size), _light(rng))
    draw = ImageDraw.Draw(page)
    y = int(rng.integers(4, size // 10))
    while y < size:
        font = _font(FONTS[rng.integers(len(FONTS))], int(rng.integers(max(12, size // 48), size // 14)))
        ink, left = _dark(rng), int(rng.integers(4, size // 8))
        right = size - int(rng.integers(4, size // 6))
        ascent, descent = font.getmetrics()
        step = int((ascent + descent) * rng.uniform(1.15, 1.7))
        for _ in range(int(rng.integers(1, 7))):
            line = ""
            while True:
                cand = (line + " " + _token(rng)).strip()
                if font.getlength(cand) > right - left:
                    break
                line = cand
            draw.text((left, y), line, font=font, fill=ink)
            y += step
            if y >= size:
                break
        y += int(step * rng.uniform(0.5, 2.0))
    img = np.asarray(page, dtype=np.float32)
    img = img + rng.normal(0, rng.uniform(0, 4), img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def det_crops(n: int, seed: int, size: int = 640, norm: str = "rapidocr") -> np.ndarray:
    """n images for PP-OCRv4 det: x [n,3,size,size] float32 (size a multiple of 32).

    Each sample is, with equal chance, a random crop of a scikit-image sample photo (rescaled so
    its short side covers the crop) or a rendered page of text paragraphs.
    """
    if size % 32:
        raise ValueError(f"det input size {size} must be a multiple of 32")
    if norm not in DET_NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {sorted(DET_NORMS)}")
    mean, std = (np.array(v, dtype=np.float32)[:, None, None] for v in DET_NORMS[norm])
    rng = np.random.default_rng([seed, _TAG_DET])
    x = np.zeros((n, 3, size, size), dtype=np.float32)
    for i in range(n):
        img = _text_page(rng, size) if rng.random() < 0.5 else _photo_crop(rng, size)
        chw = img[:, :, ::-1].transpose(2, 0, 1).astype(np.float32) / 255.0
        x[i] = (chw - mean) / std
    return x


# ---------------------------------------------------------------- looking at the data

def to_image(chw: np.ndarray, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> np.ndarray:
    """Undo the normalisation and BGR order: [3,H,W] float32 -> [H,W,3] uint8 RGB."""
    m, s = (np.array(v, dtype=np.float32)[:, None, None] for v in (mean, std))
    return np.clip((chw * s + m) * 255.0 + 0.5, 0, 255).astype(np.uint8)[::-1].transpose(1, 2, 0)


def save_grid(path: str, rec=None, cls=None, det=None) -> None:
    """Write a PNG: rec lines (with their strings), cls lines (with labels), det crops at 1/2."""
    tiles = []  # (image, caption)
    if rec is not None:
        tiles += [(to_image(x), s) for x, s in zip(*rec)]
    if cls is not None:
        tiles += [(to_image(x), f"label {int(l)}") for x, l in zip(*cls)]
    rows, y, pad = [], 0, 4
    for img, cap in tiles:
        rows.append((img, cap, y))
        y += img.shape[0] + 18
    det_list = [] if det is None else [to_image(d)[::2, ::2] for d in det]
    det_h = max((d.shape[0] for d in det_list), default=0)
    width = max([340] + [sum(d.shape[1] + pad for d in det_list)])
    canvas = Image.new("RGB", (width, y + det_h + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = _font("DejaVuSans.ttf", 12)
    for img, cap, y0 in rows:
        canvas.paste(Image.fromarray(img), (0, y0 + 16))
        draw.text((0, y0 + 1), cap, font=font, fill=(200, 0, 0))
    x0 = 0
    for d in det_list:
        canvas.paste(Image.fromarray(d), (x0, y))
        x0 += d.shape[1] + pad
    canvas.save(path)


def _check_models(n_rec: int, n_cls: int, n_det: int) -> None:
    import onnxruntime as ort

    def run(kind, x, bs=8):
        sess = ort.InferenceSession(model_path(kind), providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return np.concatenate([sess.run(None, {name: x[i:i + bs]})[0] for i in range(0, len(x), bs)])

    x, strings = text_lines(n_rec, seed=1)
    pred = ctc_decode(run("rec", x), rec_charset())
    ok = [p == s for p, s in zip(pred, strings)]
    print(f"rec: exact-string accuracy {sum(ok)}/{len(ok)} = {np.mean(ok):.3f} (seed 1)")
    for p, s, good in zip(pred, strings, ok):
        if not good:
            print(f"  want {s!r:40} got {p!r}")
    x, labels = cls_lines(n_cls, seed=1)
    acc = np.mean(run("cls", x).argmax(1) == labels)
    print(f"cls: accuracy {acc:.3f} on {n_cls} lines (seed 1)")
    x = det_crops(n_det, seed=1)
    prob = run("det", x, bs=2)
    print(f"det: output {prob.shape}, per-image fraction of pixels with p>0.3: "
          f"{np.round((prob > 0.3).mean(axis=(1, 2, 3)), 3).tolist()}")


def write_npz(folder: str) -> None:
    """The calibration and evaluation files that configs/ppocr.yaml reads (disjoint seeds)."""
    os.makedirs(folder, exist_ok=True)
    files = {"rec_calib": {"x": text_lines(64, seed=0)[0]}, "rec_eval": {"x": text_lines(32, seed=1)[0]},
             "det_calib": {"x": det_crops(8, seed=0)}, "det_eval": {"x": det_crops(2, seed=1)}}
    x, labels = cls_lines(64, seed=0)
    files["cls_calib"] = {"x": x}
    x, labels = cls_lines(64, seed=1)
    files["cls_eval"] = {"x": x, "label": labels.astype(np.int64)}
    for name, arrays in files.items():
        path = os.path.join(folder, f"{name}.npz")
        np.savez(path, **arrays)
        print(f"wrote {path}: " + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-npz", metavar="DIR", help="write the data files of configs/ppocr.yaml "
                                                       "to DIR and stop")
    ap.add_argument("--out", default="/tmp/bench_samples.png")
    ap.add_argument("--no-models", action="store_true", help="skip running the float models")
    ap.add_argument("--n-rec", type=int, default=64, help="lines for the rec accuracy check")
    args = ap.parse_args()
    if args.write_npz:
        write_npz(args.write_npz)
        return
    save_grid(args.out, rec=text_lines(12, seed=0), cls=cls_lines(6, seed=0), det=det_crops(4, seed=0))
    print(f"wrote {args.out}")
    if not args.no_models:
        _check_models(args.n_rec, n_cls=64, n_det=4)


if __name__ == "__main__":
    main()
