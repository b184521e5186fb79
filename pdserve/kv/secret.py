"""The deployment secret KV agents prove to each other: where it comes from and what a usable one looks like.

One secret per deployment (every prefill and decode instance of it holds the same bytes). It never travels: agents
prove they hold it with HMACs over fresh nonces (pdserve.kv.auth). Sources, first found wins: an explicit value
(`--kv-secret`), a file (`--kv-secret-file`), then the environment (`PDSERVE_KV_SECRET`, `PDSERVE_KV_SECRET_FILE`).
A file is the better channel: command lines are visible to every local user in /proc, environments to the same
user and root.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

from pdserve import envs

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16  # below this an offline guess of the secret from one captured handshake becomes plausible


def check_secret(secret: bytes, source: str = "secret") -> bytes:
    """`secret` if it is long enough to be a key; ValueError naming its source otherwise."""
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"KV {source} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"KV {source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                         "(generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return bytes(secret)


def read_secret_file(path: str) -> bytes:
    """The secret stored in `path` (surrounding whitespace, e.g. a trailing newline, is not part of it)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"cannot read the KV secret file {path}: {e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("KV secret file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    return check_secret(data.strip(), f"secret file {path}")


def load_secret(value: str | bytes | None = None, file: str | None = None) -> bytes | None:
    """The deployment secret from a flag value, a flag file, `PDSERVE_KV_SECRET`, or `PDSERVE_KV_SECRET_FILE`
    (in this order); None when none is set. A text value is used as its UTF-8 bytes."""
    if value:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return check_secret(raw, "secret")
    if file:
        return read_secret_file(file)
    env = envs.kv_secret()
    if env:
        return check_secret(env.encode(), "secret from PDSERVE_KV_SECRET")
    env_file = envs.kv_secret_file()
    if env_file:
        return read_secret_file(env_file)
    return None


def generate_secret() -> str:
    """A fresh secret as text (what `pdserve serve` hands to the instances it starts for a local deployment)."""
    return secrets.token_urlsafe(32)
