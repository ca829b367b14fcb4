"""A name → entry table with validated parameters: what `algo.loss` (objectives) and
`algo.correction` (off-policy corrections) select from.

An entry carries a pydantic model of its parameters; `params()` validates a config mapping
against it and phrases every problem with the full config key (e.g. `algo.loss_args.dual_soft_clip`).
"""

from __future__ import annotations

from typing import Any, Generic, Mapping, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["NoParams", "Registry", "RegistryEntry"]


class NoParams(BaseModel):
    """An entry without parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RegistryEntry(Protocol):
    name: str
    params: type[BaseModel]


E = TypeVar("E", bound=RegistryEntry)


class Registry(Generic[E]):
    """Entries of one kind (`kind`, e.g. "objective"), selected by the config key `key`."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key
        self._entries: dict[str, E] = {}

    def add(self, entry: E) -> E:
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is registered twice")
        self._entries[entry.name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> E:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"{self.key}: unknown {self.kind} {name!r}; choose from {self.names()}") from None

    def params(self, name: str, args: Mapping[str, Any] | BaseModel | None, where: str) -> BaseModel:
        """`args` validated against entry `name`'s parameter model; ValueError naming `where.<field>`."""
        entry = self.get(name)
        if isinstance(args, entry.params):
            return args
        try:
            return entry.params.model_validate(dict(args or {}))
        except ValidationError as e:
            msgs = []
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"])
                msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
                msgs.append(f"{where}.{loc}: {msg}" if loc else f"{where}: {msg}")
            fields = ", ".join(entry.params.model_fields) or "none"
            raise ValueError("; ".join(msgs) + f" ({self.kind} {name!r} takes: {fields})") from None
