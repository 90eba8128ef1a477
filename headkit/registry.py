"""Tiny name → builder registries (timm style): a misspelt name fails with the valid names."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named builders whose lookup errors list the allowed names.

    ``kind`` is the thing registered ("activation", "loss", ...) and ``field`` the config
    field that names one, both used in messages. Names are case-insensitive; registering a
    name twice is a ConfigError unless ``overwrite=True``. ``register_lazy(name,
    "module:attr")`` registers what that module defines without importing it: the module is
    imported on the first ``get(name)`` (so listing names stays cheap, and a package at the
    edge is registered without the registry's own package importing it).
    """

    def __init__(self, kind: str, field: str) -> None:
        self.kind = kind
        self.field = field
        self._items: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._order: dict[str, None] = {}  # every name, in the order it was registered

    def register(self, name: str, item: T | None = None, *, overwrite: bool = False):
        """Register ``item`` under ``name``; usable as a decorator when ``item`` is omitted."""

        key = self._new_key(name, overwrite)

        def _add(obj: T) -> T:
            self._lazy.pop(key, None)
            self._items[key] = obj
            self._order.setdefault(key)
            return obj

        return _add(item) if item is not None else _add

    def register_lazy(self, name: str, target: str, *, overwrite: bool = False) -> None:
        """Register ``target`` ("package.module:attribute"), imported on first ``get``."""
        key = self._new_key(name, overwrite)
        if not isinstance(target, str) or target.count(":") != 1:
            raise ConfigError(
                f"a lazy {self.kind} is named as 'module:attribute', got {target!r}",
                field=self.field,
                value=target,
            )
        self._items.pop(key, None)
        self._lazy[key] = target
        self._order.setdefault(key)

    def _new_key(self, name: object, overwrite: bool) -> str:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"a {self.kind} name must be a non-empty string, got {name!r}",
                field=self.field,
                value=name,
            )
        key = name.lower()
        if (key in self._items or key in self._lazy) and not overwrite:
            raise ConfigError(
                f"{self.kind} {name!r} is already registered; choose another name, or "
                "pass overwrite=True to replace it",
                field=self.field,
                value=name,
            )
        return key

    def remove(self, name: str) -> T:
        """Unregister ``name`` and return what was registered (ConfigError if unknown)."""
        item = self.get(name)
        del self._items[name.lower()]
        del self._order[name.lower()]
        return item

    def get(self, name: str) -> T:
        """Return the builder for ``name`` (case-insensitive) or raise ConfigError."""
        item = self._items.get(name) if isinstance(name, str) else None
        if item is not None:  # the name as registered (lower case): the path of every step
            return item
        if not isinstance(name, str) or name.lower() not in self:
            raise ConfigError(
                f"{self.field}={name!r} is not a known {self.kind}; "
                f"allowed: {', '.join(self.names())}",
                field=self.field,
                value=name,
            )
        key = name.lower()
        if key in self._lazy:
            module, attr = self._lazy.pop(key).split(":")
            self._items[key] = getattr(importlib.import_module(module), attr)
        return self._items[key]

    def name_of(self, item: object) -> str | None:
        """The (first) name ``item`` is registered under, or None when it is not registered."""
        return next((k for k, v in self._items.items() if v is item), None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name.lower() in self._items or name.lower() in self._lazy)

    def names(self) -> list[str]:
        return sorted({*self._items, *self._lazy})

    def in_order(self) -> list[str]:
        """The names in the order they were registered (built-in ones first)."""
        return list(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
