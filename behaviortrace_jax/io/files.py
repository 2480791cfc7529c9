"""Small file helpers every stage shares: atomic writes, JSON files, checked JSONL reading.

Every path is ``layout.as_path``'s ``etils.epath.Path``, local or ``gs://`` (remote workdirs); the
modules outside ``io/`` make no file-system calls of their own (no builtin ``open``, ``os.replace``,
``shutil``, ``pathlib.Path(...)``; tests/io/test_remote_paths.py checks this). How a write is made
atomic depends on where it goes, and is chosen here, once per write (:func:`write_strategy`,
:func:`dir_strategy`):

* local file: ``path.tmp`` + fsync + ``os.replace`` (+ fsync of the folder), so a killed run leaves
  either the old file or the new one, never a torn one (runs resume from them);
* object store (``gs://``): one direct object write. A single object upload is atomic on GCS (a
  reader sees the old object or the new one, never a part), so there is no ``.tmp`` to rename (an
  object store has no rename: it would be a copy plus a delete, and no more atomic).

* :func:`atomic_write_text` / :func:`write_json`: one file, atomically as above.
* :func:`atomic_write_dir`: a whole directory (an HF checkpoint, a tokenizer) filled in a temporary
  sibling and renamed into place, replacing any older one (object stores: filled locally, uploaded
  file by file; see :func:`_upload_dir`).
* :func:`copy_file` / :func:`copy_tree` / :func:`remove_file` / :func:`remove_tree`: by the writer.
* :func:`local_dir`: a directory as local files for libraries that only read local files
  (safetensors memory maps, ``AutoTokenizer``): itself when local, a downloaded copy for a URL.
* :func:`read_json`: a JSON file, or a default when it does not exist yet.
* :func:`resolve_path` / :func:`sha256_file`: a user's path made absolute (``~`` expanded); a
  file's digest.
* :func:`iter_jsonl`: the objects of a JSONL file with their line numbers; every error names
  ``file:line``. The readers of probes, the corpus, ground-truth logs and rollout shards build
  their own checks (keys, types, duplicates) on top of it.
* One writer per artefact (multi-process runs, docs/architecture.md "Multi-process runs"):
  :func:`configure_writer` (set by ``runtime.start_distributed``) makes process 0 the only writer.
  Every mutation of the workdir goes through :func:`mutation` (the writers here use it, as do
  :func:`remove_tree` / :func:`remove_file`): a barrier, the change on the writer only, a barrier,
  so every process sees the same files between two mutations and takes the same branches. In a
  single process the barriers are no-ops and nothing changes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from etils import epath

from behaviortrace_jax.io.layout import as_path, is_url

_MISSING = object()
_WRITER: dict[str, Any] = {"is_writer": True, "barrier": None}


def configure_writer(is_writer: bool, barrier: Callable[[str], None] | None = None) -> None:
    """Makes this process the run's writer (``is_writer``) or not, with ``barrier(name)`` waiting for
    every process (None: no barrier, the single-process default)."""
    _WRITER.update(is_writer=bool(is_writer), barrier=barrier)


def is_writer() -> bool:
    """Whether this process writes the run's files (always True in a single process)."""
    return _WRITER["is_writer"]


def sync(name: str) -> None:
    """Waits for every process of a multi-process run (no-op in a single process)."""
    if _WRITER["barrier"] is not None:
        _WRITER["barrier"](name)


@contextlib.contextmanager
def mutation(name: str) -> Iterator[bool]:
    """``with mutation("write x") as write: if write: ...``: a change to the workdir made by the
    writer process only, between two barriers (so no process reads a half-made change, and every
    process sees the same files before and after). Every process must enter it, in the same order."""
    sync("before " + name)
    try:
        yield is_writer()
    finally:
        sync("after " + name)


def write_text_now(path: str | os.PathLike, text: str | bytes) -> None:
    """:func:`atomic_write_text` on this process, now, without barriers: only inside the body of a
    :func:`mutation` (whose barriers already surround it) or for process-private files."""
    _atomic_write_text(as_path(path), text)


def remove_tree(path: str | os.PathLike) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` by the writer (see :func:`mutation`)."""
    with mutation(f"rmtree {path}") as write:
        if write:
            p = as_path(path)
            if not is_url(p):
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.rmtree()


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``shutil.copyfile(src, dst)`` by the writer (see :func:`mutation`)."""
    with mutation(f"copy {dst}") as write:
        if write:
            src, dst = as_path(src), as_path(dst)
            if not is_url(src) and not is_url(dst):
                shutil.copyfile(src, dst)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(src.read_bytes())


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``shutil.copytree(src, dst, dirs_exist_ok=True)`` by the writer (see :func:`mutation`), for
    local paths and URLs alike (a URL's files are copied one object at a time)."""
    with mutation(f"copytree {dst}") as write:
        if write:
            src, dst = as_path(src), as_path(dst)
            if not is_url(src) and not is_url(dst):
                shutil.copytree(src, dst, dirs_exist_ok=True)
                return
            for rel, f in _files_under(src):
                out = dst / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(f.read_bytes())


def _files_under(root: epath.Path, rel: str = "") -> Iterator[tuple[str, epath.Path]]:
    """``(path relative to root, path)`` of every file under ``root``, in sorted order, by
    ``iterdir``: epath's ``walk`` on ``gs://`` yields folders without their scheme (``bucket/key``,
    which epath then takes for a local path), and it has no recursive glob on GCS."""
    for p in sorted(root.iterdir(), key=lambda x: x.name):
        if p.is_dir():
            yield from _files_under(p, f"{rel}{p.name}/")
        else:
            yield rel + p.name, p


def remove_file(path: str | os.PathLike) -> None:
    """``unlink(missing_ok=True)`` by the writer (see :func:`mutation`)."""
    with mutation(f"unlink {path}") as write:
        if write:
            as_path(path).unlink(missing_ok=True)


def resolve_path(path: str | os.PathLike) -> str:
    """``path`` with ``~`` expanded, made absolute against the current directory.

    Every path a user gives (workdir, config keys ending in ``_dir`` / ``_path``) goes through this
    once, so relative paths work everywhere, including in libraries (orbax) that refuse them.
    ``""`` stays ``""`` (the configs' "use the default"); URLs such as ``gs://b/x`` are returned unchanged.
    """
    path = os.fspath(path)
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """The sha256 hex digest of a file's bytes, read in ``chunk_bytes`` pieces.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
    """
    h = hashlib.sha256()
    with as_path(path).open("rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: str | os.PathLike, text: str | bytes) -> None:
    """Writes ``text`` (str as UTF-8, or bytes) to ``path`` atomically (:func:`write_strategy`):
    locally ``path.tmp``, fsync, ``os.replace``, then fsync of the directory (best effort); on an
    object store one direct object write. Creates missing parent folders.
    In a multi-process run only the writer process writes (:func:`mutation`)."""
    with mutation(f"write {path}") as write:
        if write:
            _atomic_write_text(as_path(path), text)


def write_strategy(path: str | os.PathLike) -> Callable[[epath.Path, bytes], None]:
    """How a file write to ``path`` is made atomic: :func:`_write_replace` (``.tmp`` + fsync +
    ``os.replace``) for a local path, :func:`_write_object` (one direct object write, atomic by
    itself on GCS) for a URL such as ``gs://bucket/key``."""
    return _write_object if is_url(path) else _write_replace


def _atomic_write_text(path: epath.Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_strategy(path)(path, text.encode("utf-8") if isinstance(text, str) else text)


def _write_object(path: epath.Path, data: bytes) -> None:
    """A URL (gs://): one object upload, which the store makes atomic (no ``.tmp`` + rename)."""
    path.write_bytes(data)


def _write_replace(path: epath.Path, data: bytes) -> None:
    """A local file: ``path.tmp`` + fsync + ``os.replace`` + fsync of the folder (best effort)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_dir(out_dir: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Writes the directory ``out_dir`` atomically: ``fill(tmp)`` writes the files into a fresh
    ``<out_dir>.tmp-XXXX`` sibling; the files get the umask's normal modes (``mkdtemp`` and some
    writers create private ones) and are fsynced; then an existing ``out_dir`` is moved aside, the
    new one renamed into place and the old one deleted. Readers see the old directory or the new
    one, never a mix; an error in ``fill`` removes the temporary directory and re-raises.

    In a multi-process run only the writer process calls ``fill`` and writes (:func:`mutation`).

    Returns:
        ``out_dir`` as a Path.
    """
    out_dir = as_path(out_dir)
    with mutation(f"write dir {out_dir}") as write:
        if write:
            dir_strategy(out_dir)(out_dir, fill)
    return out_dir


def dir_strategy(out_dir: str | os.PathLike) -> Callable[[epath.Path, Callable[[Path], None]], None]:
    """How :func:`atomic_write_dir` writes ``out_dir``: :func:`_atomic_write_dir` (temporary sibling
    + rename) for a local path, :func:`_upload_dir` (fill locally, upload file by file) for a URL."""
    return _upload_dir if is_url(out_dir) else _atomic_write_dir


def local_dir(path: str | os.PathLike) -> epath.Path:
    """The directory ``path`` as local files, for libraries that read local files only (safetensors
    memory maps, ``transformers.AutoTokenizer``, ``os.path`` checks): ``path`` itself when local;
    for a URL, a copy of its files (not subfolders) in a per-process cache folder, downloaded again
    when the remote listing (names, sizes) changes. Read-only use: writes to the copy are lost.

    Raises:
        FileNotFoundError: naming ``path`` when a URL directory does not exist.
    """
    src = as_path(path)
    if not is_url(src):
        return src
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such directory")
    remote = sorted((f.name, f.stat().length) for f in src.iterdir() if f.is_file())
    key = hashlib.sha256(os.fspath(src).encode("utf-8")).hexdigest()[:16]
    local = as_path(tempfile.gettempdir()) / f"behaviortrace_jax-{os.getpid()}" / key
    listing = local / ".remote_listing.json"
    if listing.exists() and json.loads(listing.read_text()) == [list(r) for r in remote]:
        return local
    if local.exists():
        local.rmtree()
    local.mkdir(parents=True)
    for name, _ in remote:
        (local / name).write_bytes((src / name).read_bytes())
    listing.write_text(json.dumps(remote))
    return local


def _upload_dir(out_dir: epath.Path, fill: Callable[[Path], None]) -> None:
    """A URL (gs://) directory: ``fill`` writes into a local temporary directory, whose files are
    then copied up (an existing ``out_dir`` is removed first). Object stores have no directory
    rename, so a reader may see a partial directory while this runs; a rerun rewrites it."""
    with tempfile.TemporaryDirectory() as tmp:
        fill(Path(tmp))
        if out_dir.exists():
            out_dir.rmtree()
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(Path(tmp).iterdir()):
            (out_dir / f.name).write_bytes(f.read_bytes())


def _atomic_write_dir(out_dir: epath.Path, fill: Callable[[Path], None]) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        fill(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~umask)
        _fsync_dir(tmp)
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.rmdir(old)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False) -> None:
    """``obj`` as JSON (``indent``, ``sort_keys``, a trailing newline), written atomically.

    Raises:
        TypeError: when ``obj`` holds a value JSON cannot encode (nothing is written).
    """
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def read_json(path: str | os.PathLike, default: Any = _MISSING) -> Any:
    """The JSON value stored at ``path``; ``default`` when the file does not exist (if given).

    Raises:
        FileNotFoundError: no file and no ``default``.
        ValueError: naming ``path`` when the file is not valid JSON.
    """
    path = as_path(path)
    if not path.exists() and default is not _MISSING:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of the JSONL file ``path`` (1-based lines).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``"{path}:{line}: invalid JSON (...)"`` or ``"... expected a JSON object, got
            list"`` for a line that is not one JSON object.
    """
    with as_path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
