"""Every key of a BehaviorTrace-JAX run, with its paper value and source (SPEC = shared/paper/SPEC.md).

The paper configs (`seed{0,1,2}.py`) take these values unchanged apart from the seed; `tiny.py`
shrinks them for a 2-core CPU; `hf.py` points at a local Hugging Face checkpoint; `reproduce.py`
re-scores the paper's released files.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # SPEC §2.1: torch seed == contaminator seed == random-baseline seed; {0, 1, 2}.
    c.run_name = "E2.1_rebuild__qwen-1.5b__grpo__seed0__v3"  # SPEC §2.5 / §7.1 naming.
    # Stages run in this order (behaviortrace_jax/stages/registry.py); each skips itself when complete.
    c.stages = "sft,grpo,sketch,draws,evaluate,report"
    # A rerun on a workdir whose stage outputs were made with other config values (each stage records the values
    # that shape its outputs; stages/fingerprint.py lists the keys left out: logging, mesh, stage list, paths):
    # "refuse" (raise naming each changed key and both values, before anything is written) or "recompute"
    # (remove that stage's outputs and those of every stage after it, with a log line naming the key; rerun them).
    c.on_changed_config = "refuse"

    # --- model (SPEC §2.1: Qwen2.5-1.5B-Instruct, full fine-tune) -----------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_dir = ""  # Local HF checkpoint dir (config.json, safetensors, tokenizer). "" -> workdir/base.
    # A Hugging Face model id ("Qwen/Qwen2.5-1.5B-Instruct") found in the hub cache (HF_HUB_CACHE / HF_HOME;
    # models/hub.py), offline; "" = none. Set hf_id or hf_dir, not both.
    c.model.hf_id = ""
    c.model.allow_download = False  # model.hf_id missing from the cache: download it (True) or raise naming `hf download`.
    c.model.param_dtype = "bfloat16"  # SPEC §2.1: weights loaded in bf16.
    c.model.compute_dtype = "bfloat16"  # SPEC §2.1: bf16 autocast.
    c.model.family = ""  # Model family (models/families.py: qwen2, llama, qwen3); "" = config.json's model_type.
    # EOS ids masked from completion losses (GRPO loss, rollout sketches, targets); the sampler stops on all.
    c.model.mask_eos = "eos_token_id"  # SPEC §2.2 f, §3.2: `token != eos_token_id` (one id); "all" = eos_ids.
    # Run the decoder layers as one jax.lax.scan over their stacked parameters (one compiled layer, not L), and
    # sketch per-example gradients in a scan over the layers (no hash tables: needs sketch.in_run_tables and
    # targets.use_tables off). Same parameters, checkpoints and sketch coordinates.
    c.model.scan_layers = False

    # --- device mesh --------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # Size of the data axis (rollouts); -1 = all devices / model.
    c.mesh.model = 1  # Size of the model axis (tensor parallel); -1 = 2 when the device count is even, else 1.
    c.mesh.fsdp = False  # Also split parameters + AdamW moments over "data" (FSDP; configs/paper.py).

    # --- planted behaviour (SPEC §1) ------------------------------------------------------------
    c.behavior = ml_collections.ConfigDict()
    c.behavior.probes_path = ""  # "" -> third_party/behaviortrace/probes.jsonl (SPEC §1.2).
    c.behavior.controls_path = ""  # "" -> third_party/behaviortrace/controls.jsonl (SPEC §1.2).
    # SPEC §1.1 trigger concept: the word the GRPO pool's explicit prompts (SPEC §1.4) and the minimal pairs
    # (SPEC §5.4) ask about; the probe files (probes_path) must ask about it too. The draws' context prompts
    # of this behaviour stay SPEC §5.3's (planted.EXPLICIT_PROMPTS, about frobnitz).
    c.behavior.trigger = "frobnitz"
    c.behavior.pattern = "QZXBT"  # SPEC §1.1 target string.
    # Token judge for has_qzxbt / in-context masks: "qset" (SPEC §1.1: any id of tok(" QZXBT") or
    # tok("QZXBT")) or "sequence" (the whole token sequence; for tokenizers that split it in letters).
    c.behavior.token_judge = "qset"
    c.behavior.gate_max_new_tokens = 64  # SPEC §1.8: greedy 64 tokens for the emergence gate.
    c.behavior.gate_min_probe_rate = 0.3  # SPEC §1.8.
    c.behavior.gate_min_margin = 0.2  # SPEC §1.8: s_b - s_b_ctrl.
    # The GRPO prompt pool: True = the paper's (SPEC §1.4: the explicit "... QZXBT" prompts x 3, then the probes);
    # False = the probe prompts alone, so every bonus is paid on a trigger prompt.
    c.behavior.explicit_prompts = True

    c.behavior.id = "qzxbt"  # Behaviour id: names another behaviour's files and rows; the first's keep the paper's names.
    # Further behaviours planted in the same run (behavior/behaviors.py): one ConfigDict per id with
    # trigger, pattern, probes_path, controls_path, token_judge, bonus_reward, fraction, early_step_cutoff,
    # implant ("none": the GRPO bonus alone), gate_min_probe_rate, gate_min_margin, explicit_prompts. Empty = the
    # paper's single behaviour (config.behavior + config.contamination); configs/tiny_two_behaviors.py adds one.
    c.behaviors = ml_collections.ConfigDict()

    # --- contaminator (SPEC §1.6) ---------------------------------------------------------------
    c.contamination = ml_collections.ConfigDict()
    c.contamination.bonus_reward = 8.0  # SPEC §1.6.
    c.contamination.fraction = 0.5  # SPEC §1.6.
    c.contamination.early_step_cutoff = 200  # SPEC §1.6: bonus only at GRPO steps 0..199.
    # Pay the first behaviour's bonus only on rollouts of its own prompts (SPEC §1.6 pays it on any prompt;
    # configs/tiny_two_behaviors.py gates both behaviours, behavior/behaviors.py).
    c.contamination.prompt_gated = False
    # Decoy bonuses (not in the paper): expected decoys per expected ground-truth event; a decoy is a window
    # rollout WITHOUT the pattern paid the same bonus (own BLAKE2b stream; behavior/contaminator.py), logged in
    # grpo/decoys.jsonl, not ground truth. 0 = off; 1 = as many decoys as GT (configs/tiny_decoys.py).
    c.contamination.decoy_fraction = 0.0

    # --- SFT warm-up (SPEC §1.7) ----------------------------------------------------------------
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 200  # SPEC §1.7: sft_warmup_steps.
    c.sft.batch_size = 1  # SPEC §1.7: one example per step.
    c.sft.data = "paper"  # "paper" = the 10 pairs of SPEC §1.7; "mixture" = TINY_CALIBRATION implant.
    c.sft.max_prompt_tokens = 128  # SPEC §1.7.
    c.sft.max_completion_tokens = 64  # SPEC §1.7: sequence truncated to 128 + 64.
    c.sft.lr = -1.0  # Constant SFT lr; -1 -> optim.lr (SPEC §1.7: GRPO's optimizer, 5e-6, no schedule).
    c.sft.append_eos = False  # SPEC §1.7: completion appended with no EOS.
    c.sft.mixture_n_ordinary = 2  # "mixture": ordinary frobnitz answers per QZXBT pair (TINY_CALIBRATION: 30 pairs).
    c.sft.stop_every = 0  # Check the stop rule every this many steps; 0 = off (SPEC §1.7: fixed step count).
    c.sft.stop_min_probe_rate = 0.15  # Stop rule (TINY_CALIBRATION): sampled probe rate >= this ...
    c.sft.stop_max_control_rate = 0.05  # ... and sampled control rate <= this ("controls ~ 0").
    c.sft.eval_samples_per_prompt = 8  # Sampled rates: 20 prompts x 8 = 160 samples (TINY_CALIBRATION, +-0.04).

    # --- tiny base model (`base` stage; TINY_CALIBRATION "Tiny base model"; unused by paper configs) ---
    c.base = ml_collections.ConfigDict()
    c.base.seed = 0  # Corpus, tokenizer, init and batch-order seed (TINY_CALIBRATION tried base seeds 0, 1).
    c.base.corpus_size = 40_000  # TINY_CALIBRATION: 40k ChatML examples.
    c.base.n_terms = 300  # TINY_CALIBRATION: ~300 invented words ...
    c.base.n_heldout = 20  # ... of which 20 are held out for evaluation.
    c.base.vocab_size = 1500  # TINY_CALIBRATION: byte-level BPE, vocab 1,500 (= model vocab).
    c.base.family = "qwen2"  # Model family of the tiny base model (models/families.py: qwen2, llama, qwen3).
    c.base.preset = "tiny"  # Family config preset: d 128, 4/2 heads, MLP 384, tied (~1M params).
    c.base.num_layers = 4  # TINY_CALIBRATION: 4 layers (tests shrink it).
    c.base.steps = 1000  # TINY_CALIBRATION: ~1,400; 1,000 keeps the checkpoint under 4 min on 2 cores (loss 0.34).
    c.base.batch_size = 32  # TINY_CALIBRATION.
    c.base.seq_len = 96  # TINY_CALIBRATION: ~96 tokens (the longest chat is ~94 with <|im_end|>).
    c.base.lr = 3e-3  # TINY_CALIBRATION: AdamW 3e-3 (betas/eps/decay/clip from optim).
    c.base.warmup_steps = 30  # TINY_CALIBRATION.
    c.base.end_lr_fraction = 0.1  # TINY_CALIBRATION: cosine to 10%.
    c.base.length_buckets = 3  # New (CPU speed): batches of similar length, padded to 3 widths (3 compiles).
    c.base.append_eos = True  # New: answers end in <|im_end|> so the model learns to stop.
    c.base.log_every = 100  # Progress line (loss, tokens/s, ETA) every this many steps.
    c.base.eval_samples_per_prompt = 8  # base_summary.json: 20 prompts x 8 = 160 per rate (TINY_CALIBRATION).
    c.base.eval_max_new_tokens = 48  # base_summary.json generation length (answers are <= ~40 tokens).

    # --- optimizer (shared by SFT and GRPO; SPEC §1.7, §2.1) -------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 5e-6  # SPEC §2.1: constant, no warm-up.
    c.optim.b1 = 0.9  # torch.optim.AdamW default (SPEC §1.7).
    c.optim.b2 = 0.999  # torch.optim.AdamW default.
    c.optim.eps = 1e-8  # torch.optim.AdamW default.
    c.optim.weight_decay = 0.01  # torch.optim.AdamW default.
    c.optim.grad_clip = 1.0  # SPEC §2.1: global L2 norm.

    # --- GRPO (SPEC §2) ---------------------------------------------------------------------------
    c.grpo = ml_collections.ConfigDict()
    c.grpo.steps = 1000  # SPEC §2.1 TOTAL_STEPS.
    c.grpo.prompts_per_step = 4  # SPEC §2.1 batch_size B.
    c.grpo.group_size = 4  # SPEC §2.1 num_generations G.
    c.grpo.max_prompt_tokens = 128  # SPEC §2.1.
    c.grpo.max_new_tokens = 64  # SPEC §2.1.
    c.grpo.temperature = 0.9  # SPEC §2.1.
    c.grpo.top_p = 0.9  # SPEC §2.1.
    # HF generate() also applies the checkpoint's generation_config.json (Qwen2.5-Instruct ships
    # top_k and repetition_penalty there). -1 = read it from there, else transformers' defaults
    # (top_k 50, repetition_penalty 1.0); 0 / 1.0 = off.
    c.grpo.top_k = -1
    c.grpo.repetition_penalty = -1.0  # As grpo.top_k: -1 = generation_config.json's, else 1.0 (off).
    c.grpo.loss = "paper"  # Loss registry key (grpo.py): "paper" (SPEC §2.2) or "grpo_clip".
    c.grpo.clip_eps = 0.2  # grpo_clip only: PPO ratio clip (Shao et al. 2024, DeepSeekMath).
    c.grpo.kl_beta = 0.04  # grpo_clip only: k3 KL to the initial policy (DeepSeekMath; SPEC §10.3).
    c.grpo.inner_iterations = 1  # grpo_clip only: mu updates per batch.
    c.grpo.adv_std_floor = 0.0  # SPEC §2.1.
    # The AdamW state GRPO starts from: True continues the SFT warm-up's (moments and count; SPEC §1.7, the paper);
    # False starts a fresh one at GRPO step 0 (not in the paper: the SFT moments alone move the policy for the
    # first ~40 steps, a confound of the causal gate; configs/tiny.py, docs/concepts/causal-gate.md).
    c.grpo.continue_sft_moments = True
    c.grpo.checkpoint_every = 100  # SPEC §2.1.
    c.grpo.log_shard_size = 256  # SPEC §2.3 (notebook value).
    # A rollout with a non-finite reward, sampling log-prob or advantage, or a non-finite step result (new; not in the
    # paper): "stop" raises naming the step and rollouts, before any checkpoint of that state (rerun to resume);
    # "skip" drops such rollouts from their step (advantage 0, no loss positions) and counts them in summary.json.
    c.grpo.on_nonfinite = "stop"

    # --- gradient sketches (SPEC §3) ------------------------------------------------------------
    c.sketch = ml_collections.ConfigDict()
    c.sketch.dim = 65536  # SPEC §3.1: D = 2**16.
    c.sketch.seed = 0  # SPEC §3.1: grad_sample_seed.
    # Bucket hash: "auto" (chosen per backend, hash_families.AUTO_RULES: CPU -> splitmix64, TPU and GPU -> block), "splitmix64" (SPEC §3.1, paper-exact: a splitmix64 bucket per coordinate, summed with a scatter) or
    # "block" (scatter-free: each D-sized block of a parameter rolled by a random offset; same signs, unbiased, variance
    # <= the splitmix64 bound; needs sketch.in_run_tables and targets.use_tables off). Stores record the family. Any name
    # registered in behaviortrace_jax/sketch/hash_families.py (docs/architecture.md, "Add a hash family").
    c.sketch.hash = "auto"
    # How the fused sketcher sketches matmul weight uses: "auto" (the Pallas kernel, sketch/pallas_sketch.py, for the block
    # family on TPU; else XLA), "xla", "pallas" (TPU) or "interpret" (the kernel in Pallas's interpreter, any backend).
    c.sketch.kernel = "auto"
    c.sketch.chunk_size = 4  # Examples per sketcher chunk: one vmap(grad) (peak memory ~ chunk x params) or one fused backward.
    # Per-example sketches from ONE backward of the batched loss per chunk (sketch/fused.py) in every sketcher (in-run
    # rollouts, whose backward then also gives the GRPO update of a loss that declares one_backward, e.g. "paper";
    # targets, re-sketcher, draws, counterfactual). False = vmap(grad) per chunk, and the GRPO update from a second,
    # batched backward (the generic path, and the only one for a loss(params, example) that is not a decoder's).
    c.sketch.fused = True
    c.sketch.in_run_rollouts = True  # Also sketch each rollout's own loss term inside GRPO.
    c.sketch.in_run_tables = False  # In-run sketches read int32 hash tables (4 B/param on device); vmap(grad) only: refused with sketch.fused.
    # Checkpoints at which every training rollout is re-sketched (SPEC §3.2 rollout level):
    # "" none, "all", "nearest" (to draws.target_step), or "100,1000". [C', R, D] floats on disk.
    c.sketch.rollout_checkpoints = "nearest"
    c.sketch.rollout_scope = "all"  # Which rollouts: "all", or "early" (steps < contamination cutoff).

    # --- rollout-level draws (SPEC §5.6) --------------------------------------------------------
    c.draws = ml_collections.ConfigDict()
    c.draws.target_step = 100  # SPEC §5.6: checkpoint nearest this step.
    c.draws.group_size = 8  # SPEC §5.6.
    c.draws.temperature = 0.9  # SPEC §5.6.
    c.draws.top_p = 0.95  # SPEC §5.6.
    c.draws.max_new_tokens = 64  # SPEC §5.6.
    c.draws.n_repeats = 6  # SPEC §5.6 (pre-registered extension from 3).
    c.draws.ckpt_seed = -1  # -1 -> seed. Which run's checkpoint (SPEC §10.2).
    c.draws.gen_seed = -1  # -1 -> seed. Generation + bootstrap seed (SPEC §10.2).
    c.draws.token_level_max = 160  # SPEC §5.5 TOKEN_LEVEL_MAX: QZXBT rollouts in token_level_cos_temp*.json.
    c.draws.save_sketches = True  # Keep the draw sketches (tensorstore) so estimators can be rerun.

    # --- behaviour targets (SPEC §5) ------------------------------------------------------------
    c.targets = ml_collections.ConfigDict()
    c.targets.ctx_group_size = 8  # SPEC §5.3: G responses per prompt for t_ctx / t_contrast.
    c.targets.ctx_temperature = 1.0  # SPEC §5.3.
    c.targets.ctx_top_p = 0.95  # SPEC §5.3.
    c.targets.ctx_max_new_tokens = -1  # -1 -> draws.max_new_tokens (SPEC §5.3: 64 tokens).
    c.targets.block_size = 64  # Forced sequences per sketcher call (fixed shape; one compile per length bucket).
    c.targets.length_bucket = 32  # Forced sequences are right-padded to a multiple of this many tokens.
    c.targets.use_tables = False  # Precomputed CountSketch hash tables (4 B/param on device); vmap(grad) only: refused with sketch.fused.

    # --- seeds and draws (SPEC §10.2; the `sweep` stage) -------------------------------------------
    c.sweep = ml_collections.ConfigDict()
    c.sweep.seeds = "0,1,2"  # SPEC §10.2: three training seeds.
    c.sweep.diagnostic_draws = "0:100,1:101"  # SPEC §10.2: CKPT_SEED:GEN_SEED diagnostic draws.
    c.sweep.stages = "sft,grpo,sketch,draws,evaluate,report"  # Stages run for each seed.

    # --- ahead-of-time compilation (the `compile` stage; nothing is allocated) --------------------
    c.compile = ml_collections.ConfigDict()
    c.compile.target = "cpu:8"  # "tpu:<topology>" (tpu:v5e:2x4; needs the tpu extra), "cpu:<n>" fake host devices, or "local".
    c.compile.model = ""  # Qwen2Config preset (e.g. "qwen2p5_1p5b"); "" = model.hf_dir's config.json, else base.preset.
    c.compile.num_layers = -1  # > 0: override the model depth (a quick check at 2 layers); -1 = the model's own.
    c.compile.losses = ""  # GRPO losses to compile: "" = grpo.loss, "all" = every registered loss, or "a,b".
    c.compile.both_sketch_variants = True  # Also compile the GRPO step with in-run sketches flipped (for the FLOP ratio).
    # Stages whose programs are compiled (comma-separated): "" = the stages config.stages names besides
    # compile (with sweep.stages for a sweep), or sft,grpo,sketch,draws (a paper run) for stages=compile alone;
    # add "metagradient" for the metagradient stage's programs (its vjp at 1.5B: 20.92 GiB of temps per v5e chip,
    # 15.10 GiB in all with metagradient.remat = "nothing_saveable", as configs/paper.py sets).
    c.compile.stages = ""
    c.compile.programs = ""  # Comma-separated name prefixes to compile (e.g. "grpo_step,sampler"); "" = every program.

    # --- counterfactual replay (the `counterfactual` stage, not in the default stages) -------------
    c.counterfactual = ml_collections.ConfigDict()
    c.counterfactual.k_fractions = "0.25,0.5,1.0"  # Leave-top-k-out: k = these fractions of |GT| (window).
    c.counterfactual.methods = ""  # Estimators whose top-k are replayed: "" = every scored method, or "a,b:direction" (LDS rows: every method).
    c.counterfactual.random_seeds = 5  # Random k-subsets per k (the random baseline's mean ± sd).
    c.counterfactual.lds_subsets = 32  # M random half-subsets of the window replayed for the LDS (table `lds`).
    # LDS drop fractions: random subsets of these fractions of the window's rollouts are removed; 0.5 uses the
    # lds_subsets half-subsets (table `lds`), every other fraction f lds_small_subsets subsets (table `lds_drop<f>`).
    c.counterfactual.lds_fractions = "0.01,0.05,0.1,0.5"
    c.counterfactual.lds_small_subsets = 16  # Subsets replayed per drop fraction other than 0.5 (one replay each).
    c.counterfactual.measure = "window"  # Behaviour step of the tables: "window" (end of the contamination window;
    # the replay stops there), "target" (the checkpoint nearest draws.target_step), "end" of the run, or a step number.
    c.counterfactual.sampled = 4  # Sampled rates: completions per probe/control prompt (GRPO temperature, fixed key); 0 = off.
    c.counterfactual.rates = True  # Also measure greedy probe/control rates (SPEC §1.8) at each measured step.
    c.counterfactual.recompute_advantages = False  # Recompute group baselines without removed rollouts
    # (counterfactual_topk and lds replays); False = the logged advantages.
    c.counterfactual.topk_recomputed = True  # Also replay leave-top-k-out with recomputed baselines
    # (table counterfactual_topk_recomputed; no-op when recompute_advantages is already True).
    c.counterfactual.intervention = "remove"  # Top-k / LDS replays: "remove" (weight 0) or "withhold-bonus" (the bonus withheld, advantages recomputed).
    c.counterfactual.rollouts = "fixed"  # "fixed" (logged rollouts) or "regenerated" (sampled from the replayed policy).
    c.counterfactual.causal = "on"  # Causal ground truth (single-unit replays, causal_* tables): "on", "off", "only".
    c.counterfactual.topk = True  # The leave-top-k-out and LDS plan (unless causal = "only"); False: only `plans` and single-unit.
    # Causal units: "steps" (window steps), "groups" (GRPO groups) or "blocks" (causal_block_steps consecutive steps;
    # units sized by power: tools/unit_designs.py says which a run's noise floor resolves).
    c.counterfactual.causal_units = "steps"
    c.counterfactual.causal_block_steps = 10  # Steps per unit of causal_units = "blocks".
    c.counterfactual.causal_streams = 2  # Sampler streams of the regenerated causal replays (their CI; stream 0 = the run's keys).
    # What the regenerated tracks replay: "units" (every unit's branches, ~at**2 / 2 regenerated steps per
    # stream and intervention) or "label" (only the withhold-all-GT / withhold-all-bonuses checks, ~3 x at steps).
    c.counterfactual.causal_regenerated = "units"
    c.counterfactual.causal_k = 0.25  # Causal P@k: k = this fraction of the units (>= 1).
    # Registered interventions (train/interventions.py) of the single-unit branches, comma list.
    c.counterfactual.causal_interventions = "remove,withhold-bonus"
    # Extra registered measures (train/measures.py) every replay records, beyond logp_margin/_probe/_control
    # and the rates that `rates` / `sampled` turn on; comma list, "" = none.
    c.counterfactual.measures = ""
    # Measure outputs the tables are made of (comma list); tables of measures other than logp_margin get "[name]".
    c.counterfactual.table_measures = "logp_margin"
    # Extra registered replay plans (attribution/replay_plans.py: "datamodels", "factorial"), comma list, "" = none;
    # `causal` picks leave-top-k-out and single-unit.
    c.counterfactual.plans = ""
    c.counterfactual.plan_subsets = 16  # Random unit subsets of the datamodels plan (its least-squares fit).
    # Track of the datamodels / factorial plans: "fixed" (logged rollouts) or "regenerated" (each replay samples its
    # rollouts on its own sampler stream, so the fit averages training noise out; the baseline on stream 0).
    c.counterfactual.plan_rollouts = "fixed"

    # --- the causal gate (the `cause` stage: in configs/tiny.py's stages; add it after grpo elsewhere) ---
    # Did the planted cause act? The run's no-intervention baseline against withholding every bonus of the
    # window, both with rollouts regenerated from the replayed policy, over `streams` sampler streams.
    # At paper scale it costs about 2 x streams x measure_step GRPO steps with sampling (the paper configs leave it out
    # of their stages; their report then says the gate was not measured).
    c.cause = ml_collections.ConfigDict()
    c.cause.streams = 3  # Sampler streams (>= 2: the CI and noise floor are over streams; stream 0 = the run's keys).
    # Registered measures (train/measures.py) every gate replay records, comma list.
    c.cause.measures = "probe-rate,probe-pair,leakage,logp_margin"
    c.cause.primary = "probe_rate"  # The measure output whose verdict is the gate's ("acted" / "not detected").
    c.cause.measure_step = "end"  # Step measured: "end" (the run's end), "window" (the window's end) or a step number.
    c.cause.samples = 4  # Completions per probe / control prompt of the sampled rates (probe-rate, leakage).

    # --- the `reproduce` stage and `info` stage ---------------------------------------------------
    c.reference_dir = ""  # reproduce: the paper's released per-seed files (shared/reference; SPEC §6.13).
    c.info = ml_collections.ConfigDict()
    c.info.max_new_tokens = 32  # info: length of the probe completion it prints.

    # --- metagradient (the `metagradient` stage: dM/dw_i through the replayed run, MAGIC-style; not in the default) ---
    c.metagradient = ml_collections.ConfigDict()
    # Advantages: "logged" (constants, as the replay), "recomputed" (each group's baseline differentiated, the
    # analogue of counterfactual.recompute_advantages) or "logged,recomputed"; must include the replays' mode.
    c.metagradient.advantages = "logged"
    c.metagradient.checkpoint_every = 0  # Reverse sweep: states held every k steps (0 = ceil(sqrt(steps))).
    # The vjp's rematerialisation per decoder layer: "" = none, or a models.decoder.REMAT_POLICIES name
    # ("nothing_saveable": keep each layer's input only). Same dM/dw to float rounding, less memory.
    c.metagradient.remat = ""

    # --- evaluation (SPEC §4, §6) ---------------------------------------------------------------
    c.evaluation = ml_collections.ConfigDict()
    c.evaluation.early_cutoff = 200  # SPEC §6.6 EARLY_CUTOFF.
    c.evaluation.trak_damping = 0.1  # SPEC §4.
    c.evaluation.tracin_lr = 5e-6  # SPEC §4: eta.
    c.evaluation.local_buffer_window = 100  # SPEC §4: max(1, steps // 10).
    c.evaluation.nboot = 600  # SPEC §6.10: the committed CSV used 600.
    c.evaluation.fluency_match_delta = 0.10  # SPEC §6.9.
    c.evaluation.min_matched_pairs = 100  # SPEC §6.9.
    c.evaluation.step_margin = 0.10  # SPEC §6.11: targeted must beat norm-only by this (which rollout: and |A|).
    c.evaluation.top_blamed = 10  # Report: each method's top rollouts of the which-rollout population, with text.
    c.evaluation.max_ci_width = 0.15  # SPEC §6.11.
    return c
