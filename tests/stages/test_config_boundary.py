"""The config boundary of ``stages/``: no stage module but ``stages/spec.py`` reads a raw config value.

``stages/spec.py`` (``RunSpec.from_config``) is the one reader of the ConfigDict's keys: every key is
typed and checked there, once, and an error names it. A stage takes the ConfigDict (its registry
signature is ``stage(config, workdir)``) and reads the typed ``RunSpec`` built from it.
``tests/test_spec.py`` checks the layers below ``stages/``; this module checks ``stages/`` itself.

What counts as a raw read, for a *config name* (a parameter annotated as a ``ConfigDict``, a parameter
named ``config``, ``self.config``, a local name bound to one of these, or to the result of a function of
``stages/`` annotated to return a ``ConfigDict``, such as ``spec.seed_config``):

* an attribute of it: ``config.grpo``, ``config.grpo.steps``, ``c.seed``, ``config.get(...)``,
  ``config.to_dict()``, ``config.unlocked()`` (a ConfigDict method reads or changes its values too);
* an item of it: ``config["grpo"]``;
* a builtin that reads its keys or values: ``getattr(config, ...)``, ``hasattr``, ``vars``, ``dict``,
  ``list``, ``tuple``, ``iter``, ``sorted``, ``len``; ``"x" in config``; ``for k in config``;
  ``f(**config)`` / ``f(*config)``.

What is allowed: passing the object on untouched, as an argument (``RunSpec.from_config(config)``,
``fingerprints.check_workdir(config, ...)``, ``load_stages()[name](config, workdir)``), or binding
it to another name (which then is a config name itself).

One exemption, :data:`EXEMPT`: ``stages/fingerprint.py``, whose job is to treat the config as data.
A stage's fingerprint is the config's own dotted keys and values (``{"sft.lr": 0.0002, ...}``,
``cache.flatten(config.to_dict())``), compared key by key with what a workdir recorded, so it reads
the ConfigDict as a dict of keys by design: going through the typed spec would rename the keys the
recorded fingerprints hold (and ``on_changed_config``, which it reads, is a top-level key the spec
leaves out: ``spec.TOP_LEVEL_KEYS``).
"""
from __future__ import annotations

import ast
import contextlib
import pathlib

import pytest

STAGES = pathlib.Path(__file__).resolve().parents[2] / "behaviortrace_jax" / "stages"
READER = "spec.py"  # the one module that reads the ConfigDict's keys
EXEMPT = {"fingerprint.py": "the fingerprint is the config's flat dotted keys and values, read as data "
                            "(module docstring)"}
KEY_READING_BUILTINS = {"getattr", "hasattr", "vars", "dict", "list", "tuple", "iter", "sorted", "len"}


def config_makers() -> frozenset[str]:
    """The names of the functions of ``stages/`` (spec.py included) annotated to return a ConfigDict."""
    return frozenset(n.name for p in STAGES.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None
                     and "ConfigDict" in ast.unparse(n.returns))


def _is_config_param(arg: ast.arg) -> bool:
    return arg.arg == "config" or (arg.annotation is not None and "ConfigDict" in ast.unparse(arg.annotation))


class _Reads(ast.NodeVisitor):
    """Collects ``(line, expression)`` for each raw read of a config name (module docstring); a
    function's config names are those of its enclosing functions plus its own."""

    def __init__(self, makers: frozenset[str]):
        self.makers = makers
        self.names: list[set[str]] = [set()]
        self.found: list[tuple[int, str]] = []

    def is_config(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names[-1]
        if isinstance(node, ast.Call):  # seed_config(...), spec_lib.seed_config(...)
            f = node.func
            return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "") in self.makers
        return (isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name)
                and node.value.id == "self")

    def report(self, node: ast.AST, what: str | None = None) -> None:
        self.found.append((node.lineno, what or ast.unparse(node)))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        own = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if _is_config_param(x)}
        for d in a.defaults + a.kw_defaults + getattr(node, "decorator_list", []):
            if d is not None:
                self.visit(d)
        self.names.append(self.names[-1] | own)
        # bindings of a config name to another name, anywhere in this function (one pass suffices:
        # an alias of an alias is rare, and a second pass below catches it)
        for _ in range(2):
            for n in ast.walk(node):
                if isinstance(n, ast.Assign) and self.is_config(n.value):
                    self.names[-1] |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple):
                    for t in n.targets:
                        if isinstance(t, ast.Tuple) and len(t.elts) == len(n.value.elts):
                            self.names[-1] |= {x.id for x, v in zip(t.elts, n.value.elts)
                                               if isinstance(x, ast.Name) and self.is_config(v)}
        for child in (node.body if isinstance(node.body, list) else [node.body]):
            self.visit(child)
        self.names.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.is_config(node.value):
            self.report(node)  # widened to the whole chain by raw_reads
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self.is_config(node.value):
            self.report(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in KEY_READING_BUILTINS and node.args \
                and self.is_config(node.args[0]):
            self.report(node)
        for a in node.args:
            if isinstance(a, ast.Starred) and self.is_config(a.value):
                self.report(node)
        for k in node.keywords:
            if k.arg is None and self.is_config(k.value):
                self.report(node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) and self.is_config(c) for op, c in zip(node.ops, node.comparators)):
            self.report(node)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        if self.is_config(node.iter):
            self.report(node, f"for ... in {ast.unparse(node.iter)}")
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        if self.is_config(node.iter):
            self.report(node.iter, f"for ... in {ast.unparse(node.iter)}")
        self.generic_visit(node)


def raw_reads(source: str, makers: frozenset[str] = frozenset()) -> list[str]:
    """``"<line>: <expression>"`` for each raw read of a config value in ``source`` (a module's text),
    the whole attribute chain named (``config.grpo.steps``, not ``config.grpo``); ``makers``: the names
    of functions that return a ConfigDict (:func:`config_makers`)."""
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    v = _Reads(makers)
    v.visit(tree)
    out = set(v.found)
    # widen each attribute read to its whole chain: config.grpo -> config.grpo.steps
    widened = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Attribute, ast.Subscript)) and (n.lineno, ast.unparse(n)) in out:
            top = n
            while isinstance(parents.get(top), (ast.Attribute, ast.Subscript)) and parents[top].value is top:
                top = parents[top]
            widened.add((n.lineno, ast.unparse(n), ast.unparse(top)))
    for line, inner, whole in widened:
        out.discard((line, inner))
        out.add((line, whole))
    return [f"{line}: {what}" for line, what in sorted(out)]


def stage_modules() -> list[pathlib.Path]:
    return sorted(p for p in STAGES.glob("*.py") if p.name not in {READER, *EXEMPT})


def test_no_stage_but_the_spec_reads_a_raw_config_value():
    mods = stage_modules()
    assert len(mods) >= 15 and all((STAGES / m).is_file() for m in (READER, *EXEMPT))  # the walk sees stages/
    makers = config_makers()
    assert {"seed_config", "draw_config"} <= makers  # the sweep's per-seed configs (stages/spec.py)
    found = [f"behaviortrace_jax/stages/{p.name}:{r}" for p in mods for r in raw_reads(p.read_text(), makers)]
    assert found == [], ("raw config reads outside stages/spec.py (read them in RunSpec.from_config, as a typed "
                         "field, and pass the spec):\n" + "\n".join(found))


def test_the_checker_catches_each_raw_read():
    src = ("import ml_collections\n"
           "def f(c: ml_collections.ConfigDict, model_config, n):\n"
           "    return c.grpo.steps, model_config.vocab_size, n.x\n"
           "def g(config, workdir):\n"
           "    a = config\n"
           "    b = a.evaluation\n"
           "    return config['seed'], config.get('x'), getattr(config, 'seed'), 'x' in config, b.nboot\n"
           "class S:\n"
           "    def __init__(self, config):\n"
           "        self.config, self.n = config, 3\n"
           "    def h(self):\n"
           "        return [k for k in self.config], dict(**self.config), self.config.sketch.dim\n"
           "def outer(config):\n"
           "    def inner():\n"
           "        return config.to_dict()\n"
           "    return inner\n"
           "def sweep(config):\n"
           "    cfg, d = spec_lib.seed_config(config, 1, 'b'), 2\n"
           "    return cfg.stages, draw_config(cfg, 0, 1).draws\n")
    assert raw_reads(src, frozenset({"seed_config", "draw_config"})) == [
        "3: c.grpo.steps", "6: a.evaluation", "7: 'x' in config", "7: config.get", "7: config['seed']",
        "7: getattr(config, 'seed')", "12: dict(**self.config)", "12: for ... in self.config",
        "12: self.config.sketch.dim", "15: config.to_dict", "19: cfg.stages",
        "19: draw_config(cfg, 0, 1).draws"]


def test_passing_the_config_on_is_not_a_read():
    src = ("def stage(config, workdir):\n"
           "    spec = RunSpec.from_config(config)\n"
           "    fingerprints.check_workdir(config, workdir, ['x'])\n"
           "    load_stages()['report'](config, str(workdir))\n"
           "    other = config\n"
           "    run(other, spec.grpo.steps, cfg.vocab_size)\n"
           "    return spec.evaluation.nboot\n")
    assert raw_reads(src) == []


@pytest.mark.parametrize("name", sorted(EXEMPT))
def test_an_exempt_module_still_reads_the_config_as_data(name):
    # the exemption is kept only while the module needs it: drop it from EXEMPT when this fails
    assert raw_reads((STAGES / name).read_text()), f"{name} no longer reads the config; remove its exemption"


# ------------------------------------------------------------------------------------------------
# The sweep's per-seed configs, made at the boundary (stages/spec.py), as the sweep stage runs them
# ------------------------------------------------------------------------------------------------
def test_seed_and_draw_configs_are_copies_with_the_seed_keys_set():
    from behaviortrace_jax.stages import spec as spec_lib
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny_sweep

    c = tiny_sweep.get_config()
    s = spec_lib.seed_config(c, 2, "/runs/base")
    assert (s.seed, s.run_name, s.stages, s.model.hf_dir) == (2, "tiny__grpo__seed2", c.sweep.stages, "/runs/base")
    assert (s.draws.ckpt_seed, s.draws.gen_seed) == (-1, -1)
    assert (c.seed, c.run_name, c.stages) == (0, "tiny__grpo__seed0", "sweep")  # the sweep's own config unchanged
    d = spec_lib.draw_config(s, 2, 102)
    assert (d.draws.ckpt_seed, d.draws.gen_seed, s.draws.gen_seed) == (2, 102, -1)
    assert RunSpec.from_config(d).draw_seeds() == (2, 102) and RunSpec.from_config(s).draw_seeds() == (2, 2)


def test_the_sweep_runs_each_seeds_stages_from_its_spec(tmp_path, monkeypatch):
    """The sweep stage with every stage it calls replaced by a recorder: per seed, the stages of
    ``sweep.stages`` (read through the spec) on that seed's config, the diagnostic draw of its
    checkpoint seed, then the aggregate over the seeds' summaries."""
    from behaviortrace_jax.io.layout import RunLayout
    from behaviortrace_jax.stages import registry, sweep
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny_sweep

    c = tiny_sweep.get_config()
    c.sweep.seeds, c.sweep.diagnostic_draws, c.sweep.stages = "0,1", "1:101", "grpo,draws,evaluate"
    calls = []

    def fake(name):
        def stage(config, workdir):
            s = RunSpec.from_config(config)
            calls.append((name, s.seed, s.draw_seeds(), pathlib.Path(workdir).name))
            if name == "evaluate":  # what the sweep copies and reads back
                run = RunLayout(workdir)
                run.release_seed(s.seed).mkdir(parents=True)
                (run.release_seed(s.seed) / "x.json").write_text("{}")
                run.summary.parent.mkdir(parents=True, exist_ok=True)
                run.summary.write_text('{"seed": %d}' % s.seed)
        return stage

    registry.load_stages()
    for name in ("base", "grpo", "draws", "evaluate"):
        monkeypatch.setitem(registry.STAGES, name, fake(name))
    monkeypatch.setattr(sweep.fingerprint, "recording", lambda *a: contextlib.nullcontext())
    seen = {}
    monkeypatch.setattr(sweep, "aggregate", lambda config, w, summaries: seen.update(summaries))
    sweep.sweep_stage(c, str(tmp_path))
    assert calls == [("base", 0, (0, 0), tmp_path.name),
                     ("grpo", 0, (0, 0), "seed0"), ("draws", 0, (0, 0), "seed0"), ("evaluate", 0, (0, 0), "seed0"),
                     ("grpo", 1, (1, 1), "seed1"), ("draws", 1, (1, 1), "seed1"), ("draws", 1, (1, 101), "seed1"),
                     ("evaluate", 1, (1, 1), "seed1")]
    assert seen == {0: {"seed": 0}, 1: {"seed": 1}} and (RunLayout(tmp_path).release_seed(1) / "x.json").is_file()
