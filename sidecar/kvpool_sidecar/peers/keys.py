"""The cluster key peers prove to each other (``--transfer-key-file``, a mounted Secret)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIN_SECRET_BYTES = 32


@dataclass(frozen=True)
class TransferKeys:
    """Cluster keys: the first is the one a peer proves, any is accepted from a peer (rotation)."""

    keys: tuple[tuple[str, bytes], ...]

    @property
    def signing(self) -> tuple[str, bytes]:
        return self.keys[0]

    def secret(self, key_id: str) -> bytes | None:
        return next((secret for kid, secret in self.keys if kid == key_id), None)

    @classmethod
    def parse(cls, text: str, where: str = "transfer key file") -> TransferKeys:
        """Lines ``KEY_ID SECRET`` (the key proved first; blank lines and ``#`` comments skipped)."""
        keys: list[tuple[str, bytes]] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not 1 <= len(parts[0]) <= 64 or not parts[0].isascii():
                raise ValueError(f"{where} line {n}: expected 'KEY_ID SECRET' with an ASCII id of 1-64 characters")
            if len(parts[1].encode()) < MIN_SECRET_BYTES:
                raise ValueError(f"{where} line {n}: the secret must be at least {MIN_SECRET_BYTES} bytes")
            if any(kid == parts[0] for kid, _ in keys):
                raise ValueError(f"{where} line {n}: key id {parts[0]!r} appears twice")
            keys.append((parts[0], parts[1].encode()))
        if not keys:
            raise ValueError(f"{where}: no key")
        return cls(tuple(keys))

    @classmethod
    def load(cls, path: str | Path) -> TransferKeys:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"transfer key file {path}: {exc.strerror}") from None
        return cls.parse(text, f"transfer key file {path}")
