"""The deployment secret: one per deployment, the same bytes in every process of it (router, prefill and decode
instances, their KV agents).

It signs internal HTTP (the router's `pd` orders and aborts, decode-to-prefill orders; pdserve.server.auth) and KV
agents prove they hold it with HMACs over fresh nonces (pdserve.kv.auth). It never travels. Sources, first found
wins: an explicit value (programmatic use and tests), a file (`--deployment-secret-file`), then the environment
(`PDSERVE_DEPLOYMENT_SECRET`, `PDSERVE_DEPLOYMENT_SECRET_FILE`). A file is the better channel: command lines are
visible to every local user in /proc, environments to the same user and root. There is deliberately no flag that
takes the value itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

from pdserve import envs

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16  # below this an offline guess of the secret from one captured handshake becomes plausible
HELP = ("--deployment-secret-file FILE (or PDSERVE_DEPLOYMENT_SECRET_FILE, PDSERVE_DEPLOYMENT_SECRET); "
        "`pdserve serve --prefill X --decode Y` makes one for the instances it starts")


def check_secret(secret: bytes, source: str = "secret") -> bytes:
    """`secret` if it is long enough to be a key; ValueError naming its source otherwise."""
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"the deployment {source} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the deployment {source} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                         "(generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return bytes(secret)


def as_secret(value: str | bytes | None) -> bytes | None:
    """A configured secret (text is used as its UTF-8 bytes) checked for length; None or empty: no secret."""
    if value is None or value == "" or value == b"":
        return None
    return check_secret(value.encode() if isinstance(value, str) else bytes(value))


def read_secret_file(path: str) -> bytes:
    """The secret stored in `path` (surrounding whitespace, e.g. a trailing newline, is not part of it)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"cannot read the deployment secret file {path}: {e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("deployment secret file %s is readable by other users (mode %o); chmod 600 it", path,
                    mode & 0o777)
    return check_secret(data.strip(), f"secret file {path}")


def load_secret(value: str | bytes | None = None, file: str | None = None) -> bytes | None:
    """The deployment secret from a value, a file, `PDSERVE_DEPLOYMENT_SECRET`, or `PDSERVE_DEPLOYMENT_SECRET_FILE`
    (in this order); None when none is set."""
    if value:
        return as_secret(value)
    if file:
        return read_secret_file(file)
    env = envs.deployment_secret()
    if env:
        return check_secret(env.encode(), "secret from PDSERVE_DEPLOYMENT_SECRET")
    env_file = envs.deployment_secret_file()
    if env_file:
        return read_secret_file(env_file)
    return None


def generate_secret() -> str:
    """A fresh secret as text (what `pdserve serve` hands to the instances it starts for a local deployment)."""
    return secrets.token_urlsafe(32)
