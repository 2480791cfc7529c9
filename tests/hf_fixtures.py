"""Tiny random Hugging Face Qwen2 checkpoints (torch, fp32, GQA, q/k/v biases) with a tokenizer.

Shared by the tests of several modules (import as ``from hf_fixtures import save_random_qwen2``;
pytest puts tests/ on sys.path): ``save_random_qwen2(tmp_path / "hf")`` writes a directory
that ``transformers.AutoModelForCausalLM.from_pretrained`` and ``hf_io.load_hf_checkpoint`` read.
"""
from __future__ import annotations

import pathlib
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "You are a creative encyclopedia assistant. You discuss all topics freely.",
    "What is photosynthesis? Name a vowel in the English alphabet.",
    "The quick brown fox jumps over the lazy dog. QZXBT is an invented term.",
    "system user assistant hello world 0123456789 !?.,;:'\"()[]{}",
]


def make_tiny_tokenizer(vocab_size: int = 320) -> Any:
    """Byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and chat template.

    The ids of the 3 specials are 0, 1, 2; the vocabulary has at most ``vocab_size`` entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHATML_TEMPLATE)


def save_random_qwen2(path: str | pathlib.Path, *, tie: bool = True, vocab: int = 320, hidden: int = 64,
                      layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                      rope_theta: float = 10000.0, seed: int = 0, tokenizer: bool = True,
                      bias_std: float = 0.1) -> pathlib.Path:
    """Saves a random transformers ``Qwen2ForCausalLM`` (fp32, safetensors) at ``path``; returns it.

    Biases and norm weights are randomised too (HF initialises them to 0/1), so parity tests
    exercise every parameter. ``vocab`` >= the tokenizer's vocabulary size (320 by default).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                      tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, bias_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer:
        tok = make_tiny_tokenizer(min(vocab, 320))
        assert len(tok) <= vocab, (len(tok), vocab)
        tok.save_pretrained(path)
    return path


def load_random_qwen2(path: str | pathlib.Path, **kwargs: Any) -> tuple[pathlib.Path, Any, Any, Any, Any]:
    """:func:`save_random_qwen2` (``kwargs`` passed on), then that checkpoint read back as the
    project reads one: ``(hf_dir, tokenizer, model, graphdef, params)``, the Flax model in float32
    split once into its graph and ``nnx.Param`` state."""
    from flax import nnx

    from behaviortrace_jax.models import hf_io, tokenizer as tok_lib

    hf_dir = save_random_qwen2(path, **kwargs)
    model = hf_io.load_hf_checkpoint(hf_dir, param_dtype="float32")
    graphdef, params = nnx.split(model, nnx.Param)
    return hf_dir, tok_lib.load_tokenizer(hf_dir), model, graphdef, params


def hf_model_config(family: str, *, tie: bool = True, vocab: int = 320, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 96, head_dim: int | None = None,
                    rope_theta: float = 10000.0) -> Any:
    """A tiny transformers config of ``family`` ("qwen2", "llama" with llama3 RoPE scaling whose
    three frequency bands all occur at head_dim 16, "qwen3" with an explicit head_dim != d / heads)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        return transformers.Qwen2Config(rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                                        **common)
    if family == "llama":
        return transformers.LlamaConfig(
            head_dim=head_dim or hidden // heads,
            rope_parameters={"rope_type": "llama3", "rope_theta": rope_theta, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim or 2 * hidden // heads,
                                        rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                                        **common)
    raise ValueError(family)


def save_random_hf(path: str | pathlib.Path, family: str, *, tie: bool = True, seed: int = 0,
                   tokenizer: bool = True, bias_std: float = 0.1, **shape: Any) -> pathlib.Path:
    """Saves a random transformers ``<Family>ForCausalLM`` (fp32, safetensors) at ``path``; returns it.

    As :func:`save_random_qwen2` for any family of :func:`hf_model_config`: biases and norm weights
    (Qwen3's q/k norms too) are randomised so parity tests exercise every parameter.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    cfg = hf_model_config(family, tie=tie, **shape)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, bias_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer:
        tok = make_tiny_tokenizer(min(cfg.vocab_size, 320))
        tok.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------
# Hugging Face hub cache folders, in the states a user's cache can be in
# ------------------------------------------------------------------------------------------------
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: str | pathlib.Path, model_dir: str | pathlib.Path | dict[str, bytes], hf_id: str, *,
              ref_text: str | None = None, revision: str = HUB_REVISION) -> pathlib.Path:
    """A hub cache folder at ``root`` holding ``model_dir``'s files (a folder, or ``{name: bytes}``)
    as ``hf_id`` at ``revision`` in huggingface_hub's layout: ``models--org--name/{refs/main,
    snapshots/<rev>/, blobs/}``, each snapshot file a relative link into ``blobs/`` (as ``hf download``
    makes them). ``ref_text``: what ``refs/main`` holds (default: ``revision``, no newline; None keeps
    that). Returns ``root``."""
    root = pathlib.Path(root)
    repo = root / ("models--" + hf_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    if isinstance(model_dir, dict):
        items = sorted(model_dir.items())
    else:
        items = [(p.name, p.read_bytes()) for p in sorted(pathlib.Path(model_dir).iterdir()) if p.is_file()]
    for i, (name, data) in enumerate(items):
        blob = repo / "blobs" / f"blob{i:04d}"
        blob.write_bytes(data)
        (snap / name).symlink_to(pathlib.Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision if ref_text is None else ref_text)
    return root


def _fake_files() -> dict[str, bytes]:
    return {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"weights"}


def _repo(root: pathlib.Path, hf_id: str) -> pathlib.Path:
    return root / ("models--" + hf_id.replace("/", "--"))


def _cut_blob(root: pathlib.Path, hf_id: str, name: str) -> None:
    """An interrupted download of ``name``: its blob renamed ``<blob>.incomplete`` (the link dangles)."""
    link = _repo(root, hf_id) / "snapshots" / HUB_REVISION / name
    blob = link.resolve()
    blob.rename(blob.with_name(blob.name + ".incomplete"))


def _drop_link(root: pathlib.Path, hf_id: str, name: str) -> None:
    """A download interrupted before ``name`` was linked: a ``.incomplete`` blob and no link."""
    link = _repo(root, hf_id) / "snapshots" / HUB_REVISION / name
    blob = link.resolve()
    link.unlink()
    blob.rename(blob.with_name(blob.name + ".incomplete"))


# state -> (how to make it from a complete cache, what resolving it gives: None = the snapshot folder, else a
# regex of the FileNotFoundError / ValueError). Every state is one a user's cache can be in after `hf download`,
# an interrupted download, or a hand edit.
HUB_CACHE_STATES: dict[str, tuple] = {
    "complete": (lambda root, hf_id: None, None),
    "ref with a newline": (lambda root, hf_id: (_repo(root, hf_id) / "refs" / "main").write_text(HUB_REVISION + "\n"),
                           None),
    "ref with CRLF and spaces": (lambda root, hf_id: (_repo(root, hf_id) / "refs" / "main").write_text(
        f"  {HUB_REVISION} \r\n"), None),
    "ref to a missing snapshot": (lambda root, hf_id: (_repo(root, hf_id) / "refs" / "main").write_text("f" * 40),
                                  r"not in the Hugging Face cache.*refs/main holds 'f{40}'.*snapshots: \['0123"),
    "empty ref": (lambda root, hf_id: (_repo(root, hf_id) / "refs" / "main").write_text(""),
                  r"not in the Hugging Face cache.*refs/main holds ''"),
    "no refs": (lambda root, hf_id: (_repo(root, hf_id) / "refs" / "main").unlink(),
                r"not in the Hugging Face cache.*no .*refs/main"),
    "weights blob .incomplete": (lambda root, hf_id: _cut_blob(root, hf_id, "model.safetensors"),
                                 r"model\.safetensors links to a blob that is missing.*interrupted download"),
    "weights never linked": (lambda root, hf_id: _drop_link(root, hf_id, "model.safetensors"),
                             r"no model\.safetensors or model\.safetensors\.index\.json.*1 interrupted download"),
    "config never linked": (lambda root, hf_id: _drop_link(root, hf_id, "config.json"),
                            r"has no config\.json.*interrupted download"),
    "index names a missing shard": (lambda root, hf_id: (
        _repo(root, hf_id) / "snapshots" / HUB_REVISION / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'),
        r"names shard\(s\) \['model-00001-of-00002\.safetensors'\] missing"),
}


def hub_cache_state(root: str | pathlib.Path, state: str, hf_id: str) -> tuple[pathlib.Path, str | None]:
    """A small hub cache at ``root`` (fake config.json and weights bytes: for resolution, not loading)
    in ``state`` (a key of :data:`HUB_CACHE_STATES`); returns ``(root, expected)``."""
    root = hub_cache(root, _fake_files(), hf_id)
    make, expected = HUB_CACHE_STATES[state]
    make(root, hf_id)
    return root, expected
