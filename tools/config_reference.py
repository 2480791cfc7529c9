#!/usr/bin/env python3
"""Writes docs/reference/config.md, every config key of ``configs/common.py`` with its default and
its comment, from that file itself (so the reference cannot drift from it).

    python tools/config_reference.py           # (re)writes docs/reference/config.md
    python tools/config_reference.py --check   # exit 1 naming the file if it is not current

A key's comment is the ``#`` lines just before it and its trailing ``#`` comment; ``#`` lines
after a key continue its trailing comment when that does not end in a full stop and the next key
has a trailing comment of its own. A section is a top-level ``ConfigDict``; its title is the ``# --- ... ---`` banner above
it; the top-level keys come first, in one table. Defaults are the values ``configs.common.get_config()`` returns, so a key documented here and
missing there (or the reverse) is an error naming the key. tests/repo/test_config_reference.py checks
that the file is current.
"""
from __future__ import annotations

import argparse
import ast
import io
import pathlib
import re
import sys
import tokenize

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE = REPO / "configs" / "common.py"
OUTPUT = REPO / "docs" / "reference" / "config.md"
BANNER = re.compile(r"^#\s*-{3}\s*(.*?)\s*-*\s*$")  # "# --- model (SPEC §2.1: ...) ----"


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(trailing comments by line, whole-line comments by line), without the ``#``."""
    trailing, whole = {}, {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            text = tok.string.lstrip("#").strip()
            (whole if not lines[line - 1][:tok.start[1]].strip() else trailing)[line] = text
    return trailing, whole


def _key(target: ast.expr) -> str | None:
    """``c.model.hf_dir`` -> ``model.hf_dir``; None for anything else."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    return ".".join(reversed(parts)) if isinstance(target, ast.Name) and target.id == "c" and parts else None


def parse(source: str) -> list[tuple[str, str, str]]:
    """``(kind, key, comment)`` per assignment of ``configs/common.py`` in file order; ``kind`` is
    ``"section"`` for a top-level ``ConfigDict`` (comment: its banner's title) or ``"key"``."""
    trailing, whole = _comments(source)
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "get_config")
    assigns = [(n.lineno, n.end_lineno, _key(n.targets[0]), n.value) for n in fn.body
               if isinstance(n, ast.Assign) and _key(n.targets[0])]
    out, continued = [], set()  # continued: comment lines that continue the key above them
    for i, (line, end, key, value) in enumerate(assigns):
        is_dict = isinstance(value, ast.Call) and getattr(value.func, "attr", "") == "ConfigDict"
        if is_dict and "." not in key and not any(k.startswith(key + ".") for _, _, k, _ in assigns):
            is_dict = False  # an empty ConfigDict (behaviors): a key, not a section
        before, j = [], line - 1
        while j in whole and j not in continued:
            before.insert(0, whole[j])
            j -= 1
        if is_dict:
            banner = next((m.group(1) for t in before if (m := BANNER.match("# " + t))), key)
            out.append(("section", key, banner))
            continue
        text = [t for t in before if not BANNER.match("# " + t)]
        if line in trailing:
            text.append(trailing[line])
            nxt = assigns[i + 1][0] if i + 1 < len(assigns) else None
            if nxt in trailing and not trailing[line].endswith("."):  # an unfinished comment goes on below
                more = [k for k in range(end + 1, nxt) if k in whole]
                text += [whole[k] for k in more]
                continued.update(more)
        out.append(("key", key, " ".join(text)))
    return out


def _flat(config, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if hasattr(v, "items"):
            out.update(_flat(v, name + ".") if len(v) else {name: {}})
        else:
            out[name] = v
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The markdown of docs/reference/config.md. Raises ValueError naming a key that
    ``get_config()`` and the file's assignments do not both have."""
    sys.path.insert(0, str(REPO))
    from configs import common

    values = _flat(common.get_config())
    entries = parse(SOURCE.read_text())
    keys = [k for kind, k, _ in entries if kind == "key"]
    if set(keys) != set(values):
        raise ValueError(f"{SOURCE}: keys assigned but not in get_config(): {sorted(set(keys) - set(values))}; "
                         f"in get_config() but not assigned as c.<key> = ...: {sorted(set(values) - set(keys))}")
    lines = ["# Config keys", "",
             "Generated by `python tools/config_reference.py` from `configs/common.py` (do not edit by hand;",
             "`tests/repo/test_config_reference.py` checks it is current). Every key, its default (the paper's value",
             "unless the comment says otherwise) and its comment; \"SPEC §x\" is `../shared/paper/SPEC.md`.",
             "Set a key on the command line with `--config.<key>=<value>`; `configs/tiny.py` and the other",
             "configs change some of them.", ""]
    header = ["| key | default | meaning |", "|---|---|---|"]
    row = lambda key, text: f"| `{key}` | `{values[key]!r}` | {_cell(text)} |"  # noqa: E731
    lines += ["## Top level", "", *header, *(row(k, t) for kind, k, t in entries if kind == "key" and "." not in k)]
    for kind, key, text in entries:
        if kind == "section":
            lines += ["", f"## `{key}`: {text}", "", *header]
        elif "." in key:
            lines.append(row(key, text))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference/config.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO)} is not current: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUTPUT.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(OUTPUT)  # atomic: a reader sees the old file or the new one
    print(f"wrote {OUTPUT.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
