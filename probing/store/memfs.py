"""An in-memory pyarrow filesystem holding sealed chunks as Parquet buffers.

DataFusion scans a ``pyarrow.dataset`` built over these "files", so a query
gets column projection and row-group pruning (min/max statistics on ``ts``)
for free, and decodes only what it reads.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.fs as pafs


class MemoryFS(pafs.FileSystemHandler):
    """A flat, thread-safe path -> buffer map. Read-only to pyarrow."""

    def __init__(self) -> None:
        self._files: dict[str, pa.Buffer] = {}
        self._lock = threading.Lock()

    # -- used by the store -------------------------------------------------
    def put(self, path: str, buf: pa.Buffer) -> None:
        with self._lock:
            self._files[path] = buf

    def remove(self, path: str) -> None:
        with self._lock:
            self._files.pop(path, None)

    def reinit_after_fork(self) -> None:
        self._lock = threading.Lock()

    # -- pyarrow FileSystemHandler ------------------------------------------
    def get_type_name(self) -> str:
        return "probing-mem"

    def normalize_path(self, path: str) -> str:
        return path

    def _info(self, path: str) -> pafs.FileInfo:
        buf = self._files.get(path)
        if buf is None:
            return pafs.FileInfo(path, pafs.FileType.NotFound)
        return pafs.FileInfo(path, pafs.FileType.File, size=buf.size)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return [self._info(p) for p in paths]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        prefix = selector.base_dir.rstrip("/") + "/"
        with self._lock:
            names = [p for p in self._files if p.startswith(prefix)]
        return [self._info(p) for p in names]

    def _open(self, path: str) -> pa.BufferReader:
        buf = self._files.get(path)
        if buf is None:
            # A chunk retired between planning and scanning.
            raise FileNotFoundError(f"chunk {path} was retired while the query ran")
        return pa.BufferReader(buf)

    def open_input_file(self, path: str) -> pa.BufferReader:
        return self._open(path)

    def open_input_stream(self, path: str) -> pa.BufferReader:
        return self._open(path)

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise OSError("probing's chunk store is read-only to queries")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only

    def __eq__(self, other: object) -> bool:
        return other is self

    def __ne__(self, other: object) -> bool:
        return other is not self

    def __hash__(self) -> int:
        return id(self)
