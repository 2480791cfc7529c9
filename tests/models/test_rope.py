"""RoPE read from HF configs as transformers 5 reads them (issue 32, item 3): for every family, every
RoPE type the decoder implements (default, linear, dynamic, yarn, llama3) and every spelling a
config.json may carry (old ``rope_scaling`` + ``rope_theta``, new ``rope_parameters``, both at once),
our inverse frequencies, cos/sin scale and RoPE tables equal transformers' own
(``ROPE_INIT_FUNCTIONS``, the family's ``RotaryEmbedding`` module, dynamic updates included).
transformers is the reference here only; the package never imports it for RoPE."""
from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from behaviortrace_jax.models import decoder, families

FAMILIES = ("qwen2", "llama", "qwen3")
MPE = 256  # max_position_embeddings of the test configs
# One rope dict per type; yarn's uses every option so each is read (a second yarn below the defaults).
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
             "beta_slow": 2, "mscale": 1.5, "mscale_all_dim": 0.5, "truncate": False},
    "yarn_defaults": {"type": "yarn", "factor": 8.0},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                              "attention_factor": 0.75},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}
# A rope dict the "both" spelling also carries: transformers drops it for rope_scaling.
DECOY = {"rope_type": "linear", "factor": 7.0, "rope_theta": 123.0}
THETA = 50000.0


def _hf_dict(fam: str, spelling: str, rope: dict) -> dict:
    cfg = families.get_family(fam).preset("tiny", vocab_size=64, num_hidden_layers=1,
                                          max_position_embeddings=MPE)
    d = {k: v for k, v in cfg.to_hf_config().items() if k not in ("rope_theta", "rope_parameters")}
    if spelling == "old":
        d.update(rope_scaling=dict(rope), rope_theta=THETA)
    elif spelling == "new":
        d.update(rope_parameters={**rope, "rope_theta": THETA})
    else:
        d.update(rope_scaling=dict(rope), rope_theta=THETA, rope_parameters=dict(DECOY))
    return d


def _hf_config(fam: str, d: dict):
    cls = getattr(transformers, type(families.get_family(fam).preset("tiny")).__name__)
    return cls(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()})


def _reference(fam: str, hf_cfg, seq_len=None):
    """transformers' (inv_freq, attention_scaling) for ``hf_cfg``."""
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        module = getattr(transformers, type(hf_cfg).__name__.replace("Config", "ForCausalLM")).__module__
        rotary = getattr(__import__(module, fromlist=["x"]), type(hf_cfg).__name__.replace("Config", "RotaryEmbedding"))
        inv, scale = rotary.compute_default_rope_parameters(hf_cfg)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu", seq_len=seq_len)
    return inv.numpy(), float(scale)


def _rotary_module(hf_cfg):
    name = type(hf_cfg).__name__.replace("Config", "")
    mod = __import__(getattr(transformers, name + "ForCausalLM").__module__, fromlist=["x"])
    return getattr(mod, name + "RotaryEmbedding")(hf_cfg)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("spelling", ("old", "new", "both"))
@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_matches_transformers(fam, spelling, kind):
    d = _hf_dict(fam, spelling, ROPES[kind])
    hf_cfg = _hf_config(fam, d)
    ours = families.config_from_hf(d)
    assert ours.rope_theta == THETA  # the decoy's rope_theta lost, as in transformers
    ref_inv, ref_scale = _reference(fam, hf_cfg)
    inv = ours.rope_inv_freq()
    inv = decoder.default_inv_freq(ours.head_dim, ours.rope_theta) if inv is None else inv
    np.testing.assert_allclose(np.asarray(inv), ref_inv, rtol=1e-6, atol=0)
    assert ours.rope_attention_scaling == pytest.approx(ref_scale, rel=1e-12)
    # the RoPE tables the decoder uses, against the family's RotaryEmbedding (dynamic updates
    # included: one forward within max_position_embeddings, one beyond it)
    for length in (40, 3 * MPE):
        pos = np.arange(length, dtype=np.int32)[None]
        rotary = _rotary_module(_hf_config(fam, d))
        cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), torch.as_tensor(pos, dtype=torch.long))
        seq = jnp.max(jnp.asarray(pos)) + 1 if ours.rope_scaling is not None else None
        cos, sin = decoder.rope_cos_sin(jnp.asarray(pos), ours.head_dim, ours.rope_theta,
                                        ours.rope_inv_freq(seq), ours.rope_attention_scaling)
        np.testing.assert_allclose(np.asarray(cos), cos_ref.numpy(), atol=2e-5)
        np.testing.assert_allclose(np.asarray(sin), sin_ref.numpy(), atol=2e-5)
    # to_hf_config round-trips through transformers' config class to the same config
    again = families.config_from_hf(_hf_config(fam, ours.to_hf_config()).to_dict())
    assert again == ours


@pytest.mark.parametrize("seq_len", (MPE, MPE + 1, 4 * MPE + 7))
def test_dynamic_frequencies_follow_the_sequence_length(seq_len):
    d = _hf_dict("llama", "new", ROPES["dynamic"])
    ref, _ = _reference("llama", _hf_config("llama", d), seq_len=seq_len)
    ours = families.config_from_hf(d).rope_inv_freq(jnp.int32(seq_len))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=2e-6)
    if seq_len <= MPE:  # within the trained context, the default frequencies
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(decoder.default_inv_freq(32, THETA)))


def test_precedence_without_rope_theta_in_the_dict():
    # rope_theta only at the top level, next to rope_parameters: transformers copies it in
    d = _hf_dict("qwen2", "new", ROPES["linear"])
    d["rope_parameters"].pop("rope_theta")
    d["rope_theta"] = 3e5
    assert families.config_from_hf(d).rope_theta == 3e5 == _hf_config("qwen2", d).rope_parameters["rope_theta"]
    # neither: transformers' default theta
    d.pop("rope_theta")
    assert families.config_from_hf(d).rope_theta == 10000.0 == _hf_config("qwen2", d).rope_parameters["rope_theta"]
    # a top-level rope_theta that disagrees with the dict's: the dict's wins
    d = _hf_dict("qwen3", "new", ROPES["default"])
    d["rope_theta"] = 1.0
    assert families.config_from_hf(d).rope_theta == THETA == _hf_config("qwen3", d).rope_parameters["rope_theta"]


def test_disagreeing_spellings_are_logged(caplog):
    d = _hf_dict("llama", "both", ROPES["yarn"])
    with caplog.at_level(logging.WARNING):
        cfg = families.config_from_hf(d)
    assert cfg.rope_scaling.rope_type == "yarn"
    text = caplog.text
    assert "rope_scaling" in text and "rope_parameters" in text and "disagree" in text


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("rope, needles", [
    ({"rope_type": "linear"}, ("factor",)),
    ({"rope_type": "dynamic"}, ("factor",)),
    ({"rope_type": "yarn"}, ("factor",)),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, ("high_freq_factor",)),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, ("rope_type", "longrope")),
    ({"rope_type": "linear", "factor": "2"}, ("factor",)),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ("partial_rotary_factor",)),
])
def test_refused_rope_dicts_name_the_key(fam, rope, needles):
    for spelling in ("old", "new"):
        with pytest.raises(ValueError) as e:
            families.config_from_hf(_hf_dict(fam, spelling, rope))
        assert all(n in str(e.value) for n in needles), str(e.value)
    # where transformers itself refuses (a required key missing), it does so too
    if rope["rope_type"] in ("linear", "dynamic", "yarn", "llama3") and "partial_rotary_factor" not in rope \
            and not isinstance(rope.get("factor", 0.0), str):
        with pytest.raises(KeyError):
            _hf_config(fam, _hf_dict(fam, "new", rope))


@pytest.mark.parametrize("key", ("rope_scaling", "rope_parameters"))
def test_a_rope_value_that_is_not_a_dict_names_its_key(key):
    d = _hf_dict("qwen2", "new", ROPES["default"])
    d.pop("rope_parameters")
    d[key] = [1, 2]
    with pytest.raises(ValueError, match=key):
        families.config_from_hf(d)
