"""The test tiers (tests/conftest.py): every collected test carries exactly one of ``unit``,
``e2e`` and ``compile``; the tier tables name only tests and fixtures that exist; and no ``unit``
test runs the pipeline or ``main.py`` in its own body or in a fixture it uses."""
import inspect
import pathlib
import re

import pytest

import conftest

TESTS = pathlib.Path(__file__).resolve().parents[1]
# What makes a test end to end, as written in a test body or fixture: a pipeline run, main.py run.
RUNS_PIPELINE = re.compile(r'pipeline\.run\(|sys\.executable,\s*(str\()?(REPO\s*/\s*)?"main\.py"')


def _fixture_functions(item):
    """The functions of the fixtures ``item`` uses (the closest definition of each name)."""
    defs = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        fixturedefs = defs.name2fixturedefs.get(name) if defs else None
        if fixturedefs:
            yield name, fixturedefs[-1].func


def test_every_collected_test_has_exactly_one_tier(request):
    """The hook saw every test of this run before ``-m`` deselected any (this file among them)."""
    collected = conftest.COLLECTED_TIERS
    assert request.node.nodeid in collected
    wrong = {nodeid: tiers for nodeid, tiers in collected.items() if len(tiers) != 1}
    assert not wrong, f"tests without exactly one tier marker of {conftest.TIERS}: {wrong}"
    assert request.node.get_closest_marker("unit") is not None


def test_the_tier_tables_name_existing_modules_tests_and_fixtures():
    """The tables key tests by file name: each name is one file of tests/, in a folder of
    tests/README.md's rule (a package layer, ``pipeline`` or ``repo``; none at the top)."""
    files = sorted(TESTS.rglob("test_*.py"))
    modules = {p.stem: p for p in files}
    assert len(modules) == len(files), f"a test file name used twice: {[p for p in files if modules[p.stem] != p]}"
    layers = {p.parent.name for p in (TESTS.parent / "behaviortrace_jax").glob("*/__init__.py")}
    misplaced = [p for p in files if p.parent.parent != TESTS or p.parent.name not in layers | {"pipeline", "repo"}]
    assert not misplaced, f"test files outside tests/<layer>/, tests/pipeline/, tests/repo/: {misplaced}"
    assert set(conftest.MODULE_TIERS) <= set(modules), set(conftest.MODULE_TIERS) - set(modules)
    for key, tier in {**conftest.MODULE_TIERS, **conftest.TEST_TIERS}.items():
        assert tier in conftest.TIERS, (key, tier)
    for key in [*conftest.TEST_TIERS, *conftest.HEAVY_UNIT_TESTS]:
        module, name = key.split("::")
        assert module in modules, key
        assert re.search(rf"^\s*def {name}\(", modules[module].read_text(), re.M), f"no test {key}"
    for name in conftest.E2E_FIXTURES:
        assert callable(getattr(conftest, name, None)), f"no fixture {name} in conftest.py"


def test_no_unit_test_runs_the_pipeline():
    """A ``unit`` test whose body or fixtures call ``pipeline.run`` or start ``main.py`` belongs in
    ``e2e`` (conftest.TEST_TIERS or MODULE_TIERS). Checks every test this run collected (run the
    whole ``tests/`` folder to check them all)."""
    wrong = []
    for item in conftest.COLLECTED_ITEMS:
        if item.get_closest_marker("unit") is None or not hasattr(item, "function"):
            continue
        if item.module.__name__ == __name__:  # this file's own samples of the pattern
            continue
        for where, fn in [("body", item.function), *_fixture_functions(item)]:
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if RUNS_PIPELINE.search(source):
                wrong.append(f"{item.nodeid} ({where})")
    assert not wrong, f"unit tests that run the pipeline or main.py: {wrong}"


@pytest.mark.parametrize("source, runs", [('pipeline.run(config, str(w))', True),
                                          ('subprocess.run([sys.executable, "main.py", "--config=x"])', True),
                                          ('cmd = [sys.executable, str(REPO / "main.py"), "--config=x"]', True),
                                          ('assert ["python", "main.py", "--config=x"] in commands', False),
                                          ('pipeline.stage_names(config)', False)])
def test_the_pipeline_pattern(source, runs):
    assert bool(RUNS_PIPELINE.search(source)) == runs


def test_one_file_runs_in_one_process_unless_the_command_line_says():
    assert conftest._names_workers(["-n", "2"]) and conftest._names_workers(["-n0"])
    assert conftest._names_workers(["--numprocesses=3"])
    assert not conftest._names_workers(["-m", "unit", "--no-header", "tests/test_x.py"])
