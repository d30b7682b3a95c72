"""The wheel: built from the checkout, installed into a fresh venv under the
distribution's name (``probing-trace``: PyPI's ``probing`` is another
project), it is a working ``probing`` with every file it reads at run time
(the BPF programs, the injection library's source, the UI, the SQL
reference, the ``PROBING=1`` hook). Nothing says ``pip install probing``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO

DIST = "probing-trace"
# what the installed package must carry besides its modules, under site-packages
DATA = [
    "probing/node/bpf/programs/gloo.bpf.c",
    "probing/node/bpf/programs/nccl.bpf.c",
    "probing/node/bpf/programs/common.h",
    "probing/inject/boot.c",
    "probing/cli/ui/static/index.html",
    "probing/cli/mcp/sql.md",
    "probing.pth",
]
# where installing is said: the docs, the deploy recipes, the code's hints
KUBE = "deploy/kubernetes/probing-agent.yaml"
SAID_IN = ["README.md", "docs", "deploy", "probing", "vagrant", ".ci", "Makefile"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # the build backend from this venv when it has it (no index needed), else
    # pip's own isolated build, which fetches it from pip's configured index
    offline = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", str(out),
         str(REPO)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    [whl] = out.glob("*.whl")
    return whl


def test_the_distribution_is_named_probing_trace_and_its_wheel_so() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["scripts"] == {"probing": "probing.__main__:main"}


def test_a_wheel_installs_into_a_fresh_venv_and_runs(wheel: Path, tmp_path: Path) -> None:
    assert wheel.name.startswith("probing_trace-")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # its dependencies (and BCC, linked in by make setup) from this venv, after its own
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for rel in DATA:
        assert (site / rel).is_file(), f"the wheel lacks {rel}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBING")}
    run = {"capture_output": True, "text": True, "timeout": 60, "env": env, "cwd": tmp_path}
    r = subprocess.run([env_dir / "bin" / "probing", "--version"], **run)  # type: ignore[call-overload]
    assert r.returncode == 0 and r.stdout.strip() == "probing 0.1.0", r.stdout + r.stderr
    where = (
        "import importlib.metadata as m, probing; from probing.node.bpf import loader\n"
        f"print(m.version({DIST!r}), probing.__version__, probing.__file__)\n"
        "with loader.program_dir() as d: print(sorted(os.listdir(d)))\n"
    )
    r = subprocess.run([python, "-c", "import os\n" + where], **run)  # type: ignore[call-overload]
    assert r.returncode == 0, r.stderr
    first, programs = r.stdout.splitlines()
    version, ours, path = first.split()
    assert version == ours == "0.1.0" and path.startswith(str(site))  # not the checkout's
    assert "gloo.bpf.c" in programs and "sampler.bpf.c" in programs
    r = subprocess.run([env_dir / "bin" / "probing", "doctor"], **run)  # type: ignore[call-overload]
    assert re.search(r"^(OK|WARN|FAIL) +bcc ", r.stdout, re.M), r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_nothing_says_pip_install_probing() -> None:
    wrong = re.compile(r"pip install\s+['\"]?probing(?![-\w])")
    found = []
    for top in SAID_IN:
        root = REPO / top
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".png", ".pyc", ".so"):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if wrong.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_daemonset_runs_the_image_the_recipe_builds() -> None:
    import yaml

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / KUBE).read_text()) if d}
    [agent] = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == f"localhost/probing-agent:{version}"
    build = (REPO / "deploy/container/build.sh").read_text()
    assert "localhost/probing-agent:$version" in build and "mmdebstrap" in build
    recipe = (REPO / "deploy/container/Containerfile").read_text()
    assert re.search(r"^FROM scratch$", recipe, re.M)  # nothing pulled from a registry
    assert re.search(r"^ADD rootfs.tar /$", recipe, re.M)
