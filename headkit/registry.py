"""Tiny name → builder registries (timm style): a misspelt name fails with the valid names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named builders whose lookup errors list the allowed names.

    ``kind`` is the thing registered ("activation", "loss", ...) and ``field`` the config
    field that names one, both used in messages. Names are case-insensitive; registering a
    name twice is a ConfigError unless ``overwrite=True``.
    """

    def __init__(self, kind: str, field: str) -> None:
        self.kind = kind
        self.field = field
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T | None = None, *, overwrite: bool = False):
        """Register ``item`` under ``name``; usable as a decorator when ``item`` is omitted."""

        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def _add(obj: T) -> T:
            key = name.lower()
            if key in self._items and not overwrite:
                raise ConfigError(
                    f"{self.kind} {name!r} is already registered; choose another name, or "
                    "pass overwrite=True to replace it"
                )
            self._items[key] = obj
            return obj

        return _add(item) if item is not None else _add

    def remove(self, name: str) -> T:
        """Unregister ``name`` and return what was registered (ConfigError if unknown)."""
        item = self.get(name)
        del self._items[name.lower()]
        return item

    def get(self, name: str) -> T:
        """Return the builder for ``name`` (case-insensitive) or raise ConfigError."""
        if not isinstance(name, str) or name.lower() not in self._items:
            raise ConfigError(
                f"{self.field}={name!r} is not a known {self.kind}; "
                f"allowed: {', '.join(self.names())}"
            )
        return self._items[name.lower()]

    def name_of(self, item: object) -> str | None:
        """The (first) name ``item`` is registered under, or None when it is not registered."""
        return next((k for k, v in self._items.items() if v is item), None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
