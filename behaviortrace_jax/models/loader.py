"""One way to put a policy checkpoint on the mesh: :func:`load_policy`."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from etils import epath

from flax import nnx

from behaviortrace_jax.io.files import local_dir
from behaviortrace_jax.io.layout import as_path
from behaviortrace_jax.models import decoder, families, hf_io, tokenizer as tok_lib
from behaviortrace_jax.models.sharding import Layout


@dataclasses.dataclass
class Policy:
    """A loaded policy: its model config, graph, parameters (``nnx.State``), tokenizer and mesh (the
    layout's, ``Layout.mesh()``)."""

    hf_dir: epath.Path  # as given (a gs:// checkpoint is read from its local copy, files.local_dir)
    model_config: decoder.DecoderConfig  # its family's config class (``families.family_of``)
    graphdef: nnx.GraphDef
    params: Any
    tokenizer: Any  # None when loaded with tokenizer=False
    mesh: Any  # None: the default device


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How a run loads every checkpoint (``config.model``; SPEC §2.1), built once at the stage boundary
    (``stages/spec.py``).

    ``param_dtype`` / ``compute_dtype``: storage and activation dtypes ("float32" | "bfloat16");
    ``family``: a registered model family, None = config.json's ``model_type``
    (``families.config_from_hf``); ``scan_layers``: the decoder's layers as one ``lax.scan``
    (``DecoderConfig.scan_layers``; config.json does not hold it, and ``sketcher.hf_param_order`` of
    such a config is the scanned order).
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    family: str | None = None
    scan_layers: bool = False


def policy_config(hf_dir: str | os.PathLike, options: ModelOptions = ModelOptions()) -> decoder.DecoderConfig:
    """The model config of the HF checkpoint ``hf_dir`` as ``options`` load it (family, dtypes, scan)."""
    return families.config_from_hf(local_dir(hf_dir), options.family, param_dtype=options.param_dtype,
                                   compute_dtype=options.compute_dtype).replace(scan_layers=options.scan_layers)


def load_policy(hf_dir: str | os.PathLike, layout: Layout | None = None, options: ModelOptions = ModelOptions(), *,
                tokenizer: bool = True) -> Policy:
    """Loads the HF checkpoint ``hf_dir`` (strictly, see ``hf_io.load_hf_checkpoint``) as a policy.

    Every stage loads weights through here, with the run's ``RunSpec.model`` (``stages/spec.py``).

    Args:
        hf_dir: an HF checkpoint directory (config.json, safetensors, tokenizer files).
        layout: the run's :class:`~behaviortrace_jax.models.sharding.Layout`: the parameters go straight
            onto its mesh in its ``param_shardings`` (FSDP when ``layout.fsdp``, as the train state and
            the compile stage place them); None puts them on the default device.
        options: family, storage / compute dtypes and layer scan (:class:`ModelOptions`).
        tokenizer: also load the checkpoint's tokenizer (``tokenizer.load_tokenizer``).

    Raises:
        FileNotFoundError / KeyError / ValueError: as ``hf_io.load_hf_checkpoint`` (naming the file,
        tensor or key) and ``families.config_from_hf``; ValueError when the tokenizer has more ids
        than the model's ``vocab_size`` (ids the embedding cannot hold).
    """
    src = local_dir(hf_dir)  # a gs:// checkpoint is fetched once for the tokenizer, config and weights
    tok = tok_lib.load_tokenizer(src) if tokenizer else None
    cfg = policy_config(src, options)
    if tok is not None and len(tok) > cfg.vocab_size:
        raise ValueError(f"{hf_dir}: the tokenizer has {len(tok)} ids but config.json's vocab_size is "
                         f"{cfg.vocab_size}: ids >= {cfg.vocab_size} would be clamped by the embedding")
    mesh = None if layout is None else layout.mesh()
    model = hf_io.load_hf_checkpoint(src, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, mesh=mesh,
                                     fsdp=layout is not None and layout.fsdp, family=cfg.model_type,
                                     scan_layers=options.scan_layers)
    graphdef, params = nnx.split(model, nnx.Param)
    return Policy(as_path(hf_dir), cfg, graphdef, params, tok, mesh)
