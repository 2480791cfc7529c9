"""Load any local Qwen2 Hugging Face checkpoint and print what the harness sees (the `info` stage).

    python main.py --config=configs/hf.py --config.model.hf_dir=DIR --workdir=W

Prints the parameter count, devices and mesh, and a greedy completion of the first probe prompt.
DIR holds config.json, model.safetensors (or a sharded index) and tokenizer files, e.g. a
directory written by transformers' `save_pretrained`. A model in the Hugging Face cache (after
`hf download Qwen/Qwen2.5-1.5B-Instruct`) loads by name, offline, instead of DIR:

    python main.py --config=configs/hf.py --config.model.hf_id=Qwen/Qwen2.5-1.5B-Instruct --workdir=W
"""
from configs import common


def get_config():
    c = common.get_config()
    c.stages = "info"
    c.model.param_dtype = "float32"  # Exact on CPU; use bfloat16 on an accelerator.
    c.model.compute_dtype = "float32"
    c.info.max_new_tokens = 32  # Greedy tokens for the probe completion.
    return c
