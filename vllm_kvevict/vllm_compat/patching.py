# SPDX-License-Identifier: Apache-2.0
"""The one way the plugin patches a vLLM class: :func:`wrap_method`.

Idempotent (a second wrap of the same method under the same name is a no-op, so ``register()`` can
run in every process any number of times), reversible (:func:`unwrap` restores exactly what was
there, inherited or not), and recorded (:func:`patches` lists what is wrapped, for tests and
debugging). Plain methods, classmethods and staticmethods are kept as what they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Patch:
    cls: type | ModuleType
    name: str
    purpose: str
    original: Any  # what ``cls.__dict__`` held under ``name`` (None: inherited)


_PATCHES: dict[tuple[type | ModuleType, str], Patch] = {}


def wrap_method(cls: type | ModuleType, name: str, make: Callable[[Callable], Callable], purpose: str) -> bool:
    """Replace ``cls.name`` by ``make(original)``, where ``original`` is the plain function the
    attribute resolves to (a classmethod's underlying function takes ``cls`` first). ``cls`` may
    also be a module (a module-level function). Returns False when it is wrapped already."""
    key = (cls, name)
    if key in _PATCHES:
        return False
    own = cls.__dict__.get(name)
    raw = own if own is not None else _lookup(cls, name)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    func = raw.__func__ if kind is not None else raw
    wrapper: Any = make(func)
    wrapper.__kvevict_purpose__ = purpose
    wrapper.__wrapped__ = func  # inspect.signature() and friends see vLLM's own signature
    setattr(cls, name, kind(wrapper) if kind is not None else wrapper)
    _PATCHES[key] = Patch(cls, name, purpose, own)
    return True


def _lookup(cls: type | ModuleType, name: str) -> Any:
    for base in getattr(cls, "__mro__", (cls,)):  # a module has no MRO: its own namespace
        if name in base.__dict__:
            return base.__dict__[name]
    owner = getattr(cls, "__qualname__", cls.__name__)  # a module has only a __name__
    raise AttributeError(f"{owner} has no attribute {name!r} to wrap")


def unwrap(cls: type | ModuleType, name: str) -> None:
    """Undo :func:`wrap_method` for ``cls.name`` (no-op when it is not wrapped)."""
    patch = _PATCHES.pop((cls, name), None)
    if patch is None:
        return
    if patch.original is None:
        delattr(cls, name)
    else:
        setattr(cls, name, patch.original)


def is_wrapped(cls: type | ModuleType, name: str) -> bool:
    return (cls, name) in _PATCHES


def patches() -> list[Patch]:
    return list(_PATCHES.values())
