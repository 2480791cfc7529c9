"""Layer 1, ``models``: the policy network and everything that runs it. The model families
(``families``: registry by HF ``model_type``; ``decoder``: the one decoder they share and its pure
forward functions; ``qwen2``, ``llama``, ``qwen3``: config, module and HF weight rows
each), HF safetensors import/export by weight table (``hf_io``), mesh and partition rules (``sharding``),
tokenizer loading and the EOS set (``tokenizer``), the jitted KV-cache sampler
(``sampler``), :func:`loader.load_policy`, the one way a stage puts a checkpoint on the mesh, and
``programs``: the names of every jitted program a run compiles and the ``jit`` that makes them.
Imports: ``io`` only.
"""
