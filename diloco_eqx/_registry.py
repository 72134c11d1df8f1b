"""A name -> strategy registry: fragment orders, codecs and fault models are added by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Strategies by name. `kind` names them in errors ("fragment_order", "codec", ...);
    `accepts` says whether an object can be one, `expected` what it should be."""

    def __init__(self, kind: str, expected: str, accepts: Callable[[object], bool]):
        self.kind, self.expected, self.accepts = kind, expected, accepts
        self.items: dict[str, T] = {}

    def register(self, name: str, item: T, *, overwrite: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string; got {name!r}")
        if not self.accepts(item):
            raise ValueError(f"{self.kind} {name!r}: expected {self.expected}, got {item!r}")
        old = self.items.get(name)
        if old is not None and not overwrite and not (old is item or old == item):
            raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
        self.items[name] = item

    def names(self) -> tuple[str, ...]:
        return tuple(self.items)

    def __contains__(self, name: object) -> bool:
        return name in self.items

    def __getitem__(self, name: str) -> T:
        return self.items[name]
