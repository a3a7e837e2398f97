"""The same bytes from another CPU: calibrate and quantize --data on the demo model here and on an
AVX2-only AMD EPYC emulated by qemu-x86_64 (.ci/run installs it), compared byte for byte.

What decides a quantized model's bytes comes from float runs of the model; onnxruntime's blocked
NCHWc convolutions add in blocks of the vector width (16 channels with AVX-512, 8 with AVX2), so
qtool runs those sessions without them (qtool.model.FloatRunner's ``layouts``). On an AVX-512 host
this compares the two widths; on an AVX2 host the emulated CPU is alike and the test can only
pass, never fail because of the host. bench/cpus.py measures more rows and models."""

import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

LAUNCH = "import sys; sys.argv = ['qtool'] + sys.argv[1:]; from qtool.cli import main; main()"


def _qtool(args, emulated: bool, qemu: str):
    command = ([qemu, "-cpu", "EPYC-Rome"] if emulated else []) + [sys.executable, "-c", LAUNCH, *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


def test_calibrate_and_quantize_data_write_the_same_bytes_on_an_avx2_cpu(tmp_path, demo_model, demo_calib):
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs qemu-x86_64 on an x86-64 host to run the other CPU")
    data = tmp_path / "d.npz"
    arrays = np.load(demo_calib)
    np.savez(data, input=arrays["input"][:16])
    for side in ("native", "emulated"):
        emulated = side == "emulated"
        _qtool(["calibrate", demo_model, "-d", data, "-o", tmp_path / f"{side}.yaml", "-q"], emulated, qemu)
        # both from the native table: the judged steps' own float runs (method choice, channel
        # ranges, weight rounding's inputs, bias correction)
        _qtool(["quantize", demo_model, "-t", tmp_path / "native.yaml", "-o", tmp_path / f"{side}.onnx",
                "--data", data, "-q"], emulated, qemu)
    assert (tmp_path / "native.yaml").read_bytes() == (tmp_path / "emulated.yaml").read_bytes()
    assert (tmp_path / "native.onnx").read_bytes() == (tmp_path / "emulated.onnx").read_bytes()
