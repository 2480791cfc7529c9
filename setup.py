"""BehaviorTrace-JAX: training-data attribution for online RL (GRPO) in JAX/Flax NNX.

Pins install together on Python 3.11 (checked on CPU, Nov 2026). Each pin says why.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax==0.10.2",  # jit/vmap/shard_map API used throughout; jaxlib must match exactly.
    "jaxlib==0.10.2",  # CPU wheel; on GPU install jax[cuda12]==0.10.2 on top (README).
    "flax==0.12.8",  # NNX API (nnx.split/merge, nnx.List, nnx.eval_shape) as used by models/decoder.py.
    "optax==0.2.8",  # AdamW + global-norm clipping chain for SFT/GRPO.
    "orbax-checkpoint==0.12.8",  # CheckpointManager API for train-state checkpoints.
    "ml-collections==1.1.0",  # ConfigDict + config_flags for main.py.
    "absl-py==2.5.1",  # flags/logging for main.py.
    "tensorstore==0.1.86",  # zarr sketch arrays (io/sketch_store.py).
    "safetensors==0.8.0",  # lazy safe_open for sharded HF checkpoint loading.
    "tokenizers==0.23.3",  # byte-level BPE for the tiny tokenizer; matches transformers 5.x.
    "transformers>=5.0,<6",  # AutoTokenizer + chat templates; rope_parameters config format.
    "huggingface_hub>=0.34",  # model.hf_id: snapshot_download(local_files_only=True); the `hf` CLI (models/hub.py).
    "numpy>=2.0,<3",  # evaluation layer: PCG64 default_rng streams for bootstrap parity.
    "scipy>=1.13,<2",  # Spearman correlation (metrics.lds_correlation); t and noncentral t (attribution.noise_floor).
    "matplotlib>=3.8,<4",  # report figures (Agg backend).
    "tqdm>=4.66",  # progress bars with ETA for long stages.
    "tensorboardX>=2.6",  # TensorBoard scalars without a TensorFlow dependency.
]

EXTRAS = {
    "test": [
        "pytest>=8,<10",
        # Two test workers on a 2-core machine (pytest.ini: -n auto --dist loadfile); tests/conftest.py
        # shares the smoke run and the compilation cache between them.
        "pytest-xdist>=3.6,<4",
        # tests/conftest.py: the file lock around the shared smoke run (also a huggingface_hub dependency).
        "filelock>=3.12",
        # The PyTorch reference for parity tests. Pinned: 2.13.0 installs as a CPU build here;
        # an unpinned torch pulls a multi-GB CUDA build.
        "torch==2.13.0",
        # Property-based bad-input tests (tests/pipeline/test_bad_input.py).
        "hypothesis>=6.100,<7",
        # A real GCS HTTP server for the gs:// tests (tests/gcs_emulator.py, test_remote_paths,
        # test_gcs_run), and the `gcs` extra's clients they run against it. Pinned: the tests patch four
        # of the emulator's handlers (list offsets, the generation header, generation preconditions on
        # uploads and deletes) and rely on its routes;
        # gcsfs 2026.x needs GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false against an emulator (set there).
        "gcp-storage-emulator==2026.7.19",
        "etils[epath-gcs]",
        "gcsfs>=2026.4,<2027",
        "google-cloud-storage>=3,<4",
    ],
    # The `compile` stage's TPU targets (tpu:v5e:2x4, ...) and TPU VMs: libtpu (~700 MB, so not in
    # the default install or CI). pip install -e '.[tpu]'
    "tpu": ["jax[tpu]==0.10.2"],
    # A gs:// workdir (docs/guides/paper-scale.md): etils' epath reaches gs:// through fsspec + gcsfs, and
    # tensorboardX writes gs:// event files and the workdir lock (io/workdir_lock.py: a generation-matched
    # object) goes through google-cloud-storage; tensorstore's gcs kvstore
    # and orbax need nothing more. pip install -e '.[gcs]'
    "gcs": ["etils[epath-gcs]", "google-cloud-storage>=2"],
}

setup(
    name="behaviortrace_jax",
    version="0.9.0",  # CHANGELOG.md
    description="BehaviorTrace in JAX: does gradient-based data attribution find the GRPO rollouts "
    "that taught a behaviour?",
    license="Apache-2.0",
    python_requires=">=3.11,<3.14",
    packages=find_packages(include=["behaviortrace_jax", "behaviortrace_jax.*"]),
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
