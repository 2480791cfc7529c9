"""Hugging Face checkpoint I/O for every model family (``families``; SPEC §2.4).

The weight map is a data table (:func:`hf_param_table`, assembled from the family's per-layer
rows): one row per HF tensor, in HF ``model.parameters()`` order, giving its key, the NNX path of the parameter and its shape. The
parameters are stored in HF layout, so loading and export are renames with no transposes, and
the table order is the order the CountSketch walks (SPEC §3.1, §10.6).

Loading is strict (every key mapped, every shape checked) and lazy: safetensors files are
memory-mapped (header + ``np.memmap``; ml_dtypes handles bfloat16) and each array is built with
``jax.make_array_from_callback`` from the slices its sharding asks for, so a full copy of a sharded
parameter never sits on one device.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
from typing import Any, Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx

from behaviortrace_jax.io.files import atomic_write_dir, local_dir, read_json
from behaviortrace_jax.io.layout import as_path
from behaviortrace_jax.models import families, sharding
from behaviortrace_jax.models.decoder import DecoderConfig, DecoderForCausalLM, abstract_model, resolve_sharding

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class HFParam(NamedTuple):
    """One row of the weight map: HF key, NNX path (HF key split at dots, ints for layer ids), shape."""

    hf_key: str
    nnx_path: tuple
    shape: tuple


def _path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def hf_param_table(config: DecoderConfig) -> list[HFParam]:
    """The weight map in HF ``<Family>ForCausalLM.parameters()`` order.

    ``model.embed_tokens.weight [V, d]``, then per layer the family's ``hf_layer_rows`` (12 for
    Qwen2, 9 for Llama, 11 for Qwen3), then ``model.norm.weight [d]`` and, for untied models only,
    ``lm_head.weight [V, d]``.
    """
    c = config
    rows = families.family_of(config).hf_layer_rows
    keys = [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))]
    for i in range(c.num_hidden_layers):
        keys += [(f"model.layers.{i}.{name}", shape(c)) for name, shape in rows]
    keys.append(("model.norm.weight", (c.hidden_size,)))
    if not c.tie_word_embeddings:
        keys.append(("lm_head.weight", (c.vocab_size, c.hidden_size)))
    return [HFParam(k, _path(k), tuple(s)) for k, s in keys]


def param_order_fingerprint(config: DecoderConfig) -> str:
    """sha256 hex of the table's ``key:shape`` rows in order (equal fingerprints = same sketch order)."""
    rows = "".join(f"{p.hf_key}:{','.join(map(str, p.shape))}\n" for p in hf_param_table(config))
    return hashlib.sha256(rows.encode()).hexdigest()


def model_fingerprint(config: DecoderConfig) -> str:
    """sha256 hex of the architecture (config without dtypes) and the parameter-order fingerprint."""
    arch = {k: v for k, v in config.to_hf_config().items() if k not in ("torch_dtype", "dtype")}
    blob = json.dumps(arch, sort_keys=True) + param_order_fingerprint(config)
    return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Reading safetensors lazily
# ------------------------------------------------------------------------------------------------


class _SafetensorsFile:
    """Memory-mapped safetensors file: ``tensor(key)`` is a lazy read-only numpy view.

    The header is checked against the file when it is opened (the safetensors format: an 8-byte
    little-endian header length, a JSON header, then the data): the header fits in the file, it is a
    JSON object whose entries have a ``dtype``, a ``shape`` of non-negative integers and
    ``data_offsets`` ``[begin, end]`` with ``end - begin`` = the shape's bytes, and the tensors tile
    the data after the header exactly (no gap, overlap or trailing byte; the safetensors library's rule).

    Raises:
        ValueError: naming the file (and the tensor) for an empty or truncated file, a header that is
            not such JSON, or offsets that do not fit the file or the shape.
    """

    def __init__(self, path: epath.Path):
        self.path = path
        size = as_path(path).stat().length
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header "
                                 "length (an empty or truncated file: download or save it again)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{path}: truncated safetensors file: its header says {n} header bytes but the "
                                 f"file has {size} bytes in all (download or save it again)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.header, self.start = header, 8 + n
        data = size - self.start
        for key, info in header.items():
            _check_entry(path, key, info, data)
        # As the safetensors library validates: the tensors tile the data, in offset order, with no gap or overlap.
        end = 0
        for key, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
            begin = info["data_offsets"][0]
            if begin != end:
                raise ValueError(f"{path}: tensor {key!r} begins at data byte {begin}, but the tensor before it ends at "
                                 f"{end}: the header's data_offsets overlap or leave a gap (a corrupt header)")
            end = info["data_offsets"][1]
        if end != data:
            raise ValueError(f"{path}: the header's tensors end at data byte {end}, but the file holds {data} data bytes "
                             f"({'a truncated file' if end > data else 'trailing bytes'}; download or save it again)")
        self._mm: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> tuple:
        return tuple(self.header[key]["shape"])

    def tensor(self, key: str) -> np.ndarray:
        info = self.header[key]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {key!r} has unsupported dtype {info['dtype']}")
        if self._mm is None:
            self._mm = np.memmap(self.path, np.uint8, mode="r")
        a, b = info["data_offsets"]
        raw = self._mm[self.start + a:self.start + b]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _check_entry(path: epath.Path, key: str, info: Any, data_bytes: int) -> None:
    """Checks one safetensors header entry against the file's ``data_bytes`` (see :class:`_SafetensorsFile`)."""
    where = f"{path}: tensor {key!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise ValueError(f"{where}: header entry {info!r} lacks dtype, shape or data_offsets")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                    for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{where}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    if offsets[1] > data_bytes:
        raise ValueError(f"{where}: data_offsets {offsets} run past the end of the data ({data_bytes} bytes after "
                         "the header): a truncated file (download or save it again)")
    itemsize = _ST_ITEMSIZE.get(info["dtype"])
    if itemsize is not None and offsets[1] - offsets[0] != itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but {info['dtype']} "
                         f"{shape} needs {itemsize * int(np.prod(shape, dtype=np.int64))}")


def _open_checkpoint(hf_dir: epath.Path) -> dict[str, _SafetensorsFile]:
    """Maps every tensor key of a single-file or sharded checkpoint to its open file."""
    if (hf_dir / INDEX_FILE).is_file():
        weight_map = read_json(hf_dir / INDEX_FILE)["weight_map"]
        files: dict[str, _SafetensorsFile] = {}
        out = {}
        for key, fname in weight_map.items():
            if fname not in files:
                if not (hf_dir / fname).is_file():
                    raise FileNotFoundError(f"{hf_dir / INDEX_FILE} names shard {fname!r} for "
                                            f"{key!r}, but {hf_dir / fname} is missing")
                files[fname] = _SafetensorsFile(hf_dir / fname)
            if key not in files[fname].header:
                raise KeyError(f"{hf_dir / INDEX_FILE} maps {key!r} to {fname}, which lacks it")
            out[key] = files[fname]
        return out
    if (hf_dir / SINGLE_FILE).is_file():
        f = _SafetensorsFile(hf_dir / SINGLE_FILE)
        return {k: f for k in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")


def load_hf_checkpoint(hf_dir: str | os.PathLike, *, param_dtype: str | None = None,
                       compute_dtype: str | None = None, shardings: Any = None,
                       mesh: Any = None, fsdp: bool = False, remat: bool = False, family: str | None = None,
                       scan_layers: bool = False) -> DecoderForCausalLM:
    """Loads a HF checkpoint directory into its family's module, strictly and lazily.

    Args:
        hf_dir: directory with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` + shards.
        param_dtype: storage dtype ("float32" | "bfloat16"); None -> config.json's ``torch_dtype``.
        compute_dtype: activation dtype; None -> ``param_dtype``.
        shardings: where each parameter goes (see ``decoder.resolve_sharding``): None (first
            device), one ``Sharding``, a callable ``nnx_path -> Sharding`` or a dict / ``nnx.State``.
        mesh: a ``("data", "model")`` mesh (``sharding.Layout.mesh``): the parameters go straight into
            ``sharding.param_shardings`` on it (instead of ``shardings``; give one or neither).
        fsdp: with ``mesh``, also split each matrix over ``"data"`` (``sharding.Layout.fsdp``,
            ``mesh.fsdp``): the layout the run's train state and the compile stage use.
        remat: passed to the model (gradient checkpointing per layer).
        family: the model family (``families``); None -> config.json's ``model_type``.
        scan_layers: the model's ``DecoderConfig.scan_layers`` (``config.model.scan_layers``; not in
            config.json): one ``lax.scan`` over the layers. Same parameters, same weight table.

    Raises:
        FileNotFoundError: naming the missing config.json / weights file / shard.
        KeyError: naming a tensor the checkpoint lacks.
        ValueError: naming ``model_type`` (unregistered, or not ``family``), an unexpected tensor, a tensor of the wrong shape or dtype, or a tied
            checkpoint whose stored ``lm_head.weight`` differs from the embedding; or both
            ``shardings`` and ``mesh``.
    """
    if mesh is not None and shardings is not None:
        raise ValueError("load_hf_checkpoint: give shardings or mesh, not both")
    hf_dir = local_dir(hf_dir)  # itself when local; a gs:// checkpoint is memory-mapped from a local copy
    cfg = families.config_from_hf(hf_dir, family)
    pdt = param_dtype or cfg.param_dtype
    cfg = cfg.replace(param_dtype=pdt, compute_dtype=compute_dtype or pdt, scan_layers=scan_layers)
    table = hf_param_table(cfg)
    tensors = _open_checkpoint(hf_dir)
    expected = {p.hf_key for p in table}
    extra = [k for k in tensors if k not in expected]
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
        _check_tied_head(tensors, hf_dir)
    if extra:
        raise ValueError(f"{hf_dir}: unexpected tensor(s) not in the weight map of model_type="
                         f"{cfg.model_type!r}: {sorted(extra)}")
    for p in table:
        if p.hf_key not in tensors:
            raise KeyError(f"{hf_dir}: checkpoint lacks tensor {p.hf_key!r} (shape {p.shape})")
        found = tensors[p.hf_key].shape(p.hf_key)
        if found != p.shape:
            raise ValueError(f"{hf_dir}: tensor {p.hf_key!r} has shape {found}, expected {p.shape}")

    model = abstract_model(cfg, remat=remat)
    graphdef, abstract = nnx.split(model, nnx.Param)
    flat = dict(nnx.to_flat_state(abstract))
    if set(flat) != {p.nnx_path for p in table}:  # the table and the module tree must agree
        raise AssertionError(f"weight map and model disagree: {set(flat) ^ {p.nnx_path for p in table}}")
    if mesh is not None:
        shardings = sharding.param_shardings(abstract, mesh, families.family_of(cfg).param_rules, fsdp=fsdp)
    np_dtype = _NP_DTYPES[pdt]
    for p in table:
        src = tensors[p.hf_key].tensor(p.hf_key)
        arr = jax.make_array_from_callback(
            p.shape, resolve_sharding(shardings, p.nnx_path),
            lambda idx, src=src: np.asarray(src[idx]).astype(np_dtype, copy=False))
        flat[p.nnx_path] = flat[p.nnx_path].replace(value=arr)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _check_tied_head(tensors: dict[str, _SafetensorsFile], hf_dir: epath.Path) -> None:
    head = tensors["lm_head.weight"].tensor("lm_head.weight")
    emb_key = "model.embed_tokens.weight"
    if emb_key not in tensors:
        return  # reported as missing by the caller
    emb = tensors[emb_key].tensor(emb_key)
    if head.shape != emb.shape:
        raise ValueError(f"{hf_dir}: tied model stores lm_head.weight {head.shape} != embedding {emb.shape}")
    for r in range(0, head.shape[0], 8192):  # chunked: never two full copies in memory
        if not np.array_equal(head[r:r + 8192], emb[r:r + 8192]):
            raise ValueError(f"{hf_dir}: tie_word_embeddings=true but stored lm_head.weight differs "
                             f"from model.embed_tokens.weight (rows {r}..)")


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------


def _flat_params(params_or_model: Any) -> dict[tuple, Any]:
    state = nnx.state(params_or_model, nnx.Param) if isinstance(params_or_model, nnx.Module) \
        else params_or_model
    return {path: (v.get_value() if isinstance(v, nnx.Variable) else v)
            for path, v in nnx.to_flat_state(state)}


def hf_ordered_leaves(params_or_model: Any, config: DecoderConfig) -> list[Any]:
    """The parameter (or gradient) arrays in table order, unchanged (jit-friendly; no host copy).

    ``params_or_model`` is a model or an ``nnx.State`` of params / grads with the model's paths.
    """
    flat = _flat_params(params_or_model)
    return [flat[p.nnx_path] for p in hf_param_table(config)]


def hf_state_dict(params_or_model: Any, config: DecoderConfig) -> dict[str, np.ndarray]:
    """``{hf_key: numpy array}`` in table order (host copies; the dtype of the stored params)."""
    leaves = hf_ordered_leaves(params_or_model, config)
    table = hf_param_table(config)
    out = {}
    for p, x in zip(table, sharding.to_host(leaves)):  # one batched transfer (gathered across processes)
        a = np.asarray(x)
        if a.shape != p.shape:
            raise ValueError(f"parameter {p.hf_key!r} has shape {a.shape}, expected {p.shape}")
        out[p.hf_key] = a
    return out


def save_hf_checkpoint(model_or_state: Any, config: DecoderConfig, out_dir: str | os.PathLike,
                       tokenizer: Any = None, generation_config: dict | None = None) -> epath.Path:
    """Writes a transformers-loadable checkpoint: config.json, model.safetensors (+ tokenizer files).

    Weights are stored in ``config.param_dtype``; tied models store no ``lm_head.weight``. The
    directory is written as ``<out_dir>.tmp-XXXX`` and renamed into place only when complete; an
    existing ``out_dir`` is replaced after that. ``tokenizer.save_pretrained`` writes the tokenizer;
    its eos/bos/pad ids go into config.json. ``generation_config`` is written as given.

    Returns:
        the output directory.
    """
    from safetensors.numpy import save_file

    out_dir = as_path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = _NP_DTYPES[config.param_dtype]
    tensors = {k: np.ascontiguousarray(v.astype(np_dtype, copy=False))  # no second host copy
               for k, v in hf_state_dict(model_or_state, config).items()}
    hf_cfg = config.to_hf_config()
    if tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name, None) is not None:
                hf_cfg[name] = getattr(tokenizer, name)
    files = [("config.json", hf_cfg)]
    if generation_config is not None:
        files.append(("generation_config.json", generation_config))

    def fill(tmp: pathlib.Path) -> None:
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        for name, obj in files:
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return atomic_write_dir(out_dir, fill)
