"""The documentation against the code: every command, table and endpoint has
its row in docs/, and the README stays short. A command, table or endpoint
added without its row fails here: add the row to the page named."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"


def test_every_cli_command_is_in_the_cli_reference() -> None:
    import typer.main

    from probing.cli.app import app

    commands = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert len(commands) >= 10
    text = (DOCS / "cli.md").read_text()
    missing = [c for c in commands if not re.search(rf"\| `probing {c}\b", text)]
    assert not missing, f"add a row for each to the table in docs/cli.md: {missing}"


def test_every_table_a_probe_answers_is_in_the_sql_reference() -> None:
    from probing.node import assemble
    from probing.node.sql import Engine
    from probing.node.store import Store

    engine = Engine(Store())
    assemble.install_tables(engine)
    names = [  # static tables, views and store tables: what the catalog knows
        f"{schema}.{table}"
        for schema in engine.catalog.schema_names()
        for table in engine.schema(schema).table_names
    ]
    assert {"comm.collectives", "process.threads", "probing.tables"} <= set(names)
    text = (DOCS / "sql.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"add a section or a row for each to docs/sql.md: {missing}"


def test_every_http_endpoint_is_in_the_http_reference() -> None:
    from probing.node.probe.api import ROUTES

    text = (DOCS / "http.md").read_text()
    missing = [f"{m} {p}" for m, p in ROUTES if f"`{m} {p}`" not in text]
    assert not missing, f"add a row for each to docs/http.md: {missing}"


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.encode()) < 12 * 1024
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/cli.md", "docs/sql.md", "docs/http.md", "docs/design.md"} <= set(links)
    assert "docs/measurements.md" in links
    for link in links:
        assert (README.parent / link).exists(), link


def test_the_benchmarks_the_measurements_cite_exist() -> None:
    text = (DOCS / "measurements.md").read_text()
    cited = set(re.findall(r"benchmarks/(\w+\.py)", text))
    assert cited, "docs/measurements.md cites no benchmark"
    bench = DOCS.parent / "benchmarks"
    assert not [c for c in cited if not (bench / c).exists()]


def test_the_docs_state_the_python_versions_whose_frames_probing_reads() -> None:
    """One source: ``pyframes.SUPPORTED`` (the generated offsets table); every
    span of versions a page states, and the refusal cli.md quotes, are it."""
    from probing.pyframes import SUPPORTED

    span = f"{SUPPORTED[0]}-{SUPPORTED[-1]}"
    pages = [README, *sorted(DOCS.glob("*.md"))]
    stated = [
        (page.name, f"3.{m[0]}-3.{m[1]}")
        for page in pages
        for m in re.findall(r"\b3\.(\d+)\s*(?:-|to)\s*3\.(\d+)\b", page.read_text())
    ]
    assert ("README.md", span) in stated and ("design.md", span) in stated
    wrong = [(name, s) for name, s in stated if s != span]
    assert not wrong, f"probing reads the frames of {span} (pyframes.SUPPORTED): {wrong}"
    refusal = re.search(r"\(supported: ([\d.,\s]+)\)", (DOCS / "cli.md").read_text())
    assert refusal is not None
    assert refusal.group(1).split() == ", ".join(SUPPORTED).split()


def _layout_entries() -> dict[str, str]:
    """docs/design.md's layout block, by folder: "node/bpf" -> its lines,
    "" -> the lines of probing/'s own files. A folder's entry starts where
    its name stands at its depth's indent (2 spaces a level under probing/)."""
    text = (DOCS / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```")[1]
    block = block.split("probing/\n", 1)[1]
    entries: dict[str, str] = {"": ""}
    stack: list[str] = []  # the folders open at each depth
    current = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        token = line.split()[0] if line.strip() else ""
        if indent == 0:
            break  # bpf/, tests/: out of probing/
        if indent % 2 == 0 and indent <= 2 * (len(stack) + 1) and token.endswith("/"):
            depth = indent // 2 - 1
            stack = stack[:depth] + [token.rstrip("/")]
            current = "/".join(stack)
        elif indent % 2 == 0 and indent <= 2 * (len(stack) + 1) and token.endswith(".py"):
            stack = stack[: indent // 2 - 1]
            current = "/".join(stack)
        entries[current] = entries.get(current, "") + line + "\n"
    return entries


def test_the_design_layout_names_every_folder_and_module() -> None:
    """docs/design.md's layout is the tree: each package of ``probing/`` at
    any depth has its entry, under its parent's, and each module is named
    in its package's entry."""
    entries = _layout_entries()
    pkg = Path(__file__).resolve().parent.parent / "probing"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if "static" in rel.parts:
            continue
        where = "/".join(rel.parts[:-1])
        if where and where not in entries:
            missing.append(f"{where}/")
        elif rel.name not in ("__init__.py", "__main__.py") and not re.search(
            rf"\b{re.escape(path.stem)}\b", entries.get(where, "")
        ):
            missing.append(str(rel))
    stale = [d for d in entries if d and not (pkg / d / "__init__.py").exists()]
    assert not missing, f"name each in docs/design.md's layout: {sorted(set(missing))}"
    assert not stale, f"docs/design.md's layout names folders the tree lacks: {stale}"


def test_the_design_names_every_import_contract() -> None:
    """Each import-linter contract of pyproject.toml is explained in
    docs/design.md's Layers, by its id, and the count there is right."""
    import tomllib

    config = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    text = (DOCS / "design.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"checks {words[len(contracts)]} contracts" in text
    for contract in contracts:
        label = {
            "cycles": "no cycles",
            "collectors": "collectors never import each other",
            "guest": "the guest imports only the standard library",
        }.get(contract["id"], contract["id"])
        assert f"**{label}**" in text, f"docs/design.md's Layers does not explain {contract['id']}"
