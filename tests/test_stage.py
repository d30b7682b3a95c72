"""``probing.inject.stage``: what a target in another mount namespace loads,
staged in its runtime directory once per contents, never writable by
others, old stages gone once no process maps them; the engine's
environment; a guest told not to start the engine never does. The whole
path (an agent in a mount namespace of its own) is
tests/privileged/test_agent_mntns.py."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from probing.errors import AttachError
from probing.guest import wire
from probing.guest.life import Guest
from probing.inject import stage
from probing.inject.injector import guest_dir


def _target(root: Path) -> stage.Elsewhere:
    """This process as the target, its runtime root ``root`` (seen through /proc/self/root)."""
    return stage.Elsewhere(os.getpid(), os.getuid(), os.getgid(), str(root))


def _lib(tmp_path: Path, body: bytes = b"\x7fELF one") -> str:
    lib = tmp_path / "built" / "libprobing_boot-0123456789ab.so"
    lib.parent.mkdir(exist_ok=True)
    lib.write_bytes(body)
    return str(lib)


def test_a_target_in_our_own_mount_namespace_needs_no_stage() -> None:
    assert stage.elsewhere(os.getpid(), os.getuid(), {}) is None


def test_the_stage_holds_the_library_and_the_guest_once_per_contents(tmp_path: Path) -> None:
    root = tmp_path / "rt"
    root.mkdir()
    lib = _lib(tmp_path)
    got = stage.stage(_target(root), lib, guest_dir())
    [made] = root.glob("probing-stage-*")
    assert got.lib == str(made / os.path.basename(lib))
    assert got.lib_here == f"/proc/{os.getpid()}/root{got.lib}"
    assert got.guest == str(made / "guest")
    assert Path(got.lib).read_bytes() == Path(lib).read_bytes()
    assert sorted(p.name for p in Path(got.guest).iterdir()) == sorted(
        p.name for p in Path(guest_dir()).glob("*.py")
    )
    assert oct(made.stat().st_mode & 0o777) == "0o755"
    assert oct(Path(got.lib).stat().st_mode & 0o777) == "0o755"
    assert oct((made / "guest" / "life.py").stat().st_mode & 0o777) == "0o644"
    # the same contents: the same stage, not written again
    before = made.stat().st_mtime_ns
    assert stage.stage(_target(root), lib, guest_dir()) == got
    assert made.stat().st_mtime_ns == before
    assert [p.name for p in root.iterdir()] == [made.name]  # no staging leftovers


def test_a_new_stage_removes_the_old_ones_no_process_maps(tmp_path: Path) -> None:
    root = tmp_path / "rt"
    root.mkdir()
    first = stage.stage(_target(root), _lib(tmp_path, b"one"), guest_dir())
    with open(first.lib, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        second = stage.stage(_target(root), _lib(tmp_path, b"two"), guest_dir())
        assert os.path.exists(first.lib)  # mapped by this process: kept
    third = stage.stage(_target(root), _lib(tmp_path, b"three"), guest_dir())
    assert sorted(root.iterdir()) == [Path(third.lib).parent]
    assert not os.path.exists(second.lib) and not os.path.exists(first.lib)


def test_a_stage_others_could_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "rt"
    root.mkdir()
    lib = _lib(tmp_path)
    key = stage.key_of(stage._files(lib, guest_dir()))
    planted = root / f"probing-stage-{key}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(AttachError, match="others cannot write") as err:
        stage.stage(_target(root), lib, guest_dir())
    assert "remove" in str(err.value)
    planted.rmdir()
    planted.symlink_to(tmp_path)  # a link is never followed
    with pytest.raises(AttachError, match="others cannot write"):
        stage.stage(_target(root), lib, guest_dir())


def test_a_runtime_directory_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    class Unshared(stage.Elsewhere):
        def here(self, path: str) -> str:
            return str(tmp_path / "theirs") + path

    (tmp_path / "rt").mkdir()
    Path(f"{tmp_path}/theirs{tmp_path}/rt").mkdir(parents=True)  # another directory
    target = Unshared(os.getpid(), 0, 0, str(tmp_path / "rt"))
    with pytest.raises(AttachError, match="is not this one's") as err:
        stage.shared_root(target)
    assert "-v /tmp:/tmp" in str(err.value)


def test_the_engine_gets_the_targets_settings_and_our_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in stage.KEEP_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/opt/probing/bin:/usr/bin")
    monkeypatch.setenv("PROBING_AGENT_PORT", "9978")
    env = stage.engine_env(
        {"PATH": "/job/bin", "PROBING_RUNTIME_DIR": "/tmp/x", "PROBING": "1", "RANK": "3"}
    )
    assert env == {
        "PATH": "/opt/probing/bin:/usr/bin",
        "MALLOC_ARENA_MAX": "2",
        "MIMALLOC_PURGE_DELAY": "0",
        "MIMALLOC_ARENA_EAGER_COMMIT": "0",
        "PROBING_RUNTIME_DIR": "/tmp/x",
    }


def test_the_guests_engine_lets_its_allocators_give_back_what_they_freed() -> None:
    """The engine a guest starts runs with the allocator settings the
    injector's does (``place.ENGINE_ALLOCATOR``), unless the job names its
    own in ``PROBING_ENGINE_ENV``."""
    from probing.guest import place

    env = Guest("/usr/bin/python3", {"PATH": "/bin"}, spawn=False)._engine_env()
    assert {k: env[k] for k in place.ENGINE_ALLOCATOR} == place.ENGINE_ALLOCATOR
    mine = {"PROBING_ENGINE_ENV": "MIMALLOC_PURGE_DELAY", "MIMALLOC_PURGE_DELAY": "10"}
    env = Guest("/usr/bin/python3", mine, spawn=False)._engine_env()
    assert env["MIMALLOC_PURGE_DELAY"] == "10" and env["MALLOC_ARENA_MAX"] == "2"


def test_a_guest_told_not_to_start_the_engine_waits_for_it(tmp_path: Path) -> None:
    guest = Guest("/image/only/python", {"PROBING_RUNTIME_DIR": str(tmp_path)}, spawn=False)
    with pytest.raises(wire.WireError):  # never FileNotFoundError: it ran nothing
        guest.register(timeout=0.2)
    assert not list(tmp_path.rglob("engine-*.start"))
