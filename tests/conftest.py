from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "qtool" / "demo"


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO / "digits_cnn.onnx"


@pytest.fixture(scope="session")
def demo_calib() -> Path:
    return DEMO / "digits_calib.npz"


@pytest.fixture(scope="session")
def demo_heldout() -> Path:
    return DEMO / "digits_heldout.npz"


@pytest.fixture(scope="session")
def demo_table(demo_model, demo_calib):
    from qtool.calibrate import calibrate

    return calibrate(demo_model, demo_calib, progress=False)


@pytest.fixture(scope="session")
def qmodel(tmp_path_factory, demo_model, demo_table) -> Path:
    """The demo model quantized with default options (QDQ), saved."""
    import onnx

    from qtool.quantize import quantize

    model, _ = quantize(demo_model, demo_table)
    path = tmp_path_factory.mktemp("qmodel") / "digits.q.onnx"
    onnx.save(model, str(path))
    return path
