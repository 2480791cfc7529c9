"""Layer 1, ``models``: the policy network and everything that runs it. The Qwen2 NNX module
(``qwen2``), HF safetensors import/export by weight table (``hf_io``), mesh and partition rules
(``sharding``), tokenizer loading and the EOS set (``tokenizer``), the jitted KV-cache sampler
(``sampler``) and :func:`loader.load_policy`, the one way a stage puts a checkpoint on the mesh.
Imports: ``io`` only.
"""
