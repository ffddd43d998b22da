"""The API keys a server accepts: `--api-key` (or env PAGEKUBE_API_KEY), and `--api-key-file`, one key per line.

The file is re-read when it changes, checked at most once a second, so a rotated Kubernetes Secret mounted as a
volume takes effect without a restart (the kubelet swaps the mounted file in place within its sync period). Listing
the old and the new key together while clients move over, then only the new one, rotates without a failed request.
A file that turns unreadable or empty keeps the keys read before it (logged): a broken write never locks everyone
out.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time

log = logging.getLogger("pagekube.server")
RECHECK_SECONDS = 1.0


def read_keys(path: str) -> list[bytes]:
    """The keys in a key file: one per line, blank lines and '#' comments skipped. Raises ValueError when none."""
    with open(path, "rb") as f:
        keys = [line.strip() for line in f.read().splitlines()]
    keys = [k for k in keys if k and not k.startswith(b"#")]
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in the file")
    return keys


class APIKeys:
    def __init__(self, key: str | None, path: str | None, recheck_seconds: float = RECHECK_SECONDS):
        self.fixed = [key.encode()] if key else []
        self.path, self.recheck_seconds = path, recheck_seconds
        self._from_file: list[bytes] = read_keys(path) if path else []  # a missing or empty file stops the start
        self._seen = self._stamp() if path else None
        self._next_check = time.monotonic() + recheck_seconds
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.fixed or self.path)

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data symlink: a new Secret is a new inode
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _refresh(self) -> None:
        now = time.monotonic()
        if self.path is None or now < self._next_check:
            return
        with self._lock:
            self._next_check = now + self.recheck_seconds
            stamp = self._stamp()
            if stamp == self._seen:
                return
            self._seen = stamp
            try:
                keys = read_keys(self.path)
            except (OSError, ValueError) as e:
                log.error({"msg": "API key file unreadable: keeping the keys read before", "error": str(e)})
                return
            if keys != self._from_file:
                log.info({"msg": "API keys re-read", "path": self.path, "keys": len(keys)})
                self._from_file = keys

    def accepts(self, token: bytes) -> bool:
        """Whether `token` is one of the keys; every key is compared, in constant time."""
        self._refresh()
        ok = False
        for key in self.fixed + self._from_file:
            ok |= hmac.compare_digest(token, key)
        return ok
