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
disjoint; use seed 0 for calibration, 1, 2, ... for evaluation):

    text_lines(n, seed, width=320, style=DEFAULT_STYLE) -> (x [n,3,48,width], strings)   # PP-OCRv4 rec
    cls_lines(n, seed, style=DEFAULT_STYLE)   -> (x [n,3,48,192], labels int64)  # 0 upright, 1 rotated 180
    det_crops(n, seed, size=640, norm="rapidocr", style=DEFAULT_STYLE) -> x [n,3,size,size]  # PP-OCRv4 det

Two styles (`STYLES`):

- "plain": the original data, byte for byte: DejaVu fonts (the 14 faces of `FONTS`), dark text on a
  light uniform background, a little Gaussian noise; det pages the same way, or photo crops.
  Figures measured on it did not carry over to lines rendered otherwise.
- "varied" (the default): per sample, drawn from the seed's stream,
  * fonts: a family uniformly (DejaVu Sans / Serif / Mono, STIX, Computer Modern, Aileron), then
    one of its faces (30 faces here; `varied_fonts()` lists those installed, missing ones are
    skipped, see VARIED_FONTS);
  * text height: the font's ascender-to-descender extent ("Hdgjpqy") fills 50-92% of the line box,
    placed anywhere between top and bottom; font sizes 14-60 px (log-uniform) before the resize to
    48, so small text is upsampled and large text downsampled;
  * backgrounds: uniform light, tinted (30%), dark with light ink (15%), mid tones with dark or
    light ink (15%), horizontal or vertical two-colour gradients (20%, a quarter of them dark), and
    crops of the skimage photos without text, blurred and veiled towards a light (or dark, with
    light ink) colour (20%); ink colours vary too (at least ~70-90 luma levels of contrast);
  * geometry: lines from one token to a full `width`-pixel line (1-2 tokens for 30% of lines, else
    up to 10 for rec / 4 for cls, dropped from the end until the line fits unsqueezed), side
    margins 2-10% of the box height, sometimes a slight rotation (25%, at most 2 degrees, the
    line's ends kept inside the box) or a horizontal shear of up to 0.25 (20%, faux italic);
  * degradations in camera order: Gaussian blur (50%, sigma 0.3-1.0 px at the 48-pixel scale),
    Gaussian noise (60%, sigma 2-12 grey levels), JPEG re-encoding (50%, Pillow, quality 20-95);
  * det: 45% pages (fonts from the same list, sizes, inks, left/centred/right alignment and
    backgrounds as above, 30% of them turned by up to 4 degrees), 25% photo crops with up to six
    non-overlapping text labels (a line on its own box, like a sign, or text drawn straight onto
    the photo), 30% photo crops as plain; then blur, noise and JPEG (quality 30-95) as above.
  The float PP-OCRv4 rec model still reads ~97-98% of varied lines when spaces are ignored (about
  80-86% exactly: it drops or adds spaces on tightly set or degraded lines); see `python
  bench/datasets.py`.

Text is rendered with Pillow; photos come from `skimage.data` (only images shipped inside
scikit-image, no download). The first k samples of a set do not depend on n.

Helpers: `model_path("rec"|"det"|"cls")`, `rec_charset()` (the dictionary stored in the rec model's
metadata under key `character`, with rapidocr's blank at index 0 and space appended last),
`ctc_decode(logits, charset)` (greedy CTC), `varied_fonts()`.

Run `python bench/datasets.py` to write a sample grid to /tmp/bench_samples.png and check the float
models on the data (rec accuracy exact and ignoring spaces, cls accuracy, det output statistics);
`--no-models` skips the check, `--style plain` selects the original data.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import io
import math
import os
import string
import zlib

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

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
# backgrounds of varied lines and pages: the photos without text in them
_BACKDROPS = tuple(p for p in PHOTOS if p not in ("page", "text"))
DET_NORMS = {"rapidocr": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
             "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
# a string belongs to seed s only if crc32(string) % SEED_BUCKETS == s % SEED_BUCKETS, so seeds
# 0..SEED_BUCKETS-1 give pairwise disjoint strings (rendering differs for every seed anyway)
SEED_BUCKETS = 16
# stream tags so text_lines(seed=0) and cls_lines(seed=0) differ
_TAG_REC, _TAG_CLS, _TAG_DET = 101, 202, 303
STYLES = ("plain", "varied")
DEFAULT_STYLE = "varied"
# The varied style's fonts: (family, source, file), in this order. Sources: "dejavu" = FONT_DIR;
# "matplotlib" = mpl-data/fonts/ttf inside the installed matplotlib package (found, not imported);
# "pillow" = Pillow's built-in Aileron Regular (ImageFont.load_default(size), Pillow >= 10.1 with
# FreeType). A face that is not installed is skipped (the data then differ from a machine that has
# it: varied_fonts() lists the faces used). Left out on purpose: DejaVu Sans/Serif Display and the
# STIX NonUni/Size faces (no ASCII letters), LastResort (placeholder boxes), DejaVu Math and
# cmmi10/cmsy10/cmex10 (math symbols), cmti10 ("$" is a pound sign in its TeX encoding). The other
# Computer Modern faces draw some ASCII (quotes, < > \\ _ { | }) as other glyphs (TeX encoding),
# so they only get text of _CM_SAFE (everything _token writes is in it).
_DEJAVU_FAMILIES = {
    "DejaVu Sans": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
                    "DejaVuSans-BoldOblique.ttf", "DejaVuSans-ExtraLight.ttf", "DejaVuSansCondensed.ttf",
                    "DejaVuSansCondensed-Bold.ttf", "DejaVuSansCondensed-Oblique.ttf",
                    "DejaVuSansCondensed-BoldOblique.ttf"),
    "DejaVu Serif": ("DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
                     "DejaVuSerif-BoldItalic.ttf", "DejaVuSerifCondensed.ttf", "DejaVuSerifCondensed-Bold.ttf",
                     "DejaVuSerifCondensed-Italic.ttf", "DejaVuSerifCondensed-BoldItalic.ttf"),
    "DejaVu Mono": ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
                    "DejaVuSansMono-BoldOblique.ttf"),
}
VARIED_FONTS = tuple((fam, "dejavu", f) for fam, files in _DEJAVU_FAMILIES.items() for f in files) + (
    ("STIX", "matplotlib", "STIXGeneral.ttf"), ("STIX", "matplotlib", "STIXGeneralBol.ttf"),
    ("STIX", "matplotlib", "STIXGeneralItalic.ttf"), ("STIX", "matplotlib", "STIXGeneralBolIta.ttf"),
    ("Computer Modern", "matplotlib", "cmr10.ttf"), ("Computer Modern", "matplotlib", "cmb10.ttf"),
    ("Computer Modern", "matplotlib", "cmss10.ttf"), ("Computer Modern", "matplotlib", "cmtt10.ttf"),
    ("Aileron", "pillow", "Aileron-Regular"),
)
_CM_SAFE = set(string.ascii_letters + string.digits + " !#$%&()*+,-./:;=?@[]")

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

def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")


def text_lines(n: int, seed: int, width: int = 320, style: str = DEFAULT_STYLE) -> tuple[np.ndarray, list[str]]:
    """n rendered single text lines for PP-OCRv4 rec: (x [n,3,48,width] float32, strings).

    Strings are distinct within a set, disjoint between seeds 0..15 (see SEED_BUCKETS), and fit
    `width` at height 48 without squeezing. style: "plain" (the original data) or "varied".
    """
    _check_style(style)
    rng = np.random.default_rng([seed, _TAG_REC])
    x = np.zeros((n, 3, REC_HEIGHT, width), dtype=np.float32)
    seen: set = set()
    strings = []
    for i in range(n):
        if style == "plain":
            img, text = _fitting_line(rng, seed, width, max_tokens=4, seen=seen)
        else:
            img, text = _fitting_line_varied(rng, seed, width, max_tokens=10, seen=seen)
        x[i] = _line_to_tensor(img, width)
        strings.append(text)
    return x, strings


def cls_lines(n: int, seed: int, style: str = DEFAULT_STYLE) -> tuple[np.ndarray, np.ndarray]:
    """n text lines for the 0/180 degree classifier: (x [n,3,48,192] float32, labels [n] int64).

    Exactly one of each consecutive pair is rotated by 180 degrees (label 1), which one is random.
    style: "plain" (the original data) or "varied".
    """
    _check_style(style)
    rng = np.random.default_rng([seed, _TAG_CLS])
    x = np.zeros((n, 3, REC_HEIGHT, CLS_WIDTH), dtype=np.float32)
    labels = np.zeros(n, dtype=np.int64)
    seen: set = set()
    for i in range(n):
        if i % 2 == 0:
            flip_first = bool(rng.integers(2))
        labels[i] = int(flip_first == (i % 2 == 0))
        if style == "plain":
            img, _ = _fitting_line(rng, seed, CLS_WIDTH, max_tokens=2, seen=seen)
        else:
            img, _ = _fitting_line_varied(rng, seed, CLS_WIDTH, max_tokens=4, seen=seen)
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


# ---------------------------------------------------------------- varied style

def _font_file(source: str, name: str) -> str | None:
    if source == "dejavu":
        return os.path.join(FONT_DIR, name)
    if source == "matplotlib":
        spec = importlib.util.find_spec("matplotlib")
        if spec is None or not spec.submodule_search_locations:
            return None
        return os.path.join(spec.submodule_search_locations[0], "mpl-data", "fonts", "ttf", name)
    return None


@functools.lru_cache(maxsize=1024)
def _vfont(index: int, size: int) -> ImageFont.FreeTypeFont:
    _, source, name = VARIED_FONTS[index]
    if source == "pillow":
        font = ImageFont.load_default(size)
        if not isinstance(font, ImageFont.FreeTypeFont):
            raise OSError("Pillow's built-in font needs Pillow >= 10.1 with FreeType")
        return font
    path = _font_file(source, name)
    if path is None:
        raise OSError(f"{source} is not installed")
    return ImageFont.truetype(path, size)


@functools.lru_cache(maxsize=1)
def _varied_font_indices() -> tuple[int, ...]:
    found = []
    for i, (_, source, name) in enumerate(VARIED_FONTS):
        try:
            _vfont(i, 20)
        except (OSError, ValueError):
            continue
        found.append(i)
    if not found:
        raise FileNotFoundError(f"none of the varied style's fonts is installed ({FONT_DIR}, "
                                "matplotlib's mpl-data, Pillow's built-in font)")
    return tuple(found)


def varied_fonts() -> list[str]:
    """The faces the varied style draws from on this machine, as "family: source/file"."""
    return [f"{VARIED_FONTS[i][0]}: {VARIED_FONTS[i][1]}/{VARIED_FONTS[i][2]}" for i in _varied_font_indices()]


def _pick_font(rng) -> int:
    """A family uniformly among the installed ones, then one of its installed faces."""
    found = _varied_font_indices()
    families = list(dict.fromkeys(VARIED_FONTS[i][0] for i in found))
    family = families[rng.integers(len(families))]
    faces = [i for i in found if VARIED_FONTS[i][0] == family]
    return faces[rng.integers(len(faces))]


def _font_ok(index: int, text: str) -> bool:
    return VARIED_FONTS[index][0] != "Computer Modern" or set(text) <= _CM_SAFE


def _luma(c) -> float:
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]


def _colour(rng, lo: int, hi: int, tint: int) -> np.ndarray:
    """A colour of grey level lo..hi with each channel moved by up to `tint`."""
    grey = rng.uniform(lo, hi)
    return np.clip(grey + rng.uniform(-tint, tint, 3), 0, 255)


def _ink_for(rng, backgrounds, dark: bool, min_contrast: float = 90.0) -> np.ndarray:
    """A dark (or light) ink colour at least `min_contrast` luma away from every background colour."""
    for _ in range(50):
        ink = _colour(rng, 0, 90, 70) if dark else _colour(rng, 190, 255, 40)
        if all(abs(_luma(ink) - _luma(b)) >= min_contrast for b in backgrounds):
            return ink
    return np.zeros(3) if dark else np.full(3, 255.0)


def _photo_patch(rng, w: int, h: int) -> np.ndarray:
    """A (h, w, 3) float crop of a skimage photo (not one of text) with the aspect of w:h, resized
    to w x h."""
    photo = _photo(_BACKDROPS[rng.integers(len(_BACKDROPS))])
    ph, pw = photo.shape[:2]
    ch = rng.uniform(0.08, 1.0) * min(ph, pw * h / w)
    ch = max(4.0, ch)
    cw = min(pw, ch * w / h)
    x0, y0 = rng.uniform(0, pw - cw), rng.uniform(0, ph - ch)
    img = Image.fromarray(photo).resize((w, h), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    return np.asarray(img, dtype=np.float32)


def _background(rng, w: int, h: int, scale: float):
    """(background [h,w,3] float, ink colour): a uniform, gradient or photo background.

    `scale` is the size of one output pixel in background pixels (blur radii follow it).
    """
    kind = rng.choice(["light", "dark", "mid", "gradient", "photo"], p=[0.3, 0.15, 0.15, 0.2, 0.2])
    if kind == "light":
        bg = _colour(rng, 175, 255, 30)
        return np.broadcast_to(bg, (h, w, 3)).copy(), _ink_for(rng, [bg], dark=True)
    if kind == "dark":
        bg = _colour(rng, 0, 90, 60)
        return np.broadcast_to(bg, (h, w, 3)).copy(), _ink_for(rng, [bg], dark=False)
    if kind == "mid":
        bg = _colour(rng, 100, 170, 80)
        dark = bool(rng.random() < 0.6)
        ink = _ink_for(rng, [bg], dark, min_contrast=75.0)
        return np.broadcast_to(bg, (h, w, 3)).copy(), ink
    if kind == "gradient":
        dark_bg = bool(rng.random() < 0.25)
        c0, c1 = ((_colour(rng, 0, 100, 60) for _ in range(2)) if dark_bg
                  else (_colour(rng, 150, 255, 50) for _ in range(2)))
        across = bool(rng.random() < 0.5)                # horizontal, else vertical
        t = np.linspace(0.0, 1.0, w if across else h, dtype=np.float32)
        t = t[None, :, None] if across else t[:, None, None]
        bg = np.broadcast_to(c0 * (1 - t) + c1 * t, (h, w, 3)).astype(np.float32)
        return bg.copy(), _ink_for(rng, [c0, c1], dark=not dark_bg)
    # photo: blurred, then blended towards a light (or dark) colour so the text stays readable
    img = Image.fromarray(_photo_patch(rng, w, h).astype(np.uint8))
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.5) * scale))
    dark_bg = bool(rng.random() < 0.25)
    veil = _colour(rng, 0, 40, 20) if dark_bg else _colour(rng, 215, 255, 25)
    a = rng.uniform(0.55, 0.8)
    bg = a * veil + (1 - a) * np.asarray(img, dtype=np.float32)
    return bg, _ink_for(rng, _luma_range(bg), dark=not dark_bg, min_contrast=70.0)


def _luma_range(img: np.ndarray) -> list:
    """Grey colours at the 2nd and 98th percentile of an image's luma (for _ink_for)."""
    lo, hi = np.percentile(img.reshape(-1, 3) @ np.array([0.299, 0.587, 0.114]), [2, 98])
    return [np.full(3, lo), np.full(3, hi)]


def _degrade(rng, img: np.ndarray, scale: float, jpeg_min: int = 20) -> np.ndarray:
    """Blur, noise and JPEG (each with some chance) on a float [h,w,3] image -> uint8.

    `scale` = image pixels per pixel at the size the model sees (blur radii follow it).
    """
    out = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8))
    if rng.random() < 0.5:
        out = out.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0) * scale))
    arr = np.asarray(out, dtype=np.float32)
    if rng.random() < 0.6:
        arr = arr + rng.normal(0, rng.uniform(2, 12), arr.shape)
    arr = np.clip(arr + 0.5, 0, 255).astype(np.uint8)
    if rng.random() < 0.5:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=int(rng.integers(jpeg_min, 96)))
        arr = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    return np.ascontiguousarray(arr)


def _line_style(rng) -> dict:
    """What a varied line looks like, drawn before its text so the text can be cut to fit."""
    return {"font": _pick_font(rng),
            "size": int(round(math.exp(rng.uniform(math.log(14), math.log(60))))),
            "fill": rng.uniform(0.50, 0.92),     # ascender-to-descender extent / box height
            "top": rng.uniform(0.2, 0.8),        # share of the free height above the text
            "side": rng.uniform(0.02, 0.10, 2),  # left, right margins / box height
            "shear": rng.uniform(-0.25, 0.25) if rng.random() < 0.2 else 0.0,
            "turn": rng.uniform(-1, 1) if rng.random() < 0.25 else 0.0}


def _line_geometry(st: dict, text: str) -> dict:
    font = _vfont(st["font"], st["size"])
    _, rt, _, rb = font.getbbox("Hdgjpqy", anchor="ls")
    l, _, r, _ = font.getbbox(text, anchor="ls")
    ink_h = rb - rt
    box_h = max(8, int(round(ink_h / st["fill"])))
    top = (box_h - ink_h) * st["top"]
    base = top - rt                                   # baseline y in the box
    lm, rm = (int(round(f * box_h)) + 1 for f in st["side"])
    s = st["shear"]                                    # x' = x - s * (y - base): leans right for s > 0
    lm += int(math.ceil(max(0.0, s) * (box_h - base)))
    rm += int(math.ceil(max(0.0, s) * base))
    lm += int(math.ceil(max(0.0, -s) * base))
    rm += int(math.ceil(max(0.0, -s) * (box_h - base)))
    return {"font": font, "box_h": box_h, "box_w": r - l + lm + rm, "x": lm - l, "base": base,
            "free": min(top, box_h - ink_h - top)}


def _draw_line(rng, text: str, st: dict, geo: dict) -> np.ndarray:
    w, h = geo["box_w"], geo["box_h"]
    scale = h / REC_HEIGHT
    mask = Image.new("L", (w, h), 0)
    ImageDraw.Draw(mask).text((geo["x"], geo["base"]), text, font=geo["font"], fill=255, anchor="ls")
    if st["shear"]:
        s = st["shear"]
        mask = mask.transform((w, h), Image.AFFINE, (1, s, -s * geo["base"], 0, 1, 0), Image.BICUBIC)
    if st["turn"]:
        # at most 2 degrees, and the line's ends stay inside the vertical margins
        limit = math.degrees(math.atan(max(0.0, geo["free"]) / max(1.0, w / 2)))
        mask = mask.rotate(st["turn"] * min(2.0, limit), Image.BICUBIC, center=(w / 2, geo["base"]))
    bg, ink = _background(rng, w, h, scale)
    m = np.asarray(mask, dtype=np.float32)[:, :, None] / 255.0
    return _degrade(rng, bg * (1 - m) + ink * m, scale)


def _fitting_line_varied(rng, seed: int, width: int, max_tokens: int, seen: set) -> tuple[np.ndarray, str]:
    """Like _fitting_line for the varied style: 1-2 tokens (30%) or 1-max_tokens, then tokens are
    dropped from the end of the line until it fits `width` unsqueezed, so lengths run from one
    token to the full width."""
    while True:
        st = _line_style(rng)
        count = rng.integers(1, 3) if rng.random() < 0.3 else rng.integers(1, max_tokens + 1)
        tokens = [_token(rng) for _ in range(int(count))]
        while True:
            text = " ".join(tokens)
            geo = _line_geometry(st, text)
            fits = math.ceil(REC_HEIGHT * geo["box_w"] / geo["box_h"]) <= width
            if fits or len(tokens) == 1:
                break
            tokens.pop()
        assert set(text) <= _REC_ALPHABET, text
        if (not fits or text in seen or not _font_ok(st["font"], text)
                or zlib.crc32(text.encode()) % SEED_BUCKETS != seed % SEED_BUCKETS):
            continue
        seen.add(text)
        return _draw_line(rng, text, st, geo), text


def _text_page_varied(rng, size: int) -> np.ndarray:
    """A page of paragraphs on a varied background: per block its own font, size, ink and alignment;
    sometimes turned by a few degrees. Float [size,size,3] before degradation."""
    turn = rng.uniform(-4, 4) if rng.random() < 0.3 else 0.0
    big = int(size * 1.12) if turn else size              # room to turn without blank corners
    bg, ink0 = _background(rng, big, big, 1.0)
    dark_ink = _luma(ink0) < 128
    bg_range = _luma_range(bg[::8, ::8])
    mask_layers = []
    y = int(rng.integers(4, size // 8))
    while y < big:
        face = _pick_font(rng)
        font = _vfont(face, int(rng.integers(max(11, size // 50), size // 11)))
        ink = ink0 if rng.random() < 0.6 else _ink_for(rng, bg_range, dark_ink, 70.0)
        left = int(rng.integers(4, big // 6))
        right = big - int(rng.integers(4, big // 5))
        align = rng.choice(["left", "left", "center", "right"])
        ascent, descent = font.getmetrics()
        step = int((ascent + descent) * rng.uniform(1.1, 1.8))
        mask = Image.new("L", (big, big), 0)
        draw = ImageDraw.Draw(mask)
        for _ in range(int(rng.integers(1, 7))):
            line = ""
            limit = (right - left) * (rng.uniform(0.3, 1.0) if align != "left" else 1.0)
            while True:
                cand = (line + " " + _token(rng)).strip()
                if font.getlength(cand) > limit or not _font_ok(face, cand):
                    break
                line = cand
            if line:
                length = font.getlength(line)
                x = {"left": left, "right": right - length}.get(align, (left + right - length) / 2)
                draw.text((x, y), line, font=font, fill=255)
            y += step
            if y >= big:
                break
        mask_layers.append((mask, ink))
        y += int(step * rng.uniform(0.5, 2.0))
    img = bg
    for mask, ink in mask_layers:
        m = np.asarray(mask, dtype=np.float32)[:, :, None] / 255.0
        img = img * (1 - m) + ink * m
    if turn:
        pil = Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8)).rotate(turn, Image.BICUBIC)
        off = (big - size) // 2
        img = np.asarray(pil.crop((off, off, off + size, off + size)), dtype=np.float32)
    return img


def _labelled_photo(rng, size: int) -> np.ndarray:
    """A photo crop with up to 6 text labels that do not overlap: a varied line on its own box (a
    sign), or text drawn straight onto the photo in a colour that contrasts with the spot's mean.
    Float [size,size,3]."""
    img = _photo_crop(rng, size).astype(np.float32)
    taken = np.zeros((size, size), dtype=bool)            # labels do not overlap
    for _ in range(int(rng.integers(1, 7))):
        st = _line_style(rng)
        st["size"] = int(rng.integers(max(11, size // 50), size // 10))
        st["turn"] = 0.0
        tokens = [_token(rng) for _ in range(int(rng.integers(1, 4)))]
        text = " ".join(tokens)
        if not _font_ok(st["font"], text):
            continue
        geo = _line_geometry(st, text)
        w, h = geo["box_w"], geo["box_h"]
        if w >= size or h >= size:
            continue
        x0, y0 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
        if taken[y0:y0 + h, x0:x0 + w].any():
            continue
        taken[y0:y0 + h, x0:x0 + w] = True
        mask = Image.new("L", (w, h), 0)
        ImageDraw.Draw(mask).text((geo["x"], geo["base"]), text, font=geo["font"], fill=255, anchor="ls")
        m = np.asarray(mask, dtype=np.float32)[:, :, None] / 255.0
        spot = img[y0:y0 + h, x0:x0 + w]
        if rng.random() < 0.5:                             # a sign: its own background
            bg, ink = _background(rng, w, h, 1.0)
        else:                                              # painted on the photo
            bg = spot
            ink = _ink_for(rng, [spot.reshape(-1, 3).mean(0)], _luma(spot.reshape(-1, 3).mean(0)) >= 128, 100.0)
        img[y0:y0 + h, x0:x0 + w] = bg * (1 - m) + ink * m
    return img


def _det_varied(rng, size: int) -> np.ndarray:
    u = rng.random()
    if u < 0.45:
        img = _text_page_varied(rng, size)
    elif u < 0.7:
        img = _labelled_photo(rng, size)
    else:
        img = _photo_crop(rng, size).astype(np.float32)
    return _degrade(rng, img, 1.0, jpeg_min=30)


def det_crops(n: int, seed: int, size: int = 640, norm: str = "rapidocr",
              style: str = DEFAULT_STYLE) -> np.ndarray:
    """n images for PP-OCRv4 det: x [n,3,size,size] float32 (size a multiple of 32).

    plain: each sample is, with equal chance, a random crop of a scikit-image sample photo
    (rescaled so its short side covers the crop) or a rendered page of text paragraphs.
    varied: 45% pages (varied fonts, sizes, inks, alignment, backgrounds, sometimes turned), 25%
    photo crops with text labels, 30% photo crops; then blur, noise and JPEG (each by chance).
    """
    _check_style(style)
    if size % 32:
        raise ValueError(f"det input size {size} must be a multiple of 32")
    if norm not in DET_NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {sorted(DET_NORMS)}")
    mean, std = (np.array(v, dtype=np.float32)[:, None, None] for v in DET_NORMS[norm])
    rng = np.random.default_rng([seed, _TAG_DET])
    x = np.zeros((n, 3, size, size), dtype=np.float32)
    for i in range(n):
        if style == "plain":
            img = _text_page(rng, size) if rng.random() < 0.5 else _photo_crop(rng, size)
        else:
            img = _det_varied(rng, size)
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


def _check_models(n_rec: int, n_cls: int, n_det: int, seeds=(1,), style: str = DEFAULT_STYLE,
                  show: int = 40) -> None:
    """Float rec (exact and ignoring spaces), cls and det statistics on each seed's data."""
    import onnxruntime as ort

    sessions = {}

    def run(kind, x, bs=8):
        if kind not in sessions:
            sessions[kind] = ort.InferenceSession(model_path(kind), providers=["CPUExecutionProvider"])
        sess = sessions[kind]
        name = sess.get_inputs()[0].name
        return np.concatenate([sess.run(None, {name: x[i:i + bs]})[0] for i in range(0, len(x), bs)])

    for seed in seeds:
        x, strings = text_lines(n_rec, seed=seed, style=style)
        pred = ctc_decode(run("rec", x), rec_charset())
        ok = [p == s for p, s in zip(pred, strings)]
        ok_ns = [p.replace(" ", "") == s.replace(" ", "") for p, s in zip(pred, strings)]
        print(f"rec: {style}, seed {seed}: exact-string accuracy {sum(ok)}/{len(ok)} = {np.mean(ok):.3f}, "
              f"ignoring spaces {sum(ok_ns)}/{len(ok)} = {np.mean(ok_ns):.3f}")
        wrong = [(s, p) for p, s, good in zip(pred, strings, ok_ns) if not good]
        for s, p in wrong[:show]:
            print(f"  want {s!r:40} got {p!r}")
        x, labels = cls_lines(n_cls, seed=seed, style=style)
        acc = np.mean(run("cls", x, bs=16).argmax(1) == labels)
        print(f"cls: {style}, seed {seed}: accuracy {acc:.3f} on {n_cls} lines")
        if n_det:
            x = det_crops(n_det, seed=seed, style=style)
            prob = run("det", x, bs=1)
            frac = (prob > 0.3).mean(axis=(1, 2, 3))
            print(f"det: {style}, seed {seed}: output {prob.shape}, per-image fraction of pixels with "
                  f"p>0.3: {np.round(frac, 3).tolist()} (mean {frac.mean():.3f}); mean p {prob.mean():.4f}, "
                  f"fraction p>0.9 {(prob > 0.9).mean():.4f}")


def write_npz(folder: str, style: str = DEFAULT_STYLE) -> None:
    """The calibration and evaluation files that configs/ppocr.yaml reads (disjoint seeds)."""
    os.makedirs(folder, exist_ok=True)
    files = {"rec_calib": {"x": text_lines(64, seed=0, style=style)[0]},
             "rec_eval": {"x": text_lines(32, seed=1, style=style)[0]},
             "det_calib": {"x": det_crops(8, seed=0, style=style)},
             "det_eval": {"x": det_crops(2, seed=1, style=style)}}
    x, labels = cls_lines(64, seed=0, style=style)
    files["cls_calib"] = {"x": x}
    x, labels = cls_lines(64, seed=1, style=style)
    files["cls_eval"] = {"x": x, "label": labels.astype(np.int64)}
    for name, arrays in files.items():
        path = os.path.join(folder, f"{name}.npz")
        np.savez(path, **arrays)
        print(f"wrote {path}: " + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-npz", metavar="DIR", help="write the data files of configs/ppocr.yaml "
                                                       "to DIR and stop")
    ap.add_argument("--style", choices=STYLES, default=DEFAULT_STYLE)
    ap.add_argument("--out", default="/tmp/bench_samples.png")
    ap.add_argument("--no-models", action="store_true", help="skip running the float models")
    ap.add_argument("--n-rec", type=int, default=64, help="lines for the rec accuracy check")
    ap.add_argument("--n-cls", type=int, default=64, help="lines for the cls accuracy check")
    ap.add_argument("--n-det", type=int, default=4, help="crops for the det statistics")
    ap.add_argument("--seeds", default="1", help="comma-separated seeds of the model check")
    args = ap.parse_args()
    if args.write_npz:
        write_npz(args.write_npz, args.style)
        return
    if args.style == "varied":
        print("varied-style fonts on this machine:\n  " + "\n  ".join(varied_fonts()))
    save_grid(args.out, rec=text_lines(12, seed=0, style=args.style), cls=cls_lines(6, seed=0, style=args.style),
              det=det_crops(4, seed=0, style=args.style))
    print(f"wrote {args.out}")
    if not args.no_models:
        _check_models(args.n_rec, args.n_cls, args.n_det, [int(v) for v in args.seeds.split(",")], args.style)


if __name__ == "__main__":
    main()
