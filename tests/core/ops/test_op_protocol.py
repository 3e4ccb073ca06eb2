"""The typed op table: ``Ops`` lists every registered op with exactly its reference's signature."""

from __future__ import annotations

import inspect

import pytest

from deepinfer.ops import Ops, OpTable, op_defs


def _protocol_methods() -> dict[str, inspect.Signature]:
    """Ops' members as the references would declare them: ``self`` dropped, annotations evaluated."""
    methods = {}
    for name, member in vars(Ops).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        sig = inspect.signature(member, eval_str=True)
        methods[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return methods


def test_protocol_lists_every_registered_op_and_nothing_else():
    methods, defs = _protocol_methods(), op_defs()
    assert sorted(set(defs) - set(methods)) == [], "registered ops missing from deepinfer/ops/protocol.py"
    assert sorted(set(methods) - set(defs)) == [], "protocol methods that are no registered op"


@pytest.mark.parametrize("name", sorted(op_defs()))
def test_protocol_signature_equals_the_reference(name):
    """Names, kinds, defaults, parameter and return annotations (evaluated, so ``Tensor`` == ``torch.Tensor``)."""
    reference = inspect.signature(op_defs()[name].reference, eval_str=True)
    assert _protocol_methods()[name] == reference, f"Ops.{name}{_protocol_methods()[name]} != {name}{reference}"


def test_table_names_do_not_shadow_ops():
    """Ops are instance attributes of the table: an op named like a table method would hide it (or be hidden)."""
    table_api = {n for n in dir(OpTable) if not n.startswith("_")}
    assert table_api.isdisjoint(op_defs()), table_api & set(op_defs())


def test_table_serves_every_protocol_method_as_a_plain_attribute():
    table = OpTable()
    for name in _protocol_methods():
        assert name in vars(table) and callable(vars(table)[name]), name


def test_the_catalog_lists_every_module_that_registers_ops():
    """``deepinfer.ops.catalog`` loads the op modules by an explicit list: a new module of this package that registers
    an op, and is not listed, would leave its ops out of every table."""
    import importlib
    import pkgutil

    import deepinfer.ops as package
    from deepinfer.ops.catalog import OP_MODULES
    from deepinfer.ops.registry import registered

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    registering = {d.reference.__module__ for d in registered().values()}
    assert registering == {m.__name__ for m in OP_MODULES}
    assert set(registered()) == set(op_defs())
