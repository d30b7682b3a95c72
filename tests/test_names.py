"""One name, one thing (issue 53): no class name is defined in two modules
of ``probing/``, unless the two are the same concept on both sides of the
guest boundary and both docstrings say so.

Saying so: each docstring names the other class, as in "The same <what> as
``probing.guest.outbox.Table``" (the words "the same", then "as" and the
other's dotted path in double backquotes), and one of the two modules is
under ``probing/guest/``. The classes counted are each module's own: those
at its top level, under an ``if`` or ``try`` too, not those inside a
function or another class."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import probing

ROOT = Path(probing.__file__).parent
# "the same ... as ``probing.x.Y``", over line breaks
SAME_AS = re.compile(r"\bthe\s+same\b[^`]*?\bas\s+``(probing(?:\.\w+)+)``", re.IGNORECASE)


def _module(path: Path) -> str:
    """``probing/node/agent.py`` -> ``probing.node.agent`` (a package: its name)."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _own_classes(body: list[ast.stmt]) -> Iterator[ast.ClassDef]:
    """The classes a module defines itself: at its top level or under an
    ``if``/``try`` there (``TYPE_CHECKING``, an import that may fail)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield node
        elif isinstance(node, ast.If):
            yield from _own_classes(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from _own_classes(node.body + handlers + node.orelse + node.finalbody)


def classes(root: Path = ROOT) -> dict[str, list[tuple[str, str]]]:
    """Each class name -> (module, docstring) of every module defining it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _own_classes(tree.body):
            out.setdefault(node.name, []).append((_module(path), ast.get_docstring(node) or ""))
    return out


def same_across_the_guest(name: str, a: tuple[str, str], b: tuple[str, str]) -> bool:
    """``a`` and ``b`` (module, docstring) define ``name`` as one concept on
    both sides of the guest boundary: one in the guest, each naming the other."""
    (mod_a, doc_a), (mod_b, doc_b) = a, b
    in_guest = [m == "probing.guest" or m.startswith("probing.guest.") for m in (mod_a, mod_b)]
    if sum(in_guest) != 1:
        return False
    return f"{mod_b}.{name}" in SAME_AS.findall(doc_a) and f"{mod_a}.{name}" in SAME_AS.findall(
        doc_b
    )


def duplicates(found: dict[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
    """The names defined in more than one module that are not one concept
    across the guest boundary: name -> its modules."""
    out: dict[str, list[str]] = {}
    for name, defs in found.items():
        if len({m for m, _ in defs}) < 2:
            continue
        if len(defs) == 2 and same_across_the_guest(name, defs[0], defs[1]):
            continue
        out[name] = [m for m, _ in defs]
    return out


def test_no_class_name_is_defined_in_two_modules() -> None:
    twice = duplicates(classes())
    assert not twice, f"one name, one thing: rename one of each: {twice}"


def test_a_pair_across_the_guest_passes_only_when_both_docstrings_say_so() -> None:
    guest = ("probing.guest.outbox", "The same table as\n``probing.node.tables.external.Table``.")
    node = ("probing.node.tables.external", "The same table as ``probing.guest.outbox.Table``.")
    assert same_across_the_guest("Table", guest, node)
    assert not same_across_the_guest("Table", guest, (node[0], "A table."))  # one says it
    # both outside the guest: not across its boundary, whatever they say
    cli = ("probing.cli.x", "The same table as ``probing.node.tables.external.Table``.")
    assert not same_across_the_guest("Table", cli, node)
    assert duplicates({"Table": [guest, node]}) == {}
    assert duplicates({"Table": [cli, node]}) == {"Table": [cli[0], node[0]]}


def test_a_class_inside_a_function_is_not_the_modules_own() -> None:
    tree = ast.parse("class A: pass\nif X:\n    class B: pass\ndef f():\n    class C: pass\n")
    assert [c.name for c in _own_classes(tree.body)] == ["A", "B"]


def test_engine_is_the_node_process_and_agent_the_node_agent() -> None:
    """The word "engine" names the node's process (``probing.node.service``) and
    "agent" the node agent (``probing.node.agent``): no module of the guest
    takes either name, and no class is called ``Engine`` (the SQL layer is
    ``probing.node.sql.Database``)."""
    guest = {p.name for p in (ROOT / "guest").rglob("*.py")}
    assert not guest & {"agent.py", "engine.py"}, "the guest's modules: neither agent nor engine"
    engines = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno}"
        for path in sorted(ROOT.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.ClassDef) and node.name == "Engine"
    ]
    assert not engines, f"a class Engine (the node's process is no class): {engines}"
