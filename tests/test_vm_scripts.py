"""vagrant/: the scripts behind `make vm-test` and the Vagrantfile, checked
without booting anything (the VM itself runs in `make vm-test`, docs/vm.md)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VAGRANT = REPO / "vagrant"
SCRIPTS = ("provision.sh", "vm-test.sh", "vm-init.sh", "run-tests.sh")


def _bash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name: str) -> None:
    r = _bash("-n", str(VAGRANT / name))
    assert r.returncode == 0, r.stderr


def _array(script: str, name: str) -> list[str]:
    text = (VAGRANT / script).read_text()
    m = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.M | re.S)
    assert m, f"no {name}=( ... ) in {script}"
    return m.group(1).split()


@pytest.mark.parametrize("array", ["smoke", "diagnose", "host_only"])
def test_the_tests_the_vm_names_exist(array: str) -> None:
    """A renamed test must not silently drop out of the VM's selection."""
    ids = _array("run-tests.sh", array)
    assert ids
    for node in ids:
        path, _, func = node.partition("::")
        assert (REPO / path).is_file(), node
        if func:
            names = {
                n.name
                for n in ast.walk(ast.parse((REPO / path).read_text()))
                if isinstance(n, ast.FunctionDef)
            }
            assert func in names, f"{node}: no such test"


def test_one_recipe_for_make_vm_test_and_vagrant() -> None:
    vagrantfile = (VAGRANT / "Vagrantfile").read_text()
    assert 'config.vm.box = "debian/trixie64"' in vagrantfile
    assert 'provider "libvirt"' in vagrantfile and 'provider "virtualbox"' in vagrantfile
    assert 'provision "shell", inline: "bash /probing/vagrant/provision.sh"' in vagrantfile
    vm_test = (VAGRANT / "vm-test.sh").read_text()
    assert "vagrant/provision.sh' /root/provision.sh" in vm_test
    assert re.search(r"chroot .* bash /root/provision.sh", vm_test)
    # both run the tests through run-tests.sh
    assert "vagrant/run-tests.sh" in (VAGRANT / "vm-init.sh").read_text()
    assert "/probing/vagrant/run-tests.sh" in vagrantfile


def _image_path(repo: Path, cache: Path) -> str:
    r = _bash(
        str(repo / "vagrant" / "vm-test.sh"),
        "--image-path",
        env={**os.environ, "PROBING_VM_CACHE": str(cache)},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_image_key_follows_the_recipe_and_dependencies_only(tmp_path: Path) -> None:
    """Idempotent and cheap: editing probing's code or version reuses the
    cached image; a changed dependency or recipe builds a new one."""
    copy = tmp_path / "repo"
    (copy / "vagrant").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(VAGRANT / name, copy / "vagrant" / name)
    pyproject = (REPO / "pyproject.toml").read_text()
    (copy / "pyproject.toml").write_text(pyproject)
    cache = tmp_path / "cache"
    first = _image_path(copy, cache)
    assert first.startswith(f"{cache}/trixie-")
    assert _image_path(copy, cache) == first

    (copy / "pyproject.toml").write_text(pyproject.replace('version = "', 'version = "9', 1))
    (copy / "vagrant" / "run-tests.sh").write_text("# edited\n")
    assert _image_path(copy, cache) == first

    (copy / "pyproject.toml").write_text(
        pyproject.replace('"psutil>=5.9",', '"psutil>=5.9",\n  "six",', 1)
    )
    with_dep = _image_path(copy, cache)
    assert with_dep != first

    recipe = copy / "vagrant" / "provision.sh"
    recipe.write_text(recipe.read_text() + "\n# changed\n")
    assert _image_path(copy, cache) not in (first, with_dep)


def test_bad_arguments_say_what_to_do(tmp_path: Path) -> None:
    r = _bash(str(VAGRANT / "vm-test.sh"), "tests/a b")
    assert r.returncode == 2
    assert r.stderr.endswith("\n") and "separate words" in r.stderr

    r = _bash(str(VAGRANT / "provision.sh"), "--bogus")
    assert r.returncode == 2
    assert r.stderr.endswith("\n") and "--pyproject PATH" in r.stderr

    r = _bash(str(VAGRANT / "provision.sh"), "--pyproject", str(tmp_path / "none.toml"))
    assert r.returncode == 1
    assert r.stderr.endswith("\n") and "pass --pyproject PATH" in r.stderr

    r = _bash(
        str(VAGRANT / "run-tests.sh"),
        env={**os.environ, "PROBING_VENV": str(tmp_path / "no-venv")},
    )
    assert r.returncode == 2
    assert r.stderr.endswith("\n") and "run vagrant/provision.sh first" in r.stderr


def test_help_names_the_subsets() -> None:
    r = _bash(str(VAGRANT / "vm-test.sh"), "--help")
    assert r.returncode == 0
    assert "paths|smoke|full" in r.stdout and "PROBING_VM_CACHE" in r.stdout


def test_the_vagrantfile_validates(tmp_path: Path) -> None:
    """Vagrant itself reads the Vagrantfile (its providers, box and
    provisioner), without a box or a hypervisor."""
    vagrant = shutil.which("vagrant")
    if vagrant is None:
        pytest.skip("no vagrant here (.ci/setup.sh installs it where the archive has it)")
    # a throw-away VAGRANT_HOME and working copy: nothing lands in the checkout
    work = tmp_path / "vagrant"
    shutil.copytree(VAGRANT, work, ignore=shutil.ignore_patterns(".vagrant"))
    env = {**os.environ, "VAGRANT_HOME": str(tmp_path / "home"), "VAGRANT_CHECKPOINT_DISABLE": "1"}

    def validate() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [vagrant, "validate", "--ignore-provider"],
            cwd=work, capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip

    r = validate()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Vagrantfile validated successfully" in r.stdout
    # a broken Vagrantfile is caught, so the check above means something
    (work / "Vagrantfile").write_text((work / "Vagrantfile").read_text().replace("end\n", "", 1))
    assert validate().returncode != 0
