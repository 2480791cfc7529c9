"""Layer 6, ``stages``: the pipeline's stages, one module each, and their ``registry``. A stage is a
function ``stage(config, workdir)`` registered with ``@registry.register_stage(name)``: ``info``,
``base``, ``sft``, ``grpo``, ``sketch``, ``draws``, ``evaluate`` (and ``report``), ``reproduce``,
``sweep``, ``status`` (reads only). Imports: every layer below (``io``, ``models``, ``attribution``, ``behavior``, ``sketch``,
``train``, ``aot``) and, of its own folder, only ``registry``, ``spec`` (the run's typed
``RunSpec``, built from the config at the stage boundary) and ``fingerprint`` (what made each
stage's outputs): never another stage module; a stage that
runs other stages (``sweep``) calls them by name through ``registry.STAGES``.
"""
