"""The part of an engine integration's config that says where the cell is: the fields the
vLLM connector and the SGLang backend share, their parsing from the engine's JSON config, and
the Store they open."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ._native import Store


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@dataclass
class CellConfig:
    redis_url: str = "redis://127.0.0.1:6379"  # the cell's Redis (redis:// or rediss://, user@ for ACLs)
    redis_password_file: str = ""  # a file holding the Redis password (not the password itself)
    cell: str = "default"  # the cell's name in that Redis
    transports: str = ""  # "shm,tcp,verbs,ucx"; "" for every one built in
    cluster_token_file: str = ""  # the cell's shared secret, when its nodes require one
    ttl_ms: int = 0  # how long a stored chunk or page lives; 0: until evicted
    timeout_ms: int = 10000  # the deadline of one lookup, load or save
    listen: str = ""  # host:port where peers reach this process's memory (direct P/D); "": loopback

    WHERE: ClassVar[str] = "extra config"  # what the engine calls the config, for errors
    ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset()  # keys the engine itself reads there

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None):
        """Parses the engine's JSON config: every key is a field (the engine's own aside), each
        value converted to the field's type. ValueError naming the key for anything else."""
        extra = {k: v for k, v in (extra or {}).items() if k not in cls.ENGINE_KEYS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvstash: unknown {cls.WHERE} keys {unknown}; known: {sorted(known)}")
        out = cls()
        for name, value in extra.items():
            kind = type(getattr(out, name))
            if kind is bool and isinstance(value, str):
                value = value.lower() in ("1", "true", "yes", "on")
            try:
                setattr(out, name, kind(value))
            except (TypeError, ValueError) as e:
                raise ValueError(f"kvstash: {name} must be a {kind.__name__}, not {value!r}") from e
        if out.ttl_ms < 0 or out.timeout_ms <= 0:
            raise ValueError("kvstash: ttl_ms must be >= 0 and timeout_ms > 0")
        out.check()
        return out

    def check(self) -> None:
        """The integration's own checks of its fields (ValueError)."""

    def open_store(self) -> Store:
        return Store(self.redis_url, redis_password=_read(self.redis_password_file) if self.redis_password_file else "",
                     cell=self.cell, transports=self.transports, timeout_ms=self.timeout_ms,
                     cluster_token=_read(self.cluster_token_file) if self.cluster_token_file else None,
                     listen=self.listen)
