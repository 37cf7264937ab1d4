"""What an engine client remembers of the LoRA adapters it loaded (`AdapterLoader`)."""

from __future__ import annotations

import dataclasses

KEEP_ADAPTERS = 2  # the served one and the one before (requests in flight may still name it)


@dataclasses.dataclass(kw_only=True, slots=True)
class AdapterSlots:
    """The adapter names a client loaded on its engine, oldest first; the last one is what its
    requests name."""

    keep: int = KEEP_ADAPTERS
    names: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.keep >= 1, f"{self.keep=}"

    @property
    def current(self) -> str | None:
        """The adapter requests name now (None: the base model)."""
        return self.names[-1] if self.names else None

    def add(self, name: str) -> list[str]:
        """`name` is loaded and served now; the names to unload (beyond the `keep` newest)."""
        self.names = [n for n in self.names if n != name] + [name]
        stale, self.names = self.names[: -self.keep], self.names[-self.keep :]
        return stale

    def forget(self, name: str) -> None:
        """`name` is gone from the engine (unloaded, or the engine restarted without it)."""
        self.names = [n for n in self.names if n != name]
