"""Prepared models kept on disk between commands (qtool/diskcache.py): a second command reads the
preparation the first one kept, the same model; another model, other code or a broken entry is
prepared again; a cache that cannot be written or is turned off changes nothing but the time."""

import os

import onnx
import pytest

from qtool import diskcache, model as model_module
from qtool.calibrate import calibrate
from qtool.model import prepare


@pytest.fixture
def cache(tmp_path, monkeypatch):
    where = tmp_path / "cache"
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(where))
    monkeypatch.delenv("QTOOL_NO_CACHE", raising=False)
    monkeypatch.setattr(model_module, "_last_prepared", None)  # no preparation kept in this process
    monkeypatch.setattr(model_module, "_last_file", None)
    return where


def _entries(where):
    return sorted(where.glob("*" + diskcache.SUFFIX)) if where.exists() else []


def _counting(monkeypatch):
    calls = []
    real = model_module._prepare

    def counted(m, source):
        calls.append(source)
        return real(m, source)
    monkeypatch.setattr(model_module, "_prepare", counted)
    return calls


def test_a_second_command_reads_the_kept_preparation(cache, monkeypatch, demo_model):
    calls = _counting(monkeypatch)
    first = prepare(onnx.load(demo_model))
    assert len(calls) == 1 and len(_entries(cache)) == 1
    monkeypatch.setattr(model_module, "_last_prepared", None)  # as a new process
    again = prepare(onnx.load(demo_model))
    assert len(calls) == 1  # not prepared again
    assert again.SerializeToString() == first.SerializeToString()


def test_another_model_or_other_code_is_another_entry(cache, monkeypatch, demo_model):
    calls = _counting(monkeypatch)
    m = onnx.load(demo_model)
    prepare(m)
    m.doc_string = "changed"
    monkeypatch.setattr(model_module, "_last_prepared", None)
    prepare(m)
    assert len(calls) == 2 and len(_entries(cache)) == 2
    monkeypatch.setattr(diskcache, "_code_digest", b"other code")
    monkeypatch.setattr(model_module, "_last_prepared", None)
    prepare(m)
    assert len(calls) == 3 and len(_entries(cache)) == 3


def test_an_entry_that_does_not_parse_is_prepared_again_and_replaced(cache, monkeypatch, demo_model):
    first = prepare(onnx.load(demo_model))
    [entry] = _entries(cache)
    entry.write_bytes(b"\xff not a model")
    monkeypatch.setattr(model_module, "_last_prepared", None)
    calls = _counting(monkeypatch)
    again = prepare(onnx.load(demo_model))
    assert len(calls) == 1 and again.SerializeToString() == first.SerializeToString()
    assert entry.read_bytes() == first.SerializeToString()


def test_a_cache_that_cannot_be_written_or_is_off_changes_nothing(tmp_path, monkeypatch, demo_model,
                                                                 demo_calib):
    monkeypatch.setattr(model_module, "_last_prepared", None)
    monkeypatch.setattr(model_module, "_last_file", None)
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(blocked / "cache"))
    with_blocked = calibrate(demo_model, demo_calib, progress=False)
    assert blocked.read_text() == "not a folder"
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "off"))
    monkeypatch.setenv("QTOOL_NO_CACHE", "1")
    monkeypatch.setattr(model_module, "_last_prepared", None)
    off = calibrate(demo_model, demo_calib, progress=False)
    assert not (tmp_path / "off").exists()
    assert off.to_dict() == with_blocked.to_dict()


def test_the_folder_keeps_its_limit_least_recently_read_first(cache, monkeypatch):
    monkeypatch.setattr(diskcache, "LIMIT_BYTES", 300)
    for i, name in enumerate(("a", "b", "c")):
        diskcache.write(name, bytes(100))
        os.utime(cache / (name + diskcache.SUFFIX), ns=(i * 10**9, i * 10**9))
    assert diskcache.read("a") == bytes(100)  # read now: the most recent
    diskcache.write("d", bytes(100))
    assert [p.name.split(".")[0] for p in _entries(cache)] == ["a", "c", "d"]
    assert diskcache.read("b") is None
    assert not list(cache.glob(diskcache.TEMPORARY)) and not list(cache.glob(".*"))


def test_an_entry_in_a_folder_it_cannot_write_is_still_read(cache, monkeypatch):
    diskcache.write("a", b"prepared")

    def refused(*args, **kwargs):
        raise PermissionError("read-only folder")
    monkeypatch.setattr(os, "utime", refused)
    assert diskcache.read("a") == b"prepared"


def test_what_a_killed_writer_left_is_removed_once_an_hour_old(cache):
    cache.mkdir()
    old, fresh = cache / ".a.prepared.onnx.x1.tmp", cache / ".b.prepared.onnx.x2.tmp"
    for path in (old, fresh):
        path.write_bytes(b"half an entry")
    os.utime(old, (0, 0))
    diskcache.write("c", b"prepared")
    assert not old.exists() and fresh.exists() and diskcache.read("c") == b"prepared"
