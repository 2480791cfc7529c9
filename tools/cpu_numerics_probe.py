#!/usr/bin/env python3
"""Digests of the numeric building blocks of a run, to find which one depends on the CPU.

Run it on two machines and diff the outputs: the first line that differs names the primitive whose
result depends on the CPU (docs/reproducibility.md has this probe's output from the machines
measured so far). Inputs are fixed (numpy PCG64, seed 0); a digest is the first 16 hex digits of
the sha256 of the result's bytes.

    python tools/cpu_numerics_probe.py              # main.py's caps (XLA at AVX2, numpy without AVX-512, OpenBLAS Haswell)
    python tools/cpu_numerics_probe.py --native     # without them
    python tools/cpu_numerics_probe.py --matrix     # every --variant below in its own process, one table

Sections (each line ``name  digest``):

* ``primitives``: numpy / OpenBLAS products and XLA:CPU matmuls, reductions, transcendental
  functions, softmax, attention, a gradient, an AdamW update, jax.random (the same names and
  inputs as the first probe, ``shared/tools/cpu_numerics_probe.py``, so old outputs still diff).
* ``dots``: the tiny model's matmul shapes by the library XLA:CPU hands them to: a product whose
  left operand is in canonical layout runs in YNNPACK (``__ynn_fusion``); a weight gradient, which
  contracts the token axis (``x^T dy``), compiled alone, is a plain ``dot`` run by Eigen's tensor
  contraction with oneDNN's sgemm as its kernel (inside the train step XLA lays it out for
  YNNPACK: the ``base`` section counts). ``K block`` names the depth block that reproduces each
  library's result bit for bit (a float32 FMA emulation in numpy).
* ``base``: the smoke config's ``base`` stage through its real code path (corpus, tokenizer,
  packed data, initial weights, how many of the train step's dots run in YNNPACK, the first
  batch's logits, loss and per-tensor gradients, and the weights after each of its 4 updates; the
  first update has learning rate 0, warm-up): where two machines' base weights part.

``--variant`` (what one machine can vary to stand in for another CPU type): ``default``,
``native`` (no caps), ``avx`` (XLA capped at AVX: no FMA in XLA's own code), ``onednn_avx2``
(``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's AVX2 sgemm, as on an AVX2-only CPU), ``one_cpu`` (this process
pinned to one CPU: XLA's thread pool has one thread), ``no_ynnpack``
(``--xla_cpu_experimental_ynn_fusion_type=``: every dot to Eigen/oneDNN), ``portable_dots`` (that,
with oneDNN capped at AVX2: the candidate whose dots do not follow the CPU beyond AVX2).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPS = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "NPY_DISABLE_CPU_FEATURES": "X86_V4,AVX512_ICL,AVX512_SPR",
        "OPENBLAS_CORETYPE": "Haswell"}  # main.py's (behaviortrace_jax/runtime.py), as the first probe sets them
VARIANTS = {
    "default": {},
    "native": None,  # no caps at all
    "avx": {"XLA_FLAGS": "--xla_cpu_max_isa=AVX"},
    "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "one_cpu": {},  # plus sched_setaffinity to one CPU, before JAX starts
    "no_ynnpack": {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --xla_cpu_experimental_ynn_fusion_type="},
    "portable_dots": {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --xla_cpu_experimental_ynn_fusion_type=",
                      "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def variant_env(name: str, environ: dict) -> dict:
    """The environment for ``--variant name`` (main.py's caps, then the variant's changes)."""
    if name not in VARIANTS:
        raise SystemExit(f"--variant {name!r}: expected one of {', '.join(VARIANTS)}")
    env = {k: v for k, v in environ.items() if k not in CAPS and k != "ONEDNN_MAX_CPU_ISA"}
    if VARIANTS[name] is not None:
        env.update(CAPS)
        env.update(VARIANTS[name])
    return env


def h(x) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:16]


def primitives(out: list[str]) -> None:
    """The first probe's lines (same names, inputs and order)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    rec = lambda name, x: out.append(f"{name:<34} {h(x)}")  # noqa: E731
    rec("numpy normal(1000)", rng.standard_normal(1000))
    a64 = rng.standard_normal((300, 700)); b64 = rng.standard_normal((700, 200))
    rec("numpy f64 matmul 300x700x200", a64 @ b64)
    rec("numpy f32 matmul 300x700x200", a64.astype(np.float32) @ b64.astype(np.float32))
    rec("numpy f64 sum 1e6", rng.standard_normal(1_000_000).sum())
    for k in (64, 256, 1024, 4096):
        x = jnp.asarray(rng.standard_normal((128, k)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((k, 128)), jnp.float32)
        rec(f"jax f32 matmul 128x{k}x128", jax.jit(jnp.matmul)(x, y))
    x = jnp.asarray(rng.standard_normal((16, 96, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((128, 1500)), jnp.float32)
    rec("jax f32 einsum btd,dv (logits)", jax.jit(lambda x, w: jnp.einsum("btd,dv->btv", x, w))(x, w))
    v = jnp.asarray(rng.standard_normal(1_000_000), jnp.float32)
    rec("jax f32 sum 1e6", jax.jit(jnp.sum)(v))
    rec("jax f32 exp", jax.jit(jnp.exp)(v)); rec("jax f32 tanh", jax.jit(jnp.tanh)(v))
    rec("jax f32 log|x|", jax.jit(lambda t: jnp.log(jnp.abs(t) + 1e-3))(v))
    rec("jax f32 rsqrt", jax.jit(lambda t: jax.lax.rsqrt(jnp.abs(t) + 1e-3))(v))
    lg = jnp.asarray(rng.standard_normal((1536, 1500)), jnp.float32)
    rec("jax f32 log_softmax 1536x1500", jax.jit(jax.nn.log_softmax)(lg))
    rec("jax f32 logsumexp", jax.jit(lambda t: jax.nn.logsumexp(t, -1))(lg))
    hs = jnp.asarray(rng.standard_normal((16, 96, 128)), jnp.float32)
    rec("jax f32 rmsnorm", jax.jit(lambda t: t * jax.lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + 1e-6))(hs))
    q = jnp.asarray(rng.standard_normal((16, 4, 96, 32)), jnp.float32)
    rec("jax f32 attention", jax.jit(lambda q: jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, q) / 5.66, -1) @ q)(q))
    w1 = jnp.asarray(rng.standard_normal((128, 384)) * 0.05, jnp.float32)
    mlp_loss = lambda W, x: jnp.mean(jax.nn.silu(x @ W) ** 2)  # noqa: E731
    g = jax.jit(jax.grad(mlp_loss))(w1, hs.reshape(-1, 128))
    rec("jax f32 grad silu-mlp", g)
    opt = optax.adamw(1e-3)
    rec("optax adamw update", jax.jit(opt.update)(g, opt.init(w1), w1)[0])
    key = jax.random.key(0)
    rec("jax random categorical", jax.random.categorical(key, lg[:64]))
    rec("jax random normal", jax.random.normal(key, (1000,)))


def emulated_blocked_dot(a, b, kc: int):
    """float32 ``a.T @ b`` ([K, M], [K, N] -> [M, N]) summed as Eigen's blocked contraction does:
    K cut in blocks of ``kc``; within a block, one fused multiply-add per k in order (emulated in
    float64, then rounded to float32); each block's sum added to the result."""
    import numpy as np

    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    c = np.zeros((a.shape[1], b.shape[1]), np.float32)
    for start in range(0, a.shape[0], kc):
        acc = np.zeros_like(c)
        for k in range(start, min(start + kc, a.shape[0])):
            acc = (a64[k, :, None] * b64[k, None, :] + acc).astype(np.float32)
        c = c + acc
    return c


def dots(out: list[str]) -> None:
    """The tiny models' matmul shapes, the library each runs in, and the depth blocks here."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    # (tokens, in, out): smoke base batch 8 x 200, tiny default 32 x 96; d 128, MLP 384, vocab 300 / 1500
    for t, d_in, d_out in ((1600, 128, 384), (1600, 384, 128), (1600, 128, 300), (3072, 128, 1500)):
        x = jnp.asarray(rng.standard_normal((t, d_in)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((t, d_out)), jnp.float32)
        for name, f, args in (("xW", lambda x, w: x @ w, (x, w)),
                              ("xTdy", lambda x, dy: jnp.einsum("tk,tn->kn", x, dy), (x, dy))):
            compiled = jax.jit(f).lower(*args).compile()
            lib = library(compiled.as_text())
            out.append(f"{f'dot {name} {t}x{d_in}x{d_out} {lib}':<34} {h(compiled(*args))}")
    k, m, n = 1600, 96, 64
    a = rng.standard_normal((k, m)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    for name, f, args, lhs in (("ynnpack K block (mk,kn)", jnp.matmul, (a.T.copy(), b), a),
                               ("eigen K block (km,kn)", lambda a, b: jnp.einsum("km,kn->mn", a, b), (a, b), a)):
        got = np.asarray(jax.jit(f)(*args))
        found = [kc for kc in (512, 320, 288, 272, 256, 200, k) if np.array_equal(emulated_blocked_dot(lhs, b, kc), got)]
        out.append(f"{name + ' K=1600':<34} {found[0] if found else 'not 512/320/288/272/256/200/K'}")


def library(hlo_text: str) -> str:
    """Which library a compiled dot runs in: ``ynnpack`` (a ``__ynn_fusion``), ``onednn`` (a
    ``__onednn`` fusion or call) or ``eigen`` (a plain ``dot``: Eigen's contraction, oneDNN's sgemm
    as its kernel)."""
    import re

    if "__ynn_fusion" in hlo_text:
        return "ynnpack"
    return "onednn" if "__onednn" in hlo_text else ("eigen" if re.search(r"\bdot\(", hlo_text) else "other")


def step_dots_in_ynnpack(hlo_text: str) -> str:
    """``"<dots> / <of them inside a __ynn_fusion>"`` for a compiled module's text."""
    import re

    calls, dots, current = {}, {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
            current = m.group(1) if m else current
        dots[current] = dots.get(current, 0) + line.count(" dot(")
        for m in re.finditer(r"calls=%([\w.\-]+)", line):
            calls[m.group(1)] = "__ynn_fusion" in line
    return f"{sum(dots.values())} / {sum(n for c, n in dots.items() if calls.get(c))}"


def base_stage(out: list[str]) -> None:
    """The smoke config's base stage, its real code path, digested at every step of its training."""
    import tempfile

    import jax
    import numpy as np
    from absl import logging

    from behaviortrace_jax.stages import base
    from behaviortrace_jax.train import lm_trainer
    from configs import tiny

    logging.set_verbosity(logging.WARNING)

    def tree_digest(tree) -> str:
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree))).hexdigest()[:16]

    real_fit = lm_trainer.LMTrainer.fit
    tmp = tempfile.TemporaryDirectory()

    def probing_fit(self, state, data, batch_indices, num_steps, **kw):
        with open(os.path.join(tmp.name, "base.build", "tokenizer", "tokenizer.json"), "rb") as f:
            out.append(f"{'base tokenizer.json':<34} {hashlib.sha256(f.read()).hexdigest()[:16]}")
        out.append(f"{'base packed data':<34} {h(data.batch(np.arange(len(data)))['tokens'])}")
        out.append(f"{'base initial weights':<34} {tree_digest(state.params)}")
        batch = self.put_batch(data.batch(batch_indices(0)))
        text = self._step.lower(state, self.prefix, batch).compile().as_text()
        out.append(f"{'base step: dots / in YNNPACK':<34} {step_dots_in_ynnpack(text)}")
        logits = jax.jit(lambda p: lm_trainer.sequence_logits(self.graphdef, self.config, p, self.prefix,
                                                              batch["tokens"], batch["mask"]))(state.params)
        out.append(f"{'base step 1 logits':<34} {h(logits)}")
        (loss, _), grads = jax.jit(jax.value_and_grad(
            lambda p: lm_trainer.lm_loss(self.graphdef, self.config, p, self.prefix, batch), has_aux=True))(state.params)
        out.append(f"{'base step 1 loss':<34} {h(loss)} ({float(loss):.9g})")
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            name = jax.tree_util.keystr(path).replace("['", "").replace("']", ".").replace(".value", "").rstrip(".")
            out.append(f"{'grad ' + name[-29:]:<34} {h(g)}")

        def after_step(done, st):
            out.append(f"{f'base weights after step {done}':<34} {tree_digest(st.params)}")
            return False

        return real_fit(self, state, data, batch_indices, num_steps, **{**kw, "callback": after_step,
                                                                         "callback_every": 1})

    def stop(*args, **kwargs):
        raise StopIteration  # the behaviour evaluation after the export: not needed here

    lm_trainer.LMTrainer.fit, measure = probing_fit, base.measure_base
    base.measure_base = stop
    try:
        base.build_base_model(tiny.get_config("smoke"), os.path.join(tmp.name, "base"))
    except StopIteration:
        pass
    finally:
        lm_trainer.LMTrainer.fit, base.measure_base = real_fit, measure
        tmp.cleanup()


def probe(variant: str) -> list[str]:
    """Every section's lines in this process (the variant's environment already in place)."""
    sys.path.insert(0, REPO)
    import jax
    import numpy as np

    out = [f"# {variant}: jax {jax.__version__} numpy {np.__version__} devices {jax.devices()} "
           f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')} "
           f"CPUs {len(os.sched_getaffinity(0))}"]
    primitives(out)
    dots(out)
    base_stage(out)
    return out


def matrix() -> None:
    """Every variant in its own process; prints each line's digest per variant ('=' where equal to default)."""
    runs = {}
    for name in VARIANTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", name]
        proc = subprocess.run(cmd, env=variant_env(name, dict(os.environ)), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"--variant {name} failed:\n{proc.stderr[-3000:]}")
        runs[name] = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
        print(next(ln for ln in proc.stdout.splitlines() if ln.startswith("#")))
    names = list(runs)
    print(f"{'':<34} " + " ".join(f"{n[:16]:<16}" for n in names))
    for i, line in enumerate(runs["default"]):
        label, ref = line[:34], line[35:].split()[0]
        cells = [ref] + ["=" if runs[n][i][35:].split()[0] == ref else runs[n][i][35:].split()[0] for n in names[1:]]
        print(f"{label:<34} " + " ".join(f"{c[:16]:<16}" for c in cells))


def main(argv: list[str]) -> None:
    if "--matrix" in argv:
        matrix()
        return
    variant = argv[argv.index("--variant") + 1] if "--variant" in argv else ("native" if "--native" in argv else "default")
    if os.environ.get("_CPU_PROBE_CHILD") != "1":  # XLA reads its flags once: set them, then re-execute
        env = {**variant_env(variant, dict(os.environ)), "_CPU_PROBE_CHILD": "1"}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), "--variant", variant], env)
    if variant == "one_cpu":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print("\n".join(probe(variant)))


if __name__ == "__main__":
    main(sys.argv[1:])
