"""Who may call: API keys from a key file, checked on every route of the router's ports (health and metrics stay
open). No key file: every caller is let in, as before, and the startup log says so.

The key file, one key a line (``#`` starts a comment; blank lines are skipped)::

    # key                               tenant   role    limits and weight (each optional)
    sk-acme-3f9c2d7e41b84c5a9e0f        acme     user    rps=5 burst=10 concurrent=4 weight=2
    sk-ops-a81e4b09c6d3f2e7b5a1         ops      admin

- ``key``: at least 16 printable characters without spaces; unique in the file.
- ``tenant``: a name (letters, digits, ``._-``; at most 64), the label of the tenant's metrics; several keys may
  name one tenant (each key has its own limits).
- ``role``: ``user`` (edits, reads) or ``admin`` (also what changes the served set: adapter load/unload, model
  load/unload).
- ``rps`` (requests per second, a token bucket) with ``burst`` (its depth; default ``max(1, rps)``),
  ``concurrent`` (requests in flight at once), ``weight`` (its fair share under overload; default 1).

A bad file stops the router at start with an error naming the file and the line (never the key); a file changed
while the router runs is read again within ``poll_s`` (1 s) and replaces the keys, or, if it is bad, the old keys
stay and the error is logged. Keys are looked up by their SHA-256 (a dict lookup on a digest leaks nothing of the
key) and the match confirmed with ``hmac.compare_digest``; they are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("maskedit.router.auth")
ROLES = ("user", "admin")
TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
KEY = re.compile(r"^[\x21-\x7e]{16,512}$")
OPTIONS = {"rps": float, "burst": float, "concurrent": int, "weight": float}


class KeyFileError(ValueError):
    """The key file cannot be used: the message names the file and the line."""


@dataclass(frozen=True)
class Tenant:
    """What a key grants: its tenant's name, its role, its limits (0: none) and its fair-share weight."""

    name: str
    role: str = "user"
    rps: float = 0.0
    burst: float = 0.0
    concurrent: int = 0
    weight: float = 1.0
    key_id: str = ""  # the first 12 hex digits of the key's SHA-256: names the key's own limits, never the key
    digest: bytes = field(default=b"", repr=False, compare=False)  # the key's SHA-256

    @property
    def admin(self) -> bool:
        return self.role == "admin"


# the tenant of every request when no key file is configured (open mode): no limits, weight 1
ANONYMOUS = Tenant("anonymous", "admin", key_id="anonymous")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse(text: str, source: str = "<keys>") -> dict[bytes, Tenant]:
    """The keys of a key file's ``text`` by their SHA-256; raises ``KeyFileError`` naming ``source`` and the line."""
    keys: dict[bytes, tuple[int, Tenant]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue

        def bad(why: str):
            return KeyFileError(f"{source} line {n}: {why}")

        fields = line.split()
        if len(fields) < 3:
            raise bad(f"expected '<key> <tenant> <role> [rps=N] [burst=N] [concurrent=N] [weight=W]', got "
                      f"{len(fields)} field(s)")
        key, tenant, role, opts = fields[0], fields[1], fields[2], fields[3:]
        if not KEY.match(key):
            raise bad("the key must be 16 to 512 printable characters without spaces")
        if not TENANT.match(tenant):
            raise bad(f"tenant {tenant!r}: letters, digits, '.', '_', '-' only, at most 64")
        if role not in ROLES:
            raise bad(f"role {role!r}: must be one of {', '.join(ROLES)}")
        values: dict = {}
        for opt in opts:
            name, eq, value = opt.partition("=")
            if not eq or name not in OPTIONS:
                raise bad(f"{opt!r}: expected one of {', '.join(k + '=...' for k in OPTIONS)}")
            if name in values:
                raise bad(f"{name} given twice")
            try:
                values[name] = OPTIONS[name](value)
            except ValueError:
                raise bad(f"{name}={value!r}: not a {OPTIONS[name].__name__}") from None
            if values[name] < 0 or (name == "weight" and values[name] <= 0):
                raise bad(f"{name}={value}: must be {'> 0' if name == 'weight' else '>= 0'}")
        if "burst" in values and not values.get("rps"):
            raise bad("burst without rps")
        if values.get("rps") and "burst" not in values:
            values["burst"] = max(1.0, values["rps"])
        if values.get("rps") and values["burst"] < 1:
            raise bad(f"burst={values['burst']:g}: must be >= 1 (a request takes one token)")
        d = _digest(key)
        if d in keys:
            raise bad(f"the same key as line {keys[d][0]}")
        keys[d] = (n, Tenant(tenant, role, key_id=d.hex()[:12], digest=d, **values))
    return {d: t for d, (_, t) in keys.items()}


def load(path: Path) -> dict[bytes, Tenant]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{path}: cannot read the key file: {e}") from None
    keys = parse(text, str(path))
    if not keys:
        raise KeyFileError(f"{path}: no keys in the key file (remove the setting to serve without keys)")
    return keys


class Unauthenticated(Exception):
    """No key, or a key not in the file: 401 / UNAUTHENTICATED."""


class Forbidden(Exception):
    """A key whose role may not use this route: 403 / PERMISSION_DENIED."""


def bearer(value: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value (the scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Keyring:
    """The keys in force. ``path`` None: open (every caller is ``ANONYMOUS``). ``check`` is the one question every
    port asks; ``start`` watches the file and reloads it on change."""

    def __init__(self, path: Path | str | None = None, poll_s: float = 1.0, metrics=None):
        self.path = Path(path) if path else None
        self.poll_s, self.metrics = poll_s, metrics
        self._keys: dict[bytes, Tenant] = load(self.path) if self.path else {}
        self._stamp = self._stat()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_reload: list = []  # called with the new keys after each successful reload

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        if not self.enabled:
            return "no API key file: every caller is let in without a key (open mode)"
        tenants = {t.name for t in self._keys.values()}
        return f"API keys from {self.path}: {len(self._keys)} key(s) of {len(tenants)} tenant(s)"

    def tenants(self) -> list[Tenant]:
        return list(self._keys.values())

    def check(self, authorization: str | None, admin: bool = False) -> Tenant:
        """The tenant of a request whose ``Authorization`` value (header or gRPC metadata) is ``authorization``;
        ``admin``: the route needs the admin role. Raises ``Unauthenticated`` / ``Forbidden``."""
        if not self.enabled:
            return ANONYMOUS
        key = bearer(authorization)
        if key is None:
            raise Unauthenticated("no API key: send 'Authorization: Bearer <key>' (gRPC: 'authorization' metadata)")
        d = _digest(key)
        found = self._keys.get(d)
        if found is None or not hmac.compare_digest(found.digest, d):
            raise Unauthenticated("invalid API key")
        if admin and not found.admin:
            raise Forbidden(f"tenant {found.name}: this route needs an admin key")
        return found

    # -- reloading ----------------------------------------------------------------------------------
    def _stat(self):
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)  # follows symlinks: a Kubernetes Secret volume swaps a ..data link
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def reload_if_changed(self) -> bool:
        """Read the file again if it changed since last read; returns whether the keys were replaced."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            keys = load(self.path)
        except KeyFileError as e:
            log.error("API key file not reloaded, the previous keys stay in force: %s", e)
            if self.metrics is not None:
                self.metrics.keyfile_reload("error")
            return False
        self._keys = keys
        tenants = {t.name for t in keys.values()}
        log.info("API key file reloaded: %d key(s) of %d tenant(s)", len(keys), len(tenants))
        if self.metrics is not None:
            self.metrics.keyfile_reload("ok")
        for fn in self.on_reload:
            fn(keys)
        return True

    def start(self) -> "Keyring":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="router-keys")
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.reload_if_changed()
            except Exception:  # never let the watcher die
                log.exception("API key file watcher")

    def stop(self) -> None:
        self._stop.set()


def admin_path(path: str) -> bool:
    """Routes that change the served set (Triton's model repository load/unload): admin keys only."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    return len(parts) == 5 and parts[:3] == ["v2", "repository", "models"] and parts[4] in ("load", "unload")
