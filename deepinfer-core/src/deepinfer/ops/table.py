"""The op table: every registered op resolved, once, to a backend's override or core's reference.

Models, the runner and the sampler take the table as ``ops: Ops`` (:mod:`deepinfer.ops.protocol`; for mypy the
table is one) and call ``ops.rms_norm(x, weight, eps)``: a plain attribute of the table, no lookup on the hot path.

Building a table checks what the backend hands in: every override and coverage predicate takes exactly its
reference's parameters (:mod:`deepinfer.ops.signature`), or the build fails naming the op and both signatures.

Coverage: a kernel may handle only some inputs (a power-of-two stream count, a rope width that fits one tile).
The backend declares that with a predicate per op (:meth:`Backend.op_coverage
<deepinfer.backends.backend.Backend.op_coverage>`), and the table runs the reference for the calls the predicate
refuses, so an unsupported shape costs speed, never a failure.  A predicate rather than an exception the kernel
raises: it is a declaration the conformance suite can read (it runs the uncovered samples and checks they got the
reference), a real error inside a kernel still raises instead of being mistaken for "not covered", and the kernel
is never entered for inputs it cannot take (no half-done launches).  Its price is two Python calls (the dispatcher
and the predicate) per call of a partially covered op; ops without a predicate are bound to the kernel directly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from deepinfer import envs
from deepinfer.ops.catalog import op_defs
from deepinfer.ops.protocol import Ops
from deepinfer.ops.registry import OpDef
from deepinfer.ops.signature import check_call_shape

if TYPE_CHECKING:
    from deepinfer.backends.backend import Backend

    _Typed = Ops  # mypy sees the table as an Ops: ``table.rms_norm(...)`` is checked, ``table.rms_nrom`` an error
else:
    _Typed = object  # at run time the ops are instance attributes (see OpTable.__init__)

logger = logging.getLogger(__name__)

#: A coverage predicate: called with an op's arguments, True where the backend's override handles them.
Covers = Callable[..., bool]


def check_overrides(
    overrides: Mapping[str, Callable[..., Any]], coverage: Mapping[str, Covers], backend_name: str
) -> None:
    """Raise unless every override and predicate names a registered op and takes its reference's parameters."""
    defs = op_defs()
    unknown = sorted(set(overrides) - set(defs))
    if unknown:
        raise ValueError(f"backend {backend_name!r} overrides unknown ops {unknown}; known ops: {sorted(defs)}")
    stray = sorted(set(coverage) - set(overrides))
    if stray:
        raise ValueError(f"backend {backend_name!r} declares coverage of ops it does not override: {stray}")
    for name, impl in overrides.items():
        check_call_shape(defs[name].reference, impl, f"backend {backend_name!r} overrides op {name!r}")
    for name, covers in coverage.items():
        check_call_shape(defs[name].reference, covers, f"backend {backend_name!r} declares op {name!r}'s coverage")


def kernel_or_reference(
    name: str, kernel: Callable[..., Any], covers: Covers, reference: Callable[..., Any], backend_name: str
) -> Callable[..., Any]:
    """``kernel(*args)`` where ``covers(*args)``, else ``reference(*args)``; the first fallback is logged."""
    logged = False

    def op(*args: Any, **kwargs: Any) -> Any:
        if covers(*args, **kwargs):
            return kernel(*args, **kwargs)
        nonlocal logged
        if not logged:
            logged = True
            logger.info("op %s: backend %r's kernel does not cover these inputs (see its op_coverage); core's "
                        "reference runs such calls", name, backend_name)
        return reference(*args, **kwargs)

    return functools.update_wrapper(op, kernel)


class OpTable(_Typed):
    """Resolved ops for one backend: ``table.rms_norm(x, w, eps)`` calls the override or the reference.

    ``batch_invariant`` (default: ``DEEPINFER_BATCH_INVARIANT``, read once here) selects each op's
    batch-invariant reference where the backend does not override it.  ``coverage`` maps overridden ops to
    predicates (see the module docstring).  For mypy the table derives from :class:`~deepinfer.ops.protocol.Ops`.
    """

    _impls: dict[str, Callable[..., Any]]
    _overridden: frozenset[str]
    _coverage: dict[str, Covers]
    backend_name: str
    batch_invariant: bool

    def __init__(
        self,
        overrides: Mapping[str, Callable[..., Any]] | None = None,
        backend_name: str = "reference",
        batch_invariant: bool | None = None,
        coverage: Mapping[str, Covers] | None = None,
    ):
        overrides, coverage = dict(overrides or {}), dict(coverage or {})
        check_overrides(overrides, coverage, backend_name)
        self.batch_invariant = envs.batch_invariant() if batch_invariant is None else batch_invariant
        self.backend_name = backend_name
        self._overridden = frozenset(overrides)
        self._coverage = coverage
        self._impls = {n: self._resolve(d, overrides, coverage) for n, d in op_defs().items()}
        vars(self).update(self._impls)  # ops as instance attributes: ``table.op`` is one dict hit

    def _resolve(self, d: OpDef, overrides: dict[str, Callable[..., Any]], coverage: dict[str, Covers]) -> Any:
        reference = (d.batch_invariant or d.reference) if self.batch_invariant else d.reference
        if d.name not in overrides:
            return reference
        if d.name not in coverage:
            return overrides[d.name]
        return kernel_or_reference(d.name, overrides[d.name], coverage[d.name], reference, self.backend_name)

    if not TYPE_CHECKING:  # hidden from mypy, which then reports a misspelt op instead of typing it as Any

        def __getattr__(self, name: str) -> Callable[..., Any]:
            """Only reached for names that are no op (ops are instance attributes): say so."""
            raise AttributeError(f"no op named {name!r}")

    def source(self, name: str) -> str:
        """Who implements op ``name`` in this table: the backend's name or ``"reference"``."""
        if name not in self._impls:
            raise KeyError(name)
        return self.backend_name if name in self._overridden else "reference"

    def uses_override(self, name: str, *args: Any, **kwargs: Any) -> bool:
        """Whether ``op name(*args, **kwargs)`` runs the backend's override (not the reference) in this table."""
        if name not in self._overridden:
            return False
        covers = self._coverage.get(name)
        return covers is None or bool(covers(*args, **kwargs))

    @property
    def overridden(self) -> frozenset[str]:
        """Names of ops the backend replaced."""
        return self._overridden

    @property
    def partially_covered(self) -> frozenset[str]:
        """Names of overridden ops whose kernel declares what it covers (the reference runs the rest)."""
        return frozenset(self._coverage)

    @classmethod
    def for_backend(cls, backend: Backend) -> OpTable:
        """The table of ``backend``, built once per backend object and value of ``DEEPINFER_BATCH_INVARIANT``.

        With the flag on, a backend's override of an op that has rows is kept only if the backend lists the
        op in ``batch_invariant_ops`` (proven by ``check_batch_invariance``); the others fall back to the
        batch-invariant reference, so the flag's promise never rests on an unproven kernel.
        """
        flag = envs.batch_invariant()
        tables: dict[bool, OpTable] = vars(backend).setdefault("_deepinfer_op_tables", {})
        table = tables.get(flag)
        if table is None:
            overrides, coverage = dict(backend.load_ops()), dict(backend.op_coverage())
            if flag:
                check_overrides(overrides, coverage, backend.name)  # the dropped ones too
                defs = op_defs()
                claimed = set(backend.batch_invariant_ops)
                dropped = sorted(n for n in overrides if defs[n].rows is not None and n not in claimed)
                if dropped:
                    logger.info("DEEPINFER_BATCH_INVARIANT=1: backend %r does not declare %s batch-invariant; "
                                "using core's batch-invariant reference for them", backend.name, dropped)
                overrides = {n: f for n, f in overrides.items() if n not in dropped}
                coverage = {n: c for n, c in coverage.items() if n not in dropped}
            table = tables[flag] = cls(overrides, backend.name, flag, coverage)
        return table
