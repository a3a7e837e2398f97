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
