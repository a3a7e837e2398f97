from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "qtool" / "demo"


@pytest.fixture(scope="session", autouse=True)
def _cache_folder(tmp_path_factory):
    """The suite's prepared models (qtool/diskcache.py) go to a folder of its own, not the user's."""
    import os

    os.environ["QTOOL_CACHE_DIR"] = str(tmp_path_factory.mktemp("qtool-cache"))
    os.environ.pop("QTOOL_NO_CACHE", None)


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


def packaged_file(package: str, relative: str, wheel: str) -> Path:
    """A model file shipped inside an installed wheel (``make test`` installs ``wheel`` without its
    dependencies), found without importing the package; skipped where it is missing, a failure in
    CI."""
    import importlib.util
    import os

    spec = importlib.util.find_spec(package)
    path = Path(spec.submodule_search_locations[0]) / relative if spec else None
    if path is None or not path.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{wheel} is not installed; `make test` installs it")
        pytest.skip(f"{wheel} is not installed")
    return path
