"""Named extension points: one registry type for every kind of plug-in.

Policies (``policy.registry``), store backends (``rendezvous.store``), LR rules
(``goodput.lr``), adaptation policies (``elastic.adaptation``) and launcher drivers
(``launcher.drivers``) are each one :class:`Registry`: built-ins registered where they are
defined (or as ``"module:attr"`` strings imported on first use, so that naming a backend
never imports a framework nobody runs), plug-ins through :meth:`Registry.register`.

Protocol: ``register`` refuses a taken name unless ``replace=True`` (two plug-ins
claiming one name is a mistake to see, not to settle by import order); ``get`` raises
:class:`UnknownName` listing the choices; ``unregister`` raises ``KeyError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import UserError

__all__ = ["Registry", "RegistryError", "UnknownName", "load_plugins"]

T = TypeVar("T")


class RegistryError(UserError, ValueError):
    """A bad registration: an empty or taken name, an entry of the wrong kind."""


class UnknownName(RegistryError, KeyError):
    """``get`` of a name nobody registered; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


_LOADED: set[str] = set()  # entry-point groups whose plug-ins are registered


def load_plugins(group: str) -> None:
    """Call every ``module:function`` entry point of ``group`` once per process; each
    registers its entries (in one or several registries)."""
    if group in _LOADED:
        return
    _LOADED.add(group)  # first: a plug-in that looks a name up must not load again
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        ep.load()()


class Registry(Generic[T]):
    """Entries of one ``kind`` by name.

    An entry is the object itself or, where ``lazy``, a ``"module:attr.path"`` string
    imported on its first ``get`` (an ``ImportError`` then propagates: the caller says
    which extra to install). ``check`` validates an object entry at registration
    (``expects`` says what it wants, for the error); ``fold`` normalises names (e.g.
    ``str.lower`` for URL schemes); ``valid_name`` refuses names of the wrong form.
    ``plugins`` names an entry-point group (``[project.entry-points."<group>"]`` in a
    package's metadata): on the first lookup every entry point of it is called once
    (:func:`load_plugins`) and registers what it brings - this is how the adapters, and
    any third-party package, plug their launch sides into the launcher without the
    launcher naming them.
    """

    def __init__(self, kind: str, *, check: Callable[[object], bool] = lambda _: True,
                 expects: str = "a valid entry", lazy: bool = False,
                 fold: Callable[[str], str] = lambda name: name,
                 valid_name: Callable[[str], bool] = lambda _: True,
                 plugins: str | None = None) -> None:
        self.kind = kind
        self._check, self._expects, self._lazy = check, expects, lazy
        self._fold, self._valid_name = fold, valid_name
        self._entries: dict[str, T | str] = {}
        self._plugins = plugins

    def _load_plugins(self) -> None:
        if self._plugins is not None:
            load_plugins(self._plugins)  # (once per process and group)

    def register(self, name: str, entry: T | str, *, replace: bool = False) -> None:
        """Make ``get(name)`` return ``entry``.

        Raises RegistryError for an empty or malformed name, an entry that fails
        ``check`` (a lazy string must be ``module:attr``), or a taken name without
        ``replace=True``.
        """
        if not isinstance(name, str) or not name or not self._valid_name(name):
            raise RegistryError(f"bad {self.kind} name {name!r}")
        if self._lazy and isinstance(entry, str):
            if ":" not in entry:
                raise RegistryError(f"{self.kind} {name!r}: expected {self._expects} or "
                                    f"'module:attr', got {entry!r}")
        elif not self._check(entry):
            raise RegistryError(f"{self.kind} {name!r}: expected {self._expects}, "
                                f"got {entry!r}")
        key = self._fold(name)
        if key in self._entries and not replace:
            raise RegistryError(f"{self.kind} {name!r} is already registered; "
                                "pass replace=True to replace it")
        self._entries[key] = entry

    def unregister(self, name: str) -> None:
        """Forget ``name`` (KeyError if it is not registered)."""
        del self._entries[self._fold(name)]

    def get(self, name: str) -> T:
        """The entry called ``name`` (imported on first use); raises UnknownName."""
        self._load_plugins()
        key = self._fold(name) if isinstance(name, str) else name
        if key not in self._entries:
            raise UnknownName(f"unknown {self.kind} {name!r}: choose one of "
                              f"{', '.join(self.names())}")
        entry = self._entries[key]
        if self._lazy and isinstance(entry, str):
            module, _, attrs = entry.partition(":")
            obj: object = importlib.import_module(module)
            for attr in attrs.split("."):
                obj = getattr(obj, attr)
            self._entries[key] = entry = obj  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    __getitem__ = get

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return isinstance(name, str) and self._fold(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._load_plugins()
        return len(self._entries)
