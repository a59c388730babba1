"""Who a caller is: bearer tokens from a mounted Secret, each mapped to a role. Never the request body.

Token file: lines ``ROLE TOKEN`` with ROLE one of ``admin`` (everything), ``engine`` (acts for any
tenant, as an engine knows its users; no config changes) or ``tenant:NAME`` (acts only for NAME: a body
naming another tenant is refused, one naming none is taken as NAME; sees only its own sequences and
pins). A file holding one bare token is that token as ``admin`` (the single-token form of earlier
versions). Blank lines and ``#`` comments are skipped.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

MIN_TOKEN = 16
_TENANT = re.compile(r"^tenant:([^\s:]{1,256})$")


@dataclass(frozen=True)
class Principal:
    role: str  # admin | engine | tenant
    tenant: str | None = None  # for the tenant role
    session: str | None = None  # an engine channel connection: what it admits is its own alone

    @property
    def key(self) -> str:
        """What owns the sequences and pins this principal creates."""
        if self.session is not None:
            return f"session:{self.session}"
        return f"tenant:{self.tenant}" if self.role == "tenant" else self.role

    def __str__(self) -> str:
        return self.key


ADMIN = Principal("admin")  # no token file: loopback only, where the only caller is the pod's engine


class Credentials:
    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = entries

    def who(self, token: str) -> Principal | None:
        given = token.encode()
        found = None
        for secret, principal in self._entries:  # every entry compared, in constant time each
            if hmac.compare_digest(given, secret):
                found = principal
        return found

    @classmethod
    def parse(cls, text: str, where: str = "token file") -> Credentials:
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
        lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
        if len(lines) == 1 and len(lines[0][1].split()) == 1:
            lines = [(lines[0][0], f"admin {lines[0][1]}")]
        entries: list[tuple[bytes, Principal]] = []
        for n, line in lines:
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{where} line {n}: expected 'ROLE TOKEN' (admin, engine or tenant:NAME)")
            role, token = parts
            if len(token) < MIN_TOKEN:
                raise ValueError(f"{where} line {n}: the token must be at least {MIN_TOKEN} characters")
            if role in ("admin", "engine"):
                principal = Principal(role)
            elif match := _TENANT.match(role):
                principal = Principal("tenant", match.group(1))
            else:
                raise ValueError(f"{where} line {n}: role {role!r} is not admin, engine or tenant:NAME")
            if any(hmac.compare_digest(token.encode(), secret) for secret, _ in entries):
                raise ValueError(f"{where} line {n}: this token is given twice")
            entries.append((token.encode(), principal))
        if not entries:
            raise ValueError(f"{where}: no token")
        return cls(entries)
