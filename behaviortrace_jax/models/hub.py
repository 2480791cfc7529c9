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


def resolve_hf_id(hf_id: str, *, allow_download: bool = False, revision: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> "epath.Path":
    """The local snapshot folder of the hub model ``hf_id`` (``"org/name"``) at ``revision``
    (None = ``main``), from the hub cache (:func:`hub_cache_dir` of ``environ``).

    Offline unless ``allow_download``: then a model missing from the cache is downloaded into it
    (``huggingface_hub.snapshot_download``). The folder holds what :func:`loader.load_policy` reads
    (config.json, safetensors, tokenizer files).

    Raises:
        ValueError: ``hf_id`` is not of the form ``org/name``.
        FileNotFoundError: the model is not in the cache (and ``allow_download`` is off), naming the
            id, the cache folder and the download command (:func:`download_command`), or its
            snapshot has no ``config.json``.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    hf_id = str(hf_id).strip()
    if hf_id.count("/") != 1 or not all(hf_id.split("/")):
        raise ValueError(f"config.model.hf_id={hf_id!r}: expected a Hugging Face model id 'org/name' "
                         "(e.g. Qwen/Qwen2.5-1.5B-Instruct)")
    cache = hub_cache_dir(environ)
    try:
        path = as_path(snapshot_download(hf_id, revision=revision, cache_dir=str(cache),
                                              local_files_only=not allow_download))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"config.model.hf_id={hf_id!r} is not in the Hugging Face cache {cache} (HF_HUB_CACHE / HF_HOME); "
            f"download it with `{download_command(hf_id)}`, or set --config.model.allow_download=True") from e
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"config.model.hf_id={hf_id!r}: the cached snapshot {path} has no config.json "
                                f"(an incomplete download? rerun `{download_command(hf_id)}`)")
    return path
