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
    from probing.node.sql import Database
    from probing.node.store import Store

    database = Database(Store())
    assemble.install_tables(database)
    names = [  # static tables, views and store tables: what the catalog knows
        f"{schema}.{table}"
        for schema in database.catalog.schema_names()
        for table in database.schema(schema).table_names
    ]
    assert {"comm.collectives", "process.threads", "probing.tables"} <= set(names)
    text = (DOCS / "sql.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"add a section or a row for each to docs/sql.md: {missing}"


def test_every_http_endpoint_is_in_the_http_reference() -> None:
    from probing.node.cluster import endpoints
    from probing.node.probe.api import Routes

    routes = Routes()  # the probe's own, and the cluster's
    endpoints.register(None, routes)  # type: ignore[arg-type]
    text = (DOCS / "http.md").read_text()
    missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in text]
    assert not missing, f"add a row for each to docs/http.md: {missing}"


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.encode()) < 12 * 1024
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/cli.md", "docs/sql.md", "docs/http.md", "docs/design.md"} <= set(links)
    assert "docs/measurements.md" in links
    for link in links:
        assert (README.parent / link).exists(), link


def test_the_readme_says_where_mypy_is_strict() -> None:
    """The packages the README calls strict are the strict override of
    pyproject.toml's mypy config, no more and no fewer."""
    import tomllib

    config = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())
    overrides = config["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs")]
    assert len(strict) == 1
    modules = {m.removeprefix("probing.").removesuffix(".*") for m in strict[0]["module"]}
    said = re.search(r"`mypy` \(([^)]*)\)", README.read_text())
    assert said is not None, "README.md: `mypy` (what it checks)"
    assert set(re.findall(r"`([\w.]+)`", said.group(1))) == modules


def test_the_benchmarks_the_measurements_cite_exist() -> None:
    text = (DOCS / "measurements.md").read_text()
    cited = set(re.findall(r"benchmarks/(\w+\.py)", text))
    assert cited, "docs/measurements.md cites no benchmark"
    bench = DOCS.parent / "benchmarks"
    assert not [c for c in cited if not (bench / c).exists()]


def test_every_benchmark_has_its_entry_and_the_sections_it_names_exist() -> None:
    """benchmarks/README.md: an entry (### `path`) for each script, none for
    a script gone, and each section it points to (`[page.md § Heading]`) a
    heading of that page; docs/measurements.md's introduction links it."""
    bench = DOCS.parent / "benchmarks"
    text = (bench / "README.md").read_text()
    entries = set(re.findall(r"^### `([\w/.]+)`$", text, re.M))
    scripts = {p.relative_to(bench).as_posix() for p in bench.rglob("*.py")}
    assert not scripts - entries, f"add an entry to benchmarks/README.md: {scripts - entries}"
    assert not entries - scripts, f"benchmarks/README.md: no such script {entries - scripts}"
    named = re.findall(r"\[(\w+\.md) § ([^\]]+)\]\(\.\./docs/(\w+\.md)\)", text)
    assert len(named) >= len(scripts)
    wrong = []
    for page, heading, target in named:
        lines = (DOCS / page).read_text().splitlines()
        if page != target or heading not in {h.lstrip("#").strip() for h in lines if h[:1] == "#"}:
            wrong.append(f"{page} § {heading}")
    assert not wrong, f"benchmarks/README.md names sections its pages lack: {wrong}"
    intro = (DOCS / "measurements.md").read_text().split("\n## ", 1)[0]
    assert "](../benchmarks/README.md)" in intro


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


def _layout_segments() -> list[tuple[str, str, str]]:
    """docs/design.md's layout block cut where each name stands: (folder,
    kind, text), kind "folder" (a package's own lines: what it holds),
    "file" (a module's line and its description) or "note" (a line of prose
    at a name's indent, as "SHARED by ..."). A name stands at its depth's
    indent (2 spaces a level under probing/); the lines indented deeper
    continue the segment above. Folders are "node/bpf", "" is probing/."""
    text = (DOCS / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```")[1]
    block = block.split("probing/\n", 1)[1]
    segments: list[tuple[str, str, str]] = []
    stack: list[str] = []  # the folders open at each depth
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        token = line.split()[0] if line.strip() else ""
        if indent == 0:
            break  # bpf/, tests/: out of probing/
        at_a_name = indent % 2 == 0 and indent <= 2 * (len(stack) + 1)
        if at_a_name and token.endswith("/"):
            stack = stack[: indent // 2 - 1] + [token.rstrip("/")]
            segments.append(("/".join(stack), "folder", line))
        elif at_a_name and token.endswith(".py"):
            stack = stack[: indent // 2 - 1]
            segments.append(("/".join(stack), "file", line))
        elif at_a_name or not segments:
            segments.append(("/".join(stack), "note", line))
        else:
            folder, kind, seen = segments[-1]
            segments[-1] = (folder, kind, seen + "\n" + line)
    return segments


def _layout_entries() -> dict[str, str]:
    """Each folder's lines in the layout, its modules' and notes' with them:
    "node/bpf" -> its lines, "" -> the lines of probing/'s own files."""
    entries: dict[str, str] = {"": ""}
    for folder, _kind, text in _layout_segments():
        entries[folder] = entries.get(folder, "") + text + "\n"
    return entries


def _names_listed(text: str) -> list[str]:
    """The modules a folder's lines list: what follows the folder's name (and
    a label ending in ":"), with `code` and (asides) dropped, cut at ",", ";",
    "+", " with " and " over "; the items of one lowercase word are names,
    longer ones prose ("a probe per process its guests hand it")."""
    rest = text.strip().split(None, 1)[1:]
    text = re.sub(r"`[^`]*`", "", rest[0] if rest else "")
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    text = text.split(":", 1)[-1]
    items = (item.strip() for item in re.split(r"[,;+]| with | over ", text))
    return [item for item in items if re.fullmatch(r"[a-z_][a-z0-9_]*", item)]


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
    assert not missing, f"name each in docs/design.md's layout: {sorted(set(missing))}"


def test_the_design_layout_names_only_folders_and_modules_that_exist() -> None:
    """The other way round: each folder and module file the layout names is
    in the tree, and so is each module a folder's lines list; a module
    removed or renamed leaves no name behind it."""
    pkg = Path(__file__).resolve().parent.parent / "probing"
    stale = []
    for folder, kind, text in _layout_segments():
        here = pkg / folder
        if kind == "folder" and not (here / "__init__.py").exists():
            stale.append(f"{folder}/")
        elif kind == "folder":
            stale += [
                f"{folder}/{name}"
                for name in _names_listed(text)
                if not (here / f"{name}.py").exists() and not (here / name).is_dir()
            ]
        elif kind == "file" and not (here / text.split()[0]).exists():
            stale.append(f"{folder}/{text.split()[0]}".lstrip("/"))
    assert not stale, f"docs/design.md's layout names what the tree lacks: {stale}"


def _resolves(name: str) -> bool:
    """A dotted name is a module of probing, or an attribute of one."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def test_the_design_prose_names_only_code_that_exists() -> None:
    """Paths in docs/design.md (`cluster/port.py`, `probing/node/store/`)
    are files of the repository, from its root or inside probing/; dotted
    names (`probing.node.probe.context.ProbeContext`) are modules or their
    attributes, but for the SQL tables of the `probing` schema (sql.md)."""
    root = DOCS.parent
    text = (DOCS / "design.md").read_text()
    modules = [p.relative_to(root).as_posix() for p in (root / "probing").rglob("*.py")]
    paths = set(re.findall(r"(?<![\w/.-])((?:\w+/)+\w+\.py|probing/(?:\w+/)*)", text))
    assert {"node/detector/watch.py", "probing/node/store/"} <= paths
    inside = [p for p in paths if any(m.endswith(f"/{p}") for m in modules)]
    missing = [p for p in paths if not (root / p).exists() and p not in inside]
    tables = set(re.findall(r"`(probing\.\w+)`", (DOCS / "sql.md").read_text()))
    dotted = set(re.findall(r"\bprobing(?:\.\w+)+", text)) - tables - {"probing.pth"}
    assert "probing.node.probe.context.ProbeContext" in dotted
    missing += [name for name in dotted if not _resolves(name)]
    assert not missing, f"docs/design.md names what the tree lacks: {sorted(missing)}"


def test_the_design_layers_table_is_the_processes_contract() -> None:
    """docs/design.md's table of layers names the modules of the processes
    contract, no more and no fewer; a package's (list) is its own contract's
    layers where it has one, else modules it holds."""
    import tomllib

    config = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())
    contracts = {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}

    def layered(contract: str) -> set[str]:
        layers = ":".join(contracts[contract]["layers"])
        return {m.strip(" ()") for m in layers.split(":")}

    text = (DOCS / "design.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in text.splitlines() if line.lstrip().startswith("| ")]
    named: set[str] = set()
    for row in rows[1:]:  # the header out
        for name, listed in re.findall(r"`(\w+)`(?: \(([^)]*)\))?", row):
            named.add(name)
            pkg = DOCS.parent / "probing" / name
            if not pkg.is_dir() or not listed:
                continue
            items = {item.strip() for item in listed.split(",")}
            if name in contracts:
                assert items == layered(name), f"{name}: {items ^ layered(name)}"
            else:
                assert all((pkg / f"{i}.py").exists() or (pkg / i).is_dir() for i in items)
    assert named == layered("processes"), f"the table and pyproject: {named ^ layered('processes')}"


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
