"""Field values against their dataclass annotations, for objects that Python callers build (the CLI and
the HTTP API convert and check their own input first)."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import typing

# what a value of each scalar type may be (a bool is no number here), how an error names it, and the
# built-in types that pass at a glance
KINDS = {bool: (lambda v: isinstance(v, bool), "true or false", (bool,)),
         int: (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer", (int,)),
         float: (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number", (float, int)),
         str: (lambda v: isinstance(v, str), "a string", (str,)),
         dict: (lambda v: isinstance(v, dict), "a dict", (dict,))}


def token_ids(values) -> list[int] | None:
    """``values`` as a list of Python ints if every one is a non-negative integer of any integral type (a
    numpy array's elements, say), else None."""
    ids = list(values)
    if all(type(v) is int and v >= 0 for v in ids):  # the common case, without the ABC check a value
        return ids
    ok = KINDS[int][0]
    return [int(v) for v in ids] if all(ok(v) and v >= 0 for v in ids) else None


@functools.cache
def _typed_fields(cls: type) -> tuple[tuple[str, frozenset, tuple, str], ...]:
    """Once a class (reading annotations takes a few hundred microseconds, and a request builds its
    parameters each time): each init field typed by ``KINDS`` alone, as its name, the types that pass at a
    glance, its checks, and what it should be ("an integer (or None)")."""
    hints = typing.get_type_hints(cls)
    typed = []
    for f in dataclasses.fields(cls):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        entries = [KINDS.get(k) for k in kinds if k is not type(None)]
        if not f.init or None in entries:
            continue
        optional = type(None) in kinds
        exact = frozenset(t for _, _, ts in entries for t in ts) | ({type(None)} if optional else set())
        words = " or ".join(w for _, w, _ in entries) + (" (or None)" if optional else "")
        typed.append((f.name, exact, tuple(ok for ok, _, _ in entries), words))
    return tuple(typed)


def wrong_type(obj, passes: typing.Callable[[str, object], bool] = lambda name, v: False) -> tuple[str, str] | None:
    """The first init field of ``obj`` whose value is not of its annotated type, as (name, what it should be);
    None if all are. Fields typed other than by ``KINDS`` (lists, say) are left to their class, as are values
    that ``passes(name, value)`` lets through."""
    for name, exact, checks, words in _typed_fields(type(obj)):
        value = getattr(obj, name)
        if type(value) in exact or any(ok(value) for ok in checks) or passes(name, value):
            continue
        return name, words
    return None
