"""One writer per workdir: a lock file held for a run's whole life (``W/.lock``).

``pipeline.run`` takes it (:func:`hold`) before it writes anything and gives it back when the run
ends, however it ends; a read-only invocation (``status``) takes none. The file is a JSON object
naming its holder: ``host``, ``pid``, ``started`` (UTC, ISO 8601) and ``workdir``.

* Taking it: the file is created with ``O_CREAT | O_EXCL`` (one atomic step of the file system,
  so of two runs started together exactly one gets it).
* Held by another run: a ``RuntimeError`` naming the holder (host, pid, start time) and the file.
* Stale (the holder's host is this host and its pid is gone, e.g. a killed run): taken over, with
  a log line naming the old holder.
* Held by a run on another host: refused as held (this host cannot tell whether it is alive);
  the message says to delete the file once that run is known to be gone.
* Multi-process runs: process 0, the writer (``files.is_writer``), holds it; the others take none.
* ``gs://`` workdirs: the same object, created with a generation precondition
  (``if_generation_match=0``: only if absent) through google-cloud-storage, and deleted only at
  the generation this run wrote (:class:`_GcsLockFile`).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
from typing import Any, Iterator

from absl import logging

from behaviortrace_jax.io import files
from behaviortrace_jax.io.layout import RunLayout, is_url

LOCK_NAME = RunLayout(".").lock.name  # ".lock"


def holder_info(workdir: str | os.PathLike) -> dict[str, Any]:
    """This process as a lock holder: ``{"host", "pid", "started", "workdir"}``."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "workdir": str(workdir)}


def describe(holder: dict[str, Any]) -> str:
    """``"pid P on host H since T"`` for a lock file's contents."""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (``kill(pid, 0)``; a process of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _LocalLockFile:
    """The lock as a local file (``O_CREAT | O_EXCL``)."""

    def __init__(self, path: str):
        self.path = path

    def create(self, text: str) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as e:
            if e.errno == errno.EEXIST:
                return False
            raise
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True

    def read(self) -> str | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def remove(self, expected: str | None) -> None:
        """Removes the file if it still holds ``expected`` (None: whatever it holds)."""
        if expected is None or self.read() == expected:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class _GcsLockFile:
    """The lock as a ``gs://`` object, created only if absent and deleted only at its generation."""

    def __init__(self, url: str):
        from google.cloud import storage

        bucket, _, name = url[len("gs://"):].partition("/")
        self.url, self.generation = url, None
        self.blob = storage.Client().bucket(bucket).blob(name)

    def create(self, text: str) -> bool:
        from google.api_core import exceptions

        try:
            self.blob.upload_from_string(text, content_type="application/json", if_generation_match=0)
        except exceptions.PreconditionFailed:
            return False
        self.generation = self.blob.generation
        return True

    def read(self) -> str | None:
        from google.api_core import exceptions

        try:
            self.blob.reload()
            self.generation = self.blob.generation
            return self.blob.download_as_text(if_generation_match=self.generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None

    def remove(self, expected: str | None) -> None:
        """Deletes the object if it still holds ``expected`` (None: whatever it holds), at the
        generation read (a lock taken by another run in between is left alone)."""
        from google.api_core import exceptions

        text = self.read()
        if text is None or (expected is not None and text != expected):
            return
        with contextlib.suppress(exceptions.NotFound, exceptions.PreconditionFailed):
            self.blob.delete(if_generation_match=self.generation)


def _lock_file(workdir: str) -> _LocalLockFile | _GcsLockFile:
    path = str(RunLayout(workdir).lock)
    return _GcsLockFile(path) if is_url(path) else _LocalLockFile(path)


def acquire(workdir: str | os.PathLike) -> str:
    """Takes ``workdir``'s lock (module docstring); returns the text written (for :func:`release`).

    Raises:
        RuntimeError: the lock is held by a live run (or one on another host), naming it and the file.
    """
    workdir = str(workdir)
    lock = _lock_file(workdir)
    text = json.dumps(holder_info(workdir), sort_keys=True)
    for _ in range(3):  # a stale lock removed by another taker in between: try again
        if lock.create(text):
            return text
        old_text = lock.read()
        if old_text is None:
            continue
        try:
            old = json.loads(old_text)
            if not isinstance(old, dict):
                raise ValueError(old_text)
        except ValueError:
            old = {}
        same_host = old.get("host") == socket.gethostname()
        if same_host and isinstance(old.get("pid"), int) and not pid_alive(old["pid"]):
            logging.warning("%s/%s: the run that held it (%s) is gone; taking the lock over", workdir, LOCK_NAME,
                            describe(old))
            lock.remove(old_text)
            continue
        where = "" if same_host or not old else " (another host: delete the file once that run is known to be gone)"
        raise RuntimeError(f"{workdir} is being written by another run: {describe(old)}{where}; lock file "
                           f"{workdir}/{LOCK_NAME}. Wait for it to end, or use another --workdir")
    raise RuntimeError(f"{workdir}/{LOCK_NAME}: could not take the lock (it kept changing hands)")


def release(workdir: str | os.PathLike, text: str) -> None:
    """Gives ``workdir``'s lock back if it still holds ``text`` (this run's :func:`acquire`)."""
    _lock_file(str(workdir)).remove(text)


@contextlib.contextmanager
def hold(workdir: str | os.PathLike) -> Iterator[None]:
    """Holds ``workdir``'s lock for the body (the writer process only; module docstring)."""
    if not files.is_writer():
        yield
        return
    text = acquire(workdir)
    try:
        yield
    finally:
        release(workdir, text)
