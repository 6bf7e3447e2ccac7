"""Field values against their dataclass annotations, for objects that Python callers build (the CLI and
the HTTP API convert and check their own input first)."""

from __future__ import annotations

import dataclasses
import numbers
import typing

# what a value of each scalar type may be (a bool is no number here), and how an error names it
KINDS = {bool: (lambda v: isinstance(v, bool), "true or false"),
         int: (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
         float: (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
         str: (lambda v: isinstance(v, str), "a string"),
         dict: (lambda v: isinstance(v, dict), "a dict")}


def wrong_type(obj, passes: typing.Callable[[dataclasses.Field, object], bool] = lambda f, v: False
               ) -> tuple[str, str] | None:
    """The first init field of ``obj`` whose value is not of its annotated type, as (name, what it should be:
    "an integer (or None)"); None if all are. Fields typed other than by ``KINDS`` (lists, say) are left to
    their class, as are values that ``passes(field, value)`` lets through."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        checks = [KINDS.get(k) for k in kinds if k is not type(None)]
        value = getattr(obj, f.name)
        if not f.init or None in checks or (value is None and type(None) in kinds) or passes(f, value):
            continue
        if not any(ok(value) for ok, _ in checks):
            return f.name, " or ".join(w for _, w in checks) + (" (or None)" if type(None) in kinds else "")
    return None
