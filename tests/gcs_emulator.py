"""A real GCS HTTP server for the tests: ``gcp-storage-emulator`` (the ``test`` extra) in a subprocess.

:class:`GcsEmulator` starts it on a free local port, waits until it answers, creates a bucket and
gives the environment variables that point every library of a ``gs://`` workdir at it
(:meth:`GcsEmulator.env`; docs/architecture.md "Remote workdirs"):

* ``STORAGE_EMULATOR_HOST``: gcsfs (which etils' ``epath`` and so orbax use for ``gs://``) and
  google-cloud-storage (tensorboardX's ``gs://`` event files) send their requests there, anonymously;
* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs >= 2026.4 otherwise asks each bucket's type
  over gRPC + TLS, which the emulator does not serve, and waits 60 s per call before falling back;
  read at ``import gcsfs``;
* ``FSSPEC_GCS_TOKEN=anon``: no search for Google credentials (read at ``import fsspec``);
* ``TENSORSTORE_GCS_HTTP_URL`` (+ ``TENSORSTORE_GCS_HTTP_VERSION=1``, the emulator speaks HTTP/1.1):
  tensorstore's ``gcs`` kvstore; ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: a fixed bearer token, so
  tensorstore does not look for credentials (or a metadata server) either.

The emulator (2026.7.19) differs from GCS in ways that break tensorstore (so orbax's OCDBT
checkpoints and the sketch stores) and the workdir lock; run as a script (``python tests/gcs_emulator.py start ...``,
what :class:`GcsEmulator` does), this module serves it with these answered as GCS answers, nothing else changed:

* ``objects.list`` ignores ``startOffset`` / ``endOffset``. Tensorstore deletes a key range
  (``delete_existing=True``, which ``SketchStore`` uses to create a store) by listing
  ``[prefix, prefix+1)`` and deleting what comes back: on the bare emulator, creating one store
  deleted every object in the bucket. Fixed: items and prefixes filtered (start inclusive, end exclusive).
* uploads and deletes ignore ``ifGenerationMatch``. Fixed for an upload with ``ifGenerationMatch=0``
  (create only if absent) and for a delete: 412 when the precondition does not hold, as on GCS
  (the workdir lock, ``io/workdir_lock.py``).
* a download (``alt=media``) has no ``x-goog-generation`` header. Tensorstore reads an object's
  generation from it and makes conditional writes with it (``ifGenerationMatch``): orbax's OCDBT
  manifest update failed with "Malformed StorageGeneration". Fixed: the header (and
  ``x-goog-metageneration``) sent from the object's metadata.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.error
import urllib.request
from http import HTTPStatus


def _filtered_ls(ls):
    """``objects.ls`` of the emulator with ``startOffset``/``endOffset`` applied to items and prefixes."""

    def handler(request, response, storage, *args, **kwargs):
        start = (request.query.get("startOffset") or [None])[0]
        end = (request.query.get("endOffset") or [None])[0]
        if start is None and end is None:
            return ls(request, response, storage, *args, **kwargs)
        keep = lambda name: (start is None or name >= start) and (end is None or name < end)  # noqa: E731
        write_json = response.json

        def json_filtered(obj):
            obj["items"] = [o for o in obj.get("items") or [] if keep(o["name"])]
            obj["prefixes"] = [p for p in obj.get("prefixes") or [] if keep(p)]
            write_json(obj)

        response.json = json_filtered
        return ls(request, response, storage, *args, **kwargs)

    return handler


def _download_with_generation(download):
    """``objects.download`` of the emulator, answering with the object's ``x-goog-generation`` and
    ``x-goog-metageneration`` headers as GCS does."""

    def handler(request, response, storage, *args, **kwargs):
        out = download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
        return out

    return handler


def _precondition_failed(response) -> None:
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified did not hold.",
                             "errors": [{"reason": "conditionNotMet", "domain": "global",
                                         "message": "At least one of the pre-conditions you specified did not hold."}]}})


def _generation_now(storage, bucket: str, name: str) -> str | None:
    """The object's generation, or None when there is none."""
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def _insert_if_generation_match(insert):
    """``objects.insert`` of the emulator, refusing ``ifGenerationMatch=0`` (create only if absent:
    the workdir lock, io/workdir_lock.py) with 412 when the object exists, as GCS does."""

    def handler(request, response, storage, *args, **kwargs):
        want = (request.query.get("ifGenerationMatch") or [None])[0]
        if want == "0":
            name = (request.query.get("name") or [None])[0]
            if name is None and isinstance(request.data, dict):
                name = (request.data.get("meta") or {}).get("name")
            if name is not None and _generation_now(storage, request.params["bucket_name"], name) is not None:
                return _precondition_failed(response)
        return insert(request, response, storage, *args, **kwargs)

    return handler


def _delete_if_generation_match(delete):
    """``objects.delete`` of the emulator, refusing a delete whose ``ifGenerationMatch`` is not the
    object's generation with 412, as GCS does."""

    def handler(request, response, storage, *args, **kwargs):
        want = (request.query.get("ifGenerationMatch") or [None])[0]
        if want is not None:
            now = _generation_now(storage, request.params["bucket_name"], request.params["object_id"])
            if now is not None and now != want:
                return _precondition_failed(response)
        return delete(request, response, storage, *args, **kwargs)

    return handler


def serve(argv: list[str]) -> None:
    """Runs ``gcp_storage_emulator`` with ``argv`` (its command line), with the fixes above."""
    from gcp_storage_emulator.handlers import objects

    # before the server module builds its routes from them
    objects.ls = _filtered_ls(objects.ls)
    objects.download = _download_with_generation(objects.download)
    objects.insert = _insert_if_generation_match(objects.insert)
    objects.delete = _delete_if_generation_match(objects.delete)
    from gcp_storage_emulator import __main__ as cli

    cli.main(argv)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """``gcp-storage-emulator`` serving ``bucket`` in memory on ``http://127.0.0.1:<port>``.

    ``with GcsEmulator("bt-test") as gcs: ... gcs.env() ... gcs.names("run/")``. Raises
    RuntimeError (with the server's output) when it does not answer within ``timeout_s`` seconds.
    """

    def __init__(self, bucket: str, timeout_s: float = 30.0):
        self.bucket, self.port = bucket, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()  # the server's output (a pipe nobody reads could fill up)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "start", "--host=127.0.0.1", f"--port={self.port}",
             "--in-memory", "--quiet"], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("GET", "/storage/v1/b")
                break
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.stop()
                    raise RuntimeError(f"gcp-storage-emulator did not answer on {self.url}: {err}")
                time.sleep(0.05)
        self._request("POST", "/storage/v1/b?project=test", {"name": bucket})

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def env(self) -> dict[str, str]:
        """The variables that point gcsfs/epath/orbax, tensorstore and google-cloud-storage here."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "FSSPEC_GCS_TOKEN": "anon", "TENSORSTORE_GCS_HTTP_URL": self.url,
                "TENSORSTORE_GCS_HTTP_VERSION": "1", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                "GOOGLE_CLOUD_PROJECT": "test"}

    def names(self, prefix: str = "") -> list[str]:
        """Every object name in the bucket under ``prefix``, sorted, asked of the server itself (no
        client library, no listing cache)."""
        q = urllib.parse.urlencode({"prefix": prefix})
        return sorted(o["name"] for o in self._request("GET", f"/storage/v1/b/{self.bucket}/o?{q}").get("items") or [])

    def read(self, name: str) -> bytes:
        """The bytes of object ``name``, downloaded from the server itself.

        Raises:
            urllib.error.HTTPError: 404 when there is no such object.
        """
        key = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}/o/{key}?alt=media", timeout=10) as r:
            return r.read()

    def write(self, name: str, data: bytes) -> None:
        """Uploads ``data`` as object ``name`` (the JSON API's media upload), asked of the server itself."""
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        req = urllib.request.Request(f"{self.url}/upload/storage/v1/b/{self.bucket}/o?{q}", data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def clear(self, prefix: str) -> None:
        """Deletes every object under ``prefix`` (a test's own corner of the bucket)."""
        for name in self.names(prefix):
            self._request("DELETE", f"/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(name, safe='')}")

    def stop(self) -> str:
        """Stops the server; returns the end of its output."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log.closed:
            return ""
        self._log.seek(0)
        out = self._log.read().decode(errors="replace")
        self._log.close()
        return out[-2000:]

    def __enter__(self) -> "GcsEmulator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    serve(sys.argv[1:])
