"""The one rule for what may stand in for a reference op: the same call shape.

An override (and a coverage predicate, see :class:`~deepinfer.ops.table.OpTable`) must take exactly its reference's
parameters: the same names, in the same order, of the same kinds (positional-or-keyword, keyword-only, ``*args``,
``**kwargs``), with the same defaults.  Then every call core makes binds the same way to both, whether it passes an
argument by position or by name, or leaves a default out.

Annotations (and the return annotation) are not compared: they do not change how a call binds, and a backend may
spell them differently (``Tensor`` or ``torch.Tensor``, strings under ``from __future__ import annotations``, none
at all).  Core's own types are checked statically instead: :class:`~deepinfer.ops.protocol.Ops` against the
references, in a test.

A wrapper that takes ``(*args, **kwargs)`` does not have the reference's call shape and is refused, unless it was
made with ``functools.wraps`` (or sets ``__wrapped__`` another way): ``inspect.signature`` then reads the wrapped
function's signature, which is the one checked.  ``functools.partial`` objects are read through too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def call_shape(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature without annotations: what the comparison sees.  Raises ValueError / TypeError when
    ``inspect`` cannot read one (some builtins)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def check_call_shape(reference: Callable[..., Any], impl: Callable[..., Any], what: str) -> None:
    """Raise TypeError unless ``impl`` takes exactly ``reference``'s parameters (see the module docstring).

    ``what`` starts the message, e.g. ``"backend 'x' overrides op 'rms_norm'"``; the message adds both signatures.
    """
    expected = call_shape(reference)
    where = f"{reference.__module__}.{reference.__qualname__}"
    try:
        got = call_shape(impl)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} with {impl!r}, whose signature cannot be read ({exc}); wrap it in a Python "
                        f"function with the reference's signature {expected} ({where})") from None
    if got != expected:
        raise TypeError(f"{what} with signature {got}, but the reference {where} takes {expected}: parameter "
                        "names, kinds and defaults must be the same (annotations are not compared)")
