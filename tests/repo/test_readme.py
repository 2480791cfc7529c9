"""README.md as a user's entry (issue 33 item 5): at most 250 lines; every command in its code blocks
names a script, launcher, config (and config variant and keys) and install extra that exist; every
link, anchor and repository path it names resolves; CI runs its test command; its library example
runs as printed.

The checks are one function, :func:`readme_problems` (text -> list of problems, each naming what is
wrong), so the test of a README with wrong paths goes through the same parsing as the real one.
The main command's digests are checked by tests/pipeline/test_readme_command.py, not here.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import itertools
import pathlib
import re
import shlex
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 250  # issue 33, acceptance: "README.md <= 250 lines"
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
OUR_PACKAGES = ("behaviortrace_jax", "configs")  # imports of a README python block that are checked
RUN_OUTPUTS = {"runs", "W"}  # the workdirs the README's commands write
FILE_EXT = re.compile(r"\.(py|sh|md|json|jsonl|ini|toml|txt|cfg|png)$")


# ------------------------------------------------------------------------------------------------
# parsing
# ------------------------------------------------------------------------------------------------
def code_blocks(text: str) -> list[tuple[str, str]]:
    """``[(language, body)]`` of the fenced (```lang) and indented (4 spaces after a blank line)
    code blocks of a markdown text, in order; an indented block has language ``""``."""
    blocks, lines, i = [], text.splitlines(), 0
    prev_blank = True
    while i < len(lines):
        ln = lines[i]
        m = re.match(r"^\s*```(\S*)", ln)
        if m:
            j = i + 1
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                j += 1
            blocks.append((m.group(1).lower(), "\n".join(lines[i + 1:j])))
            i, prev_blank = j + 1, False
            continue
        if prev_blank and ln.startswith("    ") and ln.strip():
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            blocks.append(("", "\n".join(x[4:] for x in lines[i:j]).strip("\n")))
            i, prev_blank = j, True
            continue
        prev_blank = not ln.strip()
        i += 1
    return blocks


def _prose(text: str) -> str:
    """``text`` without its code blocks (fenced ones removed; indented ones are rare in prose)."""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.M | re.S)


def shell_commands(body: str) -> list[list[str]]:
    """The commands of a shell block as argv lists: backslash continuations joined, ``$ `` prompts
    and comments dropped, ``&&`` / ``;`` / ``|`` split into separate commands."""
    out = []
    for line in re.sub(r"\\\n", " ", body).splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|", line):
            argv = shlex.split(part, comments=True)
            if argv:
                out.append(argv)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", h))


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of the headings of a markdown file (outside code blocks)."""
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", _prose(path.read_text()), re.M)}


# ------------------------------------------------------------------------------------------------
# what a name must resolve to
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def install_extras(repo: pathlib.Path) -> frozenset[str]:
    """The keys of ``EXTRAS`` in setup.py (read with ``ast``, setup.py is not run)."""
    tree = ast.parse((repo / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXTRAS" for t in node.targets):
            return frozenset(ast.literal_eval(k) for k in node.value.keys)
    raise AssertionError("setup.py has no EXTRAS dict")


def _load_config_module(repo: pathlib.Path, rel: str):
    if repo == REPO and rel.startswith("configs/") and rel.count("/") == 1:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        return importlib.import_module("configs." + pathlib.PurePath(rel).stem)
    spec = importlib.util.spec_from_file_location("readme_config_" + re.sub(r"\W", "_", rel), repo / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_config(repo: pathlib.Path, spec: str, keys: list[str] = ()) -> list[str]:
    """Problems of ``--config=FILE[:VARIANT]`` with ``--config.KEY=...`` overrides: the file must
    exist, ``get_config(VARIANT)`` (``get_config()`` without one) must return, and every
    overridden key must be a key of that config (as ml_collections' locked config requires)."""
    rel, _, variant = spec.partition(":")
    if not (repo / rel).is_file():
        return [f"config file {rel} does not exist"]
    try:
        mod = _load_config_module(repo, rel)
        config = mod.get_config(variant) if variant else mod.get_config()
    except Exception as e:  # a wrong variant raises ValueError / TypeError: report which
        return [f"{spec}: get_config({variant!r}) failed: {type(e).__name__}: {e}"]
    problems = []
    for key in keys:
        node = config
        for part in key.split("."):
            try:
                node = node[part]
            except (KeyError, TypeError, AttributeError):
                problems.append(f"{spec}: --config.{key}: no key {part!r} in the config")
                break
    return problems


def check_command(repo: pathlib.Path, argv: list[str]) -> list[str]:
    """Problems of one shell command of a README code block (see the module docstring)."""
    argv = list(itertools.dropwhile(lambda a: re.match(r"^[A-Z_][A-Z0-9_]*=", a), argv))
    if argv and argv[0] in ("bash", "sh", "exec"):
        argv = argv[1:]
    if argv and argv[0] in ("sbatch", "srun"):  # the launcher's own options, then the script
        argv = list(itertools.dropwhile(lambda a: a.startswith("-") or a == "...", argv[1:]))
    if not argv:
        return []
    problems = []
    exe, args = argv[0], argv[1:]
    if exe in ("python", "python3"):
        if args[:2] == ["-m", "pytest"]:
            for a in args[2:]:
                if not a.startswith("-") and ("/" in a or a.endswith(".py")) and not (repo / a.split("::")[0]).exists():
                    problems.append(f"pytest target {a} does not exist")
            return problems
        if args[:1] == ["-m"]:
            return []  # python -m venv / pip: nothing of the repository named
        script = args[0] if args else ""
        if not (repo / script).is_file():
            return [f"script {script} does not exist"]
        if script == "main.py":
            flags = dict(a[2:].split("=", 1) for a in args[1:] if a.startswith("--") and "=" in a)
            if "config" not in flags or "workdir" not in flags:
                problems.append(f"main.py needs --config= and --workdir=: {' '.join(argv)}")
            if "config" in flags:
                keys = [k[len("config."):] for k in flags if k.startswith("config.")]
                problems += check_config(repo, flags["config"], keys)
        return problems
    if exe == "pip" and "install" in args:
        for a in args:
            m = re.match(r"^\.\[([\w,-]+)\]$", a)
            if m:
                problems += [f"pip extra [{x}] is not in setup.py's EXTRAS" for x in m.group(1).split(",")
                             if x not in install_extras(repo)]
        return problems
    if "/" in exe or exe.endswith(".sh"):
        if not (repo / exe).is_file():
            return [f"script {exe} does not exist"]
        problems += [p for a in args if re.match(r"^configs/\w+\.py(:\w*)?$", a) for p in check_config(repo, a)]
    return problems


def _expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(token[:m.start()] + alt + token[m.end():])]


def check_path(repo: pathlib.Path, token: str) -> list[str]:
    """Problems of a repository path named in backticks: a token whose first folder is a top-level
    folder of the repository (or of the package, ``models/families.py``) and that names a file
    (known extension) or a folder (trailing ``/``) must exist; ``FILE:variant`` configs must load.
    Templates (``<family>``), globs and paths outside the repository are not checked."""
    token = token.strip(".,;:()")
    if "<" in token or "*" in token or token.startswith(("..", "/", "~")) or "://" in token:
        return []
    rel, _, variant = token.partition(":")
    if "/" not in rel or not (FILE_EXT.search(rel) or rel.endswith("/")):
        return []
    first = rel.split("/")[0]
    if first in RUN_OUTPUTS:
        return []  # what a run writes (runs/tiny/report.md, W/base): not in the repository
    if (repo / first).is_dir():
        base = repo
    elif (repo / "behaviortrace_jax" / first).is_dir():
        base = repo / "behaviortrace_jax"
    else:
        return []  # prose, or under the package's name
    problems = [f"path {r} does not exist" for r in _expand_braces(rel) if not (base / r).exists()]
    if not problems and variant and rel.startswith("configs/"):
        problems += check_config(repo, token)
    return problems


def readme_problems(text: str, repo: pathlib.Path = REPO, max_lines: int = MAX_LINES) -> list[str]:
    """Everything wrong with a README text read as the entry of ``repo`` (empty when all holds):
    its length, the commands of its shell code blocks, the ``behaviortrace_jax`` / ``configs``
    imports of its python blocks, its links and anchors, and the repository paths in backticks."""
    problems = []
    n = len(text.splitlines())
    if n > max_lines:
        problems.append(f"README has {n} lines, more than {max_lines}")
    blocks = code_blocks(text)
    for lang, body in blocks:
        if lang in SHELL_LANGS:
            for argv in shell_commands(body):
                problems += check_command(repo, argv)
        elif lang == "python":
            problems += check_imports(body)
    prose = _prose(text)
    headings = {slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", prose, re.M)}
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = repo / file if file else repo / "README.md"
        if not path.exists():
            problems.append(f"link {target}: {file} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in (anchors(path) if file else headings):
            problems.append(f"link {target}: no heading with anchor #{anchor} in {file or 'README.md'}")
    for span in re.findall(r"`([^`\n]+)`", prose):
        for token in span.split():
            problems += check_path(repo, token)
        if span.startswith("python main.py "):  # an inline main.py command: its config, variant, keys
            problems += check_command(repo, shlex.split(span))
    return problems


def check_imports(body: str) -> list[str]:
    """Problems of the ``behaviortrace_jax`` / ``configs`` imports of a python block: each module
    must import and each imported name must exist in it."""
    problems = []
    try:
        tree = ast.parse(body)
    except SyntaxError as e:
        return [f"python block does not parse: {e}"]
    for node in ast.walk(tree):
        ours = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OUR_PACKAGES
        if ours:
            try:
                mod = importlib.import_module(node.module)
            except ImportError as e:
                problems.append(f"import {node.module}: {e}")
                continue
            for alias in node.names:
                if not hasattr(mod, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        problems.append(f"from {node.module} import {alias.name}: no such name")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OUR_PACKAGES:
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as e:
                        problems.append(f"import {alias.name}: {e}")
    return problems


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section (up to the next ``## `` heading)."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
def test_readme_commands_paths_and_links_resolve_and_it_fits_250_lines():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert readme_problems(text) == []
    commands = [argv for lang, body in code_blocks(text) if lang in SHELL_LANGS for argv in shell_commands(body)]
    assert ["python", "main.py", "--config=configs/tiny.py", "--workdir=runs/tiny"] in commands
    assert sum(a[:2] == ["python", "main.py"] for a in commands) >= 4  # default, smoke, reproduce, paper scale


def test_a_readme_with_wrong_names_fails_each_one():
    """The same parser on a synthetic README: each wrong name gives its own problem."""
    bad = "\n".join([
        "# T", "", "## Run", "",
        "```bash",
        "python main.py --config=configs/nope.py --workdir=runs/x",
        "python main.py --config=configs/tiny.py:nope --workdir=runs/x",
        "python main.py --config=configs/tiny.py --config.no_such_key=1 --workdir=runs/x",
        "python main.py --config=configs/tiny.py",
        "bash launch/nope.sh configs/tiny.py runs/x",
        "python bench/nope.py",
        "python -m pytest -q tests/test_nope.py",
        "pip install -e '.[nope]'",
        "```", "",
        "```python",
        "from behaviortrace_jax.sketch.sketcher import NoSuchSketcher",
        "```", "",
        "See [a](docs/nope.md), [b](docs/architecture.md#no-such-heading), [c](#no-such-section),",
        "`docs/gone.md`, `models/gone.py`, `configs/seed{0,9}.py` and `launch/gone.sh configs/tiny.py runs/x`.",
    ])
    problems = readme_problems(bad)
    expected = ["configs/nope.py does not exist", "get_config('nope') failed", "no key 'no_such_key'",
                "needs --config= and --workdir=", "launch/nope.sh does not exist", "bench/nope.py does not exist",
                "tests/test_nope.py does not exist", "[nope] is not in setup.py", "NoSuchSketcher: no such name",
                "docs/nope.md does not exist", "#no-such-heading", "#no-such-section", "docs/gone.md does not exist",
                "models/gone.py does not exist", "configs/seed9.py does not exist", "launch/gone.sh does not exist"]
    for e in expected:
        assert any(e in p for p in problems), (e, problems)
    assert len(problems) == len(expected), problems
    assert readme_problems(bad.replace("nope", "tiny"), max_lines=3)[0].startswith("README has")
    good = "# T\n\n```bash\npython main.py --config=configs/tiny.py:smoke --config.stages=base --workdir=runs/x\n```\n"
    assert readme_problems(good) == []


def test_ci_runs_the_readme_test_command():
    """.ci/run calls exactly the command of the README's "Test" section."""
    blocks = code_blocks(section(README.read_text(), "Test"))
    (cmd,) = [ln for lang, body in blocks for ln in body.splitlines() if ln.strip()]
    assert cmd.strip() in [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]


def test_the_library_example_runs_as_printed():
    """The README's sketcher example, executed: fused path, one sketch of width D and one norm per
    example, and the weighted-sum form beside it."""
    (body,) = [b for lang, b in code_blocks(README.read_text()) if lang == "python" and "PerExampleSketcher(" in b]
    ns: dict = {}
    exec(compile(body, "README.md (sketcher example)", "exec"), ns)
    sk, out, ids = ns["sk"], ns["out"], ns["ids"]
    b = ids.shape[0]
    assert sk.fused and out.sketches.shape == (b, sk.dim) and out.norms.shape == (b,)
    assert bool((out.norms > 0).all()) and ns["losses"].shape == (b,)


@pytest.mark.parametrize("heading", ["Install", "Run the default", "Test", "Reproduce the paper's tables", "Results",
                                     "Paper scale and pods", "The sketcher as a library", "Extend", "Where things are"])
def test_readme_has_the_entry_sections(heading):
    section(README.read_text(), heading)
