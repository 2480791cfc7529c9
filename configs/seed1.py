"""Paper scale, training seed 1 (configs/paper.py; SPEC §10.2: seeds 0, 1, 2).

    python main.py --config=configs/seed1.py --config.model.hf_dir=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/seed1
"""
from configs import paper


def get_config():
    return paper.get_config(seed=1)
