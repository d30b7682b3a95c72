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

    from probing.cli import app

    commands = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert len(commands) >= 10
    text = (DOCS / "cli.md").read_text()
    missing = [c for c in commands if not re.search(rf"\| `probing {c}\b", text)]
    assert not missing, f"add a row for each to the table in docs/cli.md: {missing}"


def test_every_table_a_probe_answers_is_in_the_sql_reference() -> None:
    import probing
    from probing.engine import Engine
    from probing.store import Store

    engine = Engine(Store())
    probing.install_tables(engine)
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
    from probing.probe.api import ROUTES

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


def test_the_design_layout_names_every_module() -> None:
    """docs/design.md's layout is the tree: each package of ``probing/`` has
    its entry, and each module is named in its package's entry."""
    text = (DOCS / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```")[1]
    entries: dict[str, str] = {}  # "cluster" -> its lines; "" -> the top-level files
    current = ""
    for line in block.splitlines():
        head = re.match(r"  (\S+?)(/)?\s", line + " ")
        if head and not line.startswith("   "):
            current = head.group(1) if head.group(2) else ""
        entries[current] = entries.get(current, "") + line + "\n"
    pkg = Path(__file__).resolve().parent.parent / "probing"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.name in ("__init__.py", "__main__.py") or len(rel.parts) > 2:
            continue
        where = rel.parts[0] if len(rel.parts) == 2 else ""
        if where and where not in entries:
            missing.append(f"{where}/")
        elif not re.search(rf"\b{re.escape(path.stem)}\b", entries.get(where, "")):
            missing.append(str(rel))
    assert not missing, f"name each in docs/design.md's layout: {sorted(set(missing))}"
