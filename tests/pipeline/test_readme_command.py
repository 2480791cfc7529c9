"""The README's main command, typed as a new user would, from a copy of the repository.

The command line is read out of README.md (so the two cannot drift) and run with the copy as the
current directory, relative ``--workdir`` and all; only the config gains the ``:smoke`` variant
(configs/tiny.py shrunk to seconds). The run must finish, keep the console short and write every
file the smoke run writes (a listing that does not depend on the CPU).

Its outputs are then checked against the digests recorded for this CPU type in
``tests/cpu_digests.json`` (rows keyed by vendor, family, model, the ISA flags that select kernels
and the CPU count: ``io/machine.cpu_identity``). XLA:CPU's matmul libraries choose kernels and split
sums by the host CPU, so the same seed and command give other bits on another CPU type
(docs/reproducibility.md); a digest is a regression check for the CPU types it was recorded on.
Where a digest is not recorded for this CPU type, the test runs the command a second time and
asserts what must hold on every machine: both runs write byte-identical files. It then prints the
digests with a request to add them and passes.

* ``BEHAVIORTRACE_CPU_TABLE_IGNORE=1`` ignores the table (an unknown CPU type, simulated).
* ``BEHAVIORTRACE_PERTURB_BASE_WEIGHT=random`` (a test switch, ``train/train_state.py``) flips the
  last bit of one initial base weight at a random position: every run differs, so this test fails.
* Recording: ``python tests/pipeline/test_readme_command.py --record`` runs the command once and prints this
  CPU type's row; ``--write`` stores it in ``tests/cpu_digests.json``, and where an output's digest
  changed here it removes that output's digest from the other CPU types' rows (a changed output is
  no longer known to repeat there: those machines fall back to the two-run check until re-recorded).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "tests"):  # run as a script (--record): the package and conftest.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from behaviortrace_jax.io import machine  # noqa: E402
from conftest import user_env  # noqa: E402

TABLE = REPO / "tests" / "cpu_digests.json"
IGNORE_TABLE_ENV = "BEHAVIORTRACE_CPU_TABLE_IGNORE"
DIGESTS = ("base_weights", "results_table.csv", "files")
# Files holding times, absolute paths, the machine or orbax/XLA internals: not compared.
FILES_SKIPPED = re.compile(r"(^|/)(\.jax_cache|state|tb)/|^base/(\.trained|train_history\.json)$|summary\.json$"
                           r"|^grpo/(registry|progress)\.json$|\.settings\.json$|^run_info\.json$")


def files_digest(workdir: pathlib.Path) -> tuple[str, list[str]]:
    """sha256 over ``"<relative path> <sha256 of its bytes>\\n"`` of every file under ``workdir`` that
    ``FILES_SKIPPED`` keeps, in sorted path order; and those lines (for a diff when it differs)."""
    lines = []
    for p in sorted(x for x in workdir.rglob("*") if x.is_file()):
        rel = p.relative_to(workdir).as_posix()
        if not FILES_SKIPPED.search(rel):
            lines.append(f"{rel} {hashlib.sha256(p.read_bytes()).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest(), lines


def listing_digest(lines: list[str]) -> str:
    """sha256 of the relative paths in :func:`files_digest`'s lines (which files, not their bytes)."""
    return hashlib.sha256("".join(ln.rsplit(" ", 1)[0] + "\n" for ln in lines).encode()).hexdigest()


def differing_files(a: list[str], b: list[str]) -> list[str]:
    """The relative paths whose bytes differ between two :func:`files_digest` line lists, or that
    only one of them has; ``[]`` when the two runs wrote the same files byte for byte."""
    da, db = (dict(ln.rstrip("\n").rsplit(" ", 1) for ln in x) for x in (a, b))
    return sorted(k for k in da.keys() | db.keys() if da.get(k) != db.get(k))


def readme_main_command() -> list[str]:
    """The README's main command (``python main.py --config=configs/tiny.py --workdir=...``) as argv."""
    lines = [ln.strip() for ln in (REPO / "README.md").read_text().splitlines()]
    found = [ln for ln in lines if ln.startswith("python main.py --config=configs/tiny.py --workdir=")]
    assert found, "README.md no longer shows `python main.py --config=configs/tiny.py --workdir=...`"
    return found[0].split()


def copy_of_repository(dest: pathlib.Path) -> pathlib.Path:
    """The files git tracks (as they are in the working tree), copied to ``dest``: a fresh clone
    of the code under test, without runs, caches or a virtual environment."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@dataclasses.dataclass
class SmokeRun:
    """One run of the README command (smoke variant) in a fresh copy of the repository."""
    workdir: pathlib.Path
    returncode: int
    console: str
    digest: dict[str, str]  # the run's printed digests, plus "files" (files_digest)
    lines: list[str]  # files_digest's lines


def run_readme_command(dest: pathlib.Path) -> SmokeRun:
    """Copies the repository to ``dest/clone`` and runs the README's main command there with
    ``:smoke`` appended to the config, in the environment of a user's shell (no XLA_FLAGS)."""
    argv = readme_main_command()
    assert argv[:2] == ["python", "main.py"]
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    assert not os.path.isabs(workdir), "the README's command uses a relative workdir; test that"
    argv = [sys.executable, "main.py"] + [a + ":smoke" if a == "--config=configs/tiny.py" else a for a in argv[2:]]
    clone = copy_of_repository(dest / "clone")
    # As a user's shell, with one setting more: every program goes into the run's compilation cache
    # (<workdir>/.jax_cache), not only those that take >= 1 s to compile (test_gcs_run starts from it).
    env = user_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    digest = dict(re.findall(r"^digest (\S+): sha256 ([0-9a-f]{64})$", proc.stdout, re.M))
    digest["files"], lines = files_digest(clone / workdir)
    return SmokeRun(clone / workdir, proc.returncode, proc.stdout + proc.stderr, digest, lines)


# ------------------------------------------------------------------------------------------------
# the table of recorded digests
# ------------------------------------------------------------------------------------------------
def load_table(path: pathlib.Path = TABLE) -> dict:
    """``tests/cpu_digests.json``: ``{"listing", "n_files", "rows": [{"cpu", "versions", "recorded", "digests"}]}``."""
    return json.loads(path.read_text())


def row_matches(row: dict, identity: dict, versions: dict) -> bool:
    """Whether a table row was recorded on this CPU type and library versions.

    ``row["cpu"]`` holds ``vendor``, ``family``, ``model``, ``cpus`` (None: not recorded, matches any)
    and either ``flags`` (the exact set of ``machine.NUMERIC_FLAGS``) or, for a row recorded before
    flags were, ``flags_include`` (flags the machine is known to have had). ``row["versions"]``
    must equal the installed jax and jaxlib.
    """
    cpu = row["cpu"]
    for key in ("vendor", "family", "model", "cpus"):
        if cpu.get(key) is not None and cpu[key] != identity[key]:
            return False
    if cpu.get("flags") is not None and sorted(cpu["flags"]) != identity["flags"]:
        return False
    if not set(cpu.get("flags_include") or ()) <= set(identity["flags"]):
        return False
    return all(versions.get(k) == v for k, v in row.get("versions", {}).items())


def this_cpu_row(table: dict, environ=os.environ) -> dict | None:
    """The first row of ``table`` recorded on this machine's CPU type, or None (also when
    ``BEHAVIORTRACE_CPU_TABLE_IGNORE=1`` simulates an unknown CPU type)."""
    if environ.get(IGNORE_TABLE_ENV, "") not in ("", "0"):
        return None
    info = machine.run_info()
    return next((r for r in table["rows"] if row_matches(r, info["cpu"], info["versions"])), None)


def row_for_this_cpu(run: SmokeRun, note: str) -> dict:
    """The table row a run on this machine makes: its CPU identity, jax versions and digests."""
    info = machine.run_info()
    cpu = {k: info["cpu"][k] for k in ("vendor", "family", "model", "flags", "cpus")}
    return {"cpu": cpu, "versions": {k: info["versions"][k] for k in ("jax", "jaxlib")},
            "recorded": f"{info['cpu']['model_name']}; {note}", "digests": {k: run.digest[k] for k in DIGESTS}}


def updated_table(table: dict, new_row: dict, lines: list[str]) -> tuple[dict, list[str]]:
    """``table`` with ``new_row`` in place of the rows that match its CPU type (a partial row
    recorded before flags were is replaced by the full one; appended if none) and the listing of
    ``lines``; every digest that changed on this CPU type is removed from the other rows.
    Returns (the table, a line per removed digest)."""
    out = json.loads(json.dumps(table))
    same = [r for r in out["rows"] if row_matches(r, new_row["cpu"], new_row["versions"])]
    old = same[0]["digests"] if same else {}
    changed = [k for k in DIGESTS if k in old and old[k] != new_row["digests"][k]]
    rows, removed = [], []
    for r in out["rows"]:
        if same and r is same[0]:
            rows.append(new_row)
        elif any(r is x for x in same):
            continue  # a second row of this CPU type: the new row replaces it too
        else:
            for k in changed:
                if r["digests"].pop(k, None) is not None:
                    removed.append(f"{k} of {machine.cpu_key(r['cpu'])}: stale (it changed on this CPU type)")
            rows.append(r)
    out["rows"] = rows if same else rows + [new_row]
    out["listing"], out["n_files"] = listing_digest(lines), len(lines)
    return out, removed


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
# readme_run: the session fixture of conftest.py (run_readme_command, once; test_gcs_run compares with it)


def test_readme_main_command_runs_as_typed(readme_run):
    run = readme_run
    assert run.returncode == 0, run.console[-4000:]
    assert (run.workdir / "results_table.csv").is_file() and (run.workdir / "report.md").is_file()
    # Console: stage banners, progress bars (redraws collapsed), checkpoint lines, the summary.
    lines = [ln for ln in re.split(r"[\r\n]+", run.console) if ln.strip() and not re.match(r"^\w+:\s+\d+%\|", ln)]
    assert len(lines) < 60, "\n".join(lines)
    assert not [ln for ln in lines if "orbax" in ln.lower() or "CheckpointManager" in ln]
    assert set(run.digest) == set(DIGESTS), run.digest
    table = load_table()
    assert listing_digest(run.lines) == table["listing"], (
        f"the smoke run wrote other files than recorded ({len(run.lines)}; {table['n_files']} recorded):\n"
        + "".join(ln.rsplit(" ", 1)[0] + "\n" for ln in run.lines))
    info = json.loads((run.workdir / "run_info.json").read_text())
    assert info["runs"][-1]["cpu"]["key"] == machine.cpu_identity()["key"]


def test_outputs_match_this_cpu_types_digests_or_repeat(readme_run, tmp_path):
    run = readme_run
    assert run.returncode == 0, run.console[-4000:]
    row = this_cpu_row(load_table())
    recorded = row["digests"] if row else {}
    for name, want in recorded.items():
        assert run.digest[name] == want, (
            f"{name}: {run.digest[name]} != {want}, recorded on this CPU type ({row['recorded']}): same seed "
            f"and command, other outputs. Files written:\n" + ("".join(run.lines) if name == "files" else ""))
    missing = [k for k in DIGESTS if k not in recorded]
    if not missing:
        return
    again = run_readme_command(tmp_path)  # not recorded here: the command must at least repeat itself
    assert again.returncode == 0, again.console[-4000:]
    diff = differing_files(run.lines, again.lines)
    assert not diff and again.digest == run.digest, (
        f"the same command run twice on this machine wrote different files: {diff[:20]}"
        f"{' ...' if len(diff) > 20 else ''} ({len(diff)} of {len(run.lines)}); digests {run.digest} vs {again.digest}")
    key = machine.cpu_identity()["key"]
    message = (f"{', '.join(missing)} not recorded for this CPU type ({key}); the run repeats here. Please add "
               f"this row to tests/cpu_digests.json (python tests/pipeline/test_readme_command.py --write): "
               + json.dumps(row_for_this_cpu(run, "recorded by the test")))
    print(message)
    warnings.warn(message)


def test_cpu_rows_match_by_every_recorded_field():
    intel = {"vendor": "GenuineIntel", "family": 6, "model": 167, "flags": ["avx", "avx2", "avx512f", "fma"], "cpus": 2}
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2"}
    exact = {"cpu": dict(intel), "versions": versions}
    assert row_matches(exact, intel, versions)
    assert not row_matches(exact, {**intel, "cpus": 4}, versions)  # the thread count splits sums
    assert not row_matches(exact, {**intel, "flags": ["avx", "avx2", "fma"]}, versions)  # AVX-512 masked
    assert not row_matches(exact, intel, {**versions, "jaxlib": "0.11.0"})
    partial = {"cpu": {"vendor": "AuthenticAMD", "family": None, "model": None, "flags_include": ["avx512f"],
                       "cpus": 2}, "versions": versions}
    amd = {**intel, "vendor": "AuthenticAMD", "family": 25, "model": 17}
    assert row_matches(partial, amd, versions)
    assert not row_matches(partial, {**amd, "flags": ["avx", "avx2", "fma"]}, versions)
    assert not row_matches(partial, intel, versions)
    assert this_cpu_row({"rows": [exact]}, {IGNORE_TABLE_ENV: "1"}) is None


def test_the_shipped_table_is_well_formed():
    table = load_table()
    assert re.fullmatch(r"[0-9a-f]{64}", table["listing"]) and table["n_files"] > 100
    for r in table["rows"]:
        assert set(r["digests"]) <= set(DIGESTS) and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in r["digests"].values())
        assert r["cpu"]["vendor"] and r["recorded"] and set(r["versions"]) == {"jax", "jaxlib"}


def test_the_two_run_check_names_every_differing_file(tmp_path):
    for w in ("a", "b"):
        (tmp_path / w / "base").mkdir(parents=True)
        (tmp_path / w / "base" / "model.safetensors").write_bytes(b"\x00\x01weights")
        (tmp_path / w / "results_table.csv").write_text("seed,table\n0,overall\n")
        (tmp_path / w / "run_info.json").write_text(json.dumps({"machine": w}))  # skipped: names the machine
    a, b = files_digest(tmp_path / "a"), files_digest(tmp_path / "b")
    assert a == b and differing_files(a[1], b[1]) == []
    (tmp_path / "b" / "base" / "model.safetensors").write_bytes(b"\x00\x00weights")  # one bit of one weight
    (tmp_path / "b" / "extra.json").write_text("{}")
    b = files_digest(tmp_path / "b")
    assert b[0] != a[0] and differing_files(a[1], b[1]) == ["base/model.safetensors", "extra.json"]


def test_recording_replaces_this_row_and_drops_what_changed_elsewhere():
    amd = {"cpu": {"vendor": "AuthenticAMD", "family": None, "model": None, "flags_include": ["avx512f"], "cpus": 2},
           "versions": {}, "recorded": "x", "digests": {"base_weights": "a" * 64, "results_table.csv": "b" * 64,
                                                        "files": "c" * 64}}
    intel_cpu = {"vendor": "GenuineIntel", "family": 6, "model": 167, "flags": ["avx2"], "cpus": 2}
    intel = {"cpu": intel_cpu, "versions": {}, "recorded": "y",
             "digests": {"base_weights": "d" * 64, "results_table.csv": "b" * 64, "files": "e" * 64}}
    table = {"listing": "0" * 64, "n_files": 1, "rows": [amd, intel]}
    new = {**intel, "digests": {"base_weights": "d" * 64, "results_table.csv": "f" * 64, "files": "9" * 64}}
    out, removed = updated_table(table, new, ["a.txt 00\n"])
    assert out["rows"][1] == new and out["rows"][0]["digests"] == {"base_weights": "a" * 64}
    assert len(removed) == 2 and out["n_files"] == 1 and table["rows"][0]["digests"]["files"] == "c" * 64
    # recorded on the AMD machine itself: its full row replaces the partial one, Intel's stays
    amd_full = {"cpu": {"vendor": "AuthenticAMD", "family": 25, "model": 17, "flags": ["avx2", "avx512f"], "cpus": 2},
                "versions": {}, "recorded": "z", "digests": dict(amd["digests"])}
    out, removed = updated_table(table, amd_full, ["a.txt 00\n"])
    assert out["rows"] == [amd_full, intel] and removed == []


def main(argv: list[str]) -> int:
    """``--record``: run the README command once and print this CPU type's row; ``--write``: also
    store it in tests/cpu_digests.json (see the module docstring). ``--note TEXT`` is kept in the row."""
    if not {"--record", "--write"} & set(argv):
        print(__doc__)
        return 2
    note = argv[argv.index("--note") + 1] if "--note" in argv else "recorded with --record"
    with tempfile.TemporaryDirectory() as tmp:
        run = run_readme_command(pathlib.Path(tmp))
        if run.returncode != 0 or set(run.digest) != set(DIGESTS):
            print(run.console[-4000:])
            return 1
        row = row_for_this_cpu(run, note)
        print(json.dumps(row, indent=1))
        if "--write" in argv:
            table, removed = updated_table(load_table(), row, run.lines)
            TABLE.write_text(json.dumps(table, indent=1) + "\n")
            print(f"wrote {TABLE}" + "".join(f"\n  removed {r}" for r in removed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
