"""The model-family registry: one :class:`Family` per HF ``model_type`` (qwen2, llama, qwen3).

A family bundles everything that differs between architectures: its config dataclass (a
``decoder.DecoderConfig`` subclass with presets and ``from_hf_config`` / ``to_hf_config``), its NNX
module, its HF weight rows (one decoder layer, ``model.parameters()`` order; ``hf_io`` assembles the
full table, which is also the CountSketch order), its partition rules (``sharding.PARAM_RULES``
rows) and the grouping of HF parameter names for group norms. Everything else (sampler, trainers,
sketcher, targets, stages) calls the model through ``decoder``'s pure functions and finds the family
here: :func:`family_of` (of a config), :func:`get_family` (by name), :func:`resolve` (config key
``model.family`` or a checkpoint's ``config.json`` ``model_type``) and :func:`config_from_hf`.

Add a family: a module beside ``qwen2.py`` (config subclass, module subclass, ``HF_LAYER_ROWS``) and
one :func:`register_family` call below.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from behaviortrace_jax.models import decoder, llama, qwen2, qwen3, sharding


def hf_group(name: str) -> str:
    """Group of a HF decoder parameter name: ``model.embed_tokens``, ``model.layers.{i}``,
    ``model.norm`` or ``lm_head`` (the same for every registered family)."""
    parts = name.split(".")
    if parts[0] == "model" and len(parts) >= 3 and parts[1] == "layers":
        return ".".join(parts[:3])
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return name.rsplit(".", 1)[0]
    raise ValueError(f"not a decoder parameter name: {name!r}")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the HF ``model_type`` (registry key; ``config.model.family`` / ``config.base.family``).
        config_cls: its ``decoder.DecoderConfig`` subclass (``from_hf_config``, ``to_hf_config``,
            presets as class methods, e.g. ``tiny``).
        module_cls: its NNX module (a ``decoder.DecoderForCausalLM`` subclass).
        hf_layer_rows: (HF name inside ``model.layers.{i}``, shape of config) per layer parameter,
            in HF ``model.parameters()`` order.
        param_rules: partition rules, rows of (regex on the HF key, logical axes).
        param_group: HF parameter name -> group name (group norms of the sketcher).
    """

    name: str
    config_cls: type
    module_cls: type
    hf_layer_rows: tuple
    param_rules: tuple = sharding.PARAM_RULES
    param_group: Callable[[str], str] = hf_group

    @property
    def architecture(self) -> str:
        return self.config_cls.architecture

    def preset(self, name: str, **overrides: Any) -> decoder.DecoderConfig:
        """``config_cls.<name>(**overrides)``; ValueError naming the family's presets otherwise."""
        fn = getattr(self.config_cls, name, None)
        if not callable(fn) or name.startswith("_") or name in ("from_hf_config", "replace"):
            raise ValueError(f"model family {self.name!r} has no preset {name!r}")
        return fn(**overrides)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Adds ``family`` under ``family.name``; ValueError if the name is taken by another family."""
    old = _FAMILIES.get(family.name)
    if old is not None and old != family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def names() -> list[str]:
    """The registered family names, sorted."""
    return sorted(_FAMILIES)


def get_family(name: str) -> Family:
    """The family registered as ``name`` (a HF ``model_type``).

    Raises:
        ValueError: naming ``name`` and the registered families.
    """
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family / model_type {name!r}; registered: {names()}")
    return _FAMILIES[name]


def family_of(config: Any) -> Family:
    """The family of a model config instance (by its class's ``model_type``)."""
    fam = get_family(type(config).model_type)
    if not isinstance(config, fam.config_cls):
        raise ValueError(f"{type(config).__name__} is not the config class of family {fam.name!r}")
    return fam


def model_type(hf_dir_or_dict: str | os.PathLike | dict) -> str:
    """``model_type`` of a checkpoint's ``config.json`` (FileNotFoundError naming it when absent)."""
    d, src = decoder.read_hf_config(hf_dir_or_dict)
    if "model_type" not in d:
        raise ValueError(f"{src}: required key 'model_type' is missing")
    return d["model_type"]


def resolve(family: str | None, hf_dir_or_dict: str | os.PathLike | dict | None = None) -> Family:
    """The family to use: ``family`` when given (non-empty), else the checkpoint's ``model_type``."""
    if family:
        return get_family(family)
    if hf_dir_or_dict is None:
        raise ValueError("no model family given and no checkpoint to read model_type from")
    return get_family(model_type(hf_dir_or_dict))


def preset(name: str, family: str | None = None, **overrides: Any) -> decoder.DecoderConfig:
    """The preset ``name`` of ``family``, or (family None / "") of the one family that has it
    (e.g. ``qwen2p5_1p5b``, ``llama3p2_1b``, ``qwen3_1p7b``).

    Raises:
        ValueError: naming ``name`` when no family, or more than one (give ``family``), has it.
    """
    if family:
        return get_family(family).preset(name, **overrides)
    have = [f for f in _FAMILIES.values() if callable(getattr(f.config_cls, name, None))]
    if len(have) != 1:
        raise ValueError(f"preset {name!r} is defined by {len(have)} model families "
                         f"({[f.name for f in have]}); name the family")
    return have[0].preset(name, **overrides)


def config_from_hf(hf_dir_or_dict: str | os.PathLike | dict, family: str | None = None,
                   **overrides: Any) -> decoder.DecoderConfig:
    """The model config of a HF checkpoint: ``family`` (default: its ``model_type``) reads config.json.

    Raises:
        FileNotFoundError: naming config.json when absent.
        ValueError: naming ``model_type`` for an unregistered family, one that disagrees with
            ``family`` or with config.json's ``architectures``, and whatever the family's
            ``from_hf_config`` refuses.
    """
    d, src = decoder.read_hf_config(hf_dir_or_dict)
    fam = resolve(family, d)
    archs = d.get("architectures") or []
    if archs and fam.architecture not in archs:
        raise ValueError(f"{src}: model_type={d.get('model_type')!r} (family {fam.name!r}) but "
                         f"architectures={archs}; expected {fam.architecture!r}")
    return fam.config_cls.from_hf_config(hf_dir_or_dict, **overrides)


register_family(Family("qwen2", qwen2.Qwen2Config, qwen2.Qwen2ForCausalLM, qwen2.HF_LAYER_ROWS))
register_family(Family("llama", llama.LlamaConfig, llama.LlamaForCausalLM, llama.HF_LAYER_ROWS))
register_family(Family("qwen3", qwen3.Qwen3Config, qwen3.Qwen3ForCausalLM, qwen3.HF_LAYER_ROWS))
