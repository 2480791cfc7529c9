"""Models by name: ``config.model.hf_id`` found in the Hugging Face hub cache (offline by default).

A user who ran ``hf download Qwen/Qwen2.5-1.5B-Instruct`` has the model under the hub cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) in the hub's layout::

    models--Qwen--Qwen2.5-1.5B-Instruct/
        refs/main                 the commit hash ``main`` points at
        snapshots/<commit>/       config.json, *.safetensors, tokenizer files (links into blobs/)
        blobs/

:func:`resolve_hf_id` returns that snapshot folder, as ``transformers`` does with
``local_files_only=True``; ``pipeline.with_model_source`` puts it in ``config.model.hf_dir`` once, at the
pipeline's start, so every stage loads the model as it loads any local checkpoint. With
``config.model.allow_download`` (off by default) a model missing from the cache is downloaded into it.
"""
from __future__ import annotations

import importlib.metadata
import os
from typing import Mapping


from behaviortrace_jax.io.layout import as_path


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> "epath.Path":
    """The hub cache folder as ``huggingface_hub`` finds it, read from ``environ`` now (not at import):
    ``HF_HUB_CACHE``, else the legacy ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub.constants)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(key):
            return as_path(environ[key]).expanduser()
    if environ.get("HF_HOME"):
        return as_path(environ["HF_HOME"]).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return as_path(xdg).expanduser() / "huggingface" / "hub"


def download_command(hf_id: str) -> str:
    """The shell command that puts ``hf_id`` into the hub cache, with the CLI the installed
    ``huggingface_hub`` ships: ``hf download <id>`` (huggingface_hub >= 0.34), else
    ``huggingface-cli download <id>``."""
    try:
        scripts = {e.name for e in importlib.metadata.distribution("huggingface_hub").entry_points}
    except importlib.metadata.PackageNotFoundError:
        scripts = set()
    cli = "hf" if "hf" in scripts or not scripts else "huggingface-cli"
    return f"{cli} download {hf_id}"


def _cache_state(storage: "epath.Path", revision: str) -> str:
    """What the hub cache holds of one repo folder, in words, for an error message: the ref file's
    text, the snapshots present and any ``.incomplete`` blobs (an interrupted download)."""
    if not storage.is_dir():
        return f"{storage} does not exist"
    ref = storage / "refs" / revision
    parts = [f"{ref} holds {ref.read_text()!r}" if ref.is_file() else f"no {ref}"]
    snaps = sorted(p.name for p in (storage / "snapshots").iterdir()) if (storage / "snapshots").is_dir() else []
    parts.append(f"snapshots: {snaps or 'none'}")
    partial = sorted(p.name for p in (storage / "blobs").glob("*.incomplete")) if (storage / "blobs").is_dir() else []
    if partial:
        parts.append(f"{len(partial)} interrupted download(s) in {storage / 'blobs'} ({partial[0]}...)")
    return "; ".join(parts)


def _check_snapshot(path: "epath.Path", hf_id: str) -> None:
    """Refuses a snapshot folder a model cannot be loaded from: no config.json, a link whose blob is
    missing or still ``.incomplete``, no weights, or an index naming a shard that is not there."""
    blobs = path.parent.parent / "blobs"
    partial = sorted(p.name for p in blobs.glob("*.incomplete")) if blobs.is_dir() else []
    cmd = f"`{download_command(hf_id)}`" + (f" ({blobs} holds {len(partial)} interrupted download(s): "
                                            f"{partial[0]})" if partial else "")
    for f in sorted(path.iterdir()):
        if not f.exists():  # a dangling link into blobs/: its download did not finish
            raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: {f} links to a blob that is missing "
                                    f"(an interrupted download); rerun {cmd}")
        if f.name.endswith(".incomplete") or os.path.realpath(f).endswith(".incomplete"):
            raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: {f} is an interrupted download; rerun {cmd}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: the cached snapshot {path} has no config.json "
                                f"(an incomplete download? rerun {cmd})")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"config.model.hf_id={hf_id!r}: {index} is not a safetensors index ({e!r}); "
                             f"rerun {cmd}") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: {index} names shard(s) {missing} missing from "
                                    f"the snapshot (an incomplete download?); rerun {cmd}")
    elif not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: the cached snapshot {path} has no model.safetensors "
                                f"or model.safetensors.index.json (an incomplete download?); rerun {cmd}")


def resolve_hf_id(hf_id: str, *, allow_download: bool = False, revision: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> "epath.Path":
    """The local snapshot folder of the hub model ``hf_id`` (``"org/name"``) at ``revision``
    (None = ``main``), from the hub cache (:func:`hub_cache_dir` of ``environ``).

    The cache is read by huggingface_hub's own rules (``snapshot_download(local_files_only=True)``:
    ``refs/<revision>`` holds the commit, ``snapshots/<commit>/`` links into ``blobs/``, a snapshot a
    cached tree listing says is partial is refused). One tolerance on top: a ref file whose commit
    is followed by whitespace (a newline, as an editor or ``echo`` writes it; huggingface_hub
    itself writes none and reads the file verbatim) is read as the commit it holds, by asking
    huggingface_hub for that commit. The snapshot must then be loadable: no link to a missing or
    ``.incomplete`` blob, a config.json, and weights (every shard an index names).

    Offline unless ``allow_download``: then a model missing from the cache is downloaded into it
    (``huggingface_hub.snapshot_download``). The folder holds what :func:`loader.load_policy` reads
    (config.json, safetensors, tokenizer files).

    Raises:
        ValueError: ``hf_id`` is not of the form ``org/name``; a corrupt weights index.
        FileNotFoundError: the model is not in the cache (and ``allow_download`` is off), naming the
            id, the cache folder, what the cache holds of it (ref, snapshots, interrupted downloads)
            and the download command (:func:`download_command`); or its snapshot lacks config.json,
            weights or a shard, or links to a missing or ``.incomplete`` blob (naming the file).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    hf_id = str(hf_id).strip()
    if hf_id.count("/") != 1 or not all(hf_id.split("/")):
        raise ValueError(f"config.model.hf_id={hf_id!r}: expected a Hugging Face model id 'org/name' "
                         "(e.g. Qwen/Qwen2.5-1.5B-Instruct)")
    try:
        validate_repo_id(hf_id)
    except ValueError as e:
        raise ValueError(f"config.model.hf_id={hf_id!r}: not a Hugging Face model id ({e})") from None
    cache = hub_cache_dir(environ)
    rev = revision or "main"
    storage = cache / repo_folder_name(repo_id=hf_id, repo_type="model")

    def snapshot(r: str) -> "epath.Path":
        path = as_path(snapshot_download(hf_id, revision=r, cache_dir=str(cache),
                                         local_files_only=not allow_download))
        if path.parent.name != "snapshots":  # an empty ref file: huggingface_hub returns snapshots/ itself
            raise LocalEntryNotFoundError(f"{path} is not a snapshot folder")
        return path

    try:
        path = snapshot(rev)
    except LocalEntryNotFoundError as e:
        ref = storage / "refs" / rev
        commit = ref.read_text().strip() if ref.is_file() else ""
        path = None
        if commit and commit != ref.read_text():  # the ref's commit with a trailing newline / spaces
            try:
                path = snapshot(commit)
            except LocalEntryNotFoundError:
                path = None
        if path is None:
            raise FileNotFoundError(
                f"config.model.hf_id={hf_id!r} (revision {rev!r}) is not in the Hugging Face cache {cache} "
                f"(HF_HUB_CACHE / HF_HOME): {_cache_state(storage, rev)}; download it with "
                f"`{download_command(hf_id)}`, or set --config.model.allow_download=True") from e
    _check_snapshot(path, hf_id)
    return path
