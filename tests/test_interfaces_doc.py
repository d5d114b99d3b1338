"""docs/INTERFACES.md names only what exists: every signature in it matches the module its section names.

The rule (stated in the document's "Notation" paragraph): a section is a ``## `lightning_moe.x.y` `` heading; in it,
every backticked span that starts with a dotted name followed by ``(`` is a signature. The name resolves as an
attribute path of the section's module (or, when it starts with ``lightning_moe.``, of that module). Every parameter
the span shows must be a parameter of the callable (``self`` left out), a literal default must equal the real
default, and a span without ``...`` in its parameter list must list all of them. So renaming a function, class,
method or parameter, or changing a default the document states, fails here until the document follows.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "INTERFACES.md")
HEADING = re.compile(r"^## `(lightning_moe(?:\.\w+)*)`", re.M)
SPAN = re.compile(r"`([^`]+)`")
SIGNATURE = re.compile(r"^([A-Za-z_][\w.]*)\(")
PARAM = re.compile(r"^\*{0,2}([A-Za-z_]\w*)")


def sections(text: str) -> list[tuple[str, str]]:
    """(module, body) for every ``## `module` `` section."""
    heads = list(HEADING.finditer(text))
    return [(h.group(1), text[h.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)])
            for i, h in enumerate(heads)]


def split_args(inner: str) -> list[str]:
    """Top-level comma-separated items of a parameter list (brackets and quotes kept whole)."""
    items, depth, quote, cur = [], 0, None, ""
    for ch in inner:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        items.append(cur.strip())
    return items


def parameter_list(span: str, name: str) -> str:
    """The text between the signature's opening parenthesis and its matching close."""
    start = len(name) + 1
    depth, quote = 1, None
    for i in range(start, len(span)):
        ch = span[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return span[start:i]
    raise AssertionError(f"INTERFACES.md: `{span}`: no closing parenthesis in the backticks")


def signatures(text: str) -> list[tuple[str, str, str]]:
    """(section module, name, whole span) of every signature-like span of the document."""
    out = []
    for module, body in sections(text):
        for m in SPAN.finditer(body):
            span = " ".join(m.group(1).split())  # a span may wrap over lines
            s = SIGNATURE.match(span)
            if s:
                out.append((module, s.group(1), span))
    return out


def resolve(module: str, name: str):
    """The object ``name`` names in ``module`` (an attribute path), or in the module it spells out in full."""
    if name.startswith("lightning_moe."):
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            rest = parts[cut:]
            break
    else:
        obj, rest = importlib.import_module(module), name.split(".")
    for part in rest:
        obj = getattr(obj, part)
    return obj


def real_parameters(obj) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(obj).parameters)
    params.pop("self", None)
    return params


TEXT = open(DOC).read()
SIGNATURES = signatures(TEXT)


def test_every_section_names_a_module():
    mods = [m for m, _ in sections(TEXT)]
    assert len(mods) >= 30, mods
    for m in mods:
        importlib.import_module(m)


def test_the_document_has_signatures():
    assert len(SIGNATURES) >= 100, len(SIGNATURES)  # the extraction rule still finds them


@pytest.mark.parametrize("module,name,span", SIGNATURES, ids=[f"{m}:{s}"[:90] for m, _, s in SIGNATURES])
def test_signature_matches_the_code(module, name, span):
    try:
        obj = resolve(module, name)
    except AttributeError as e:
        raise AssertionError(f"INTERFACES.md, section {module}: `{span}`: {name} does not exist ({e})") from None
    assert callable(obj), f"INTERFACES.md, section {module}: {name} is not callable"
    real = real_parameters(obj)
    shown, partial = [], False
    for item in split_args(parameter_list(span, name)):
        if item == "...":
            partial = True
            continue
        if item in ("*", "/"):
            continue
        p = PARAM.match(item)
        assert p, f"INTERFACES.md, section {module}: `{span}`: cannot read parameter {item!r}"
        pname = p.group(1)
        assert pname in real, (f"INTERFACES.md, section {module}: `{span}`: {name} has no parameter {pname!r} "
                               f"(it has {list(real)})")
        shown.append(pname)
        if "=" in item and not item.startswith("*"):
            default = item.split("=", 1)[1].strip()
            try:
                value = ast.literal_eval(default)
            except (ValueError, SyntaxError):
                continue  # not a literal (a name, an expression): not compared
            if value is Ellipsis:
                continue  # `name=...`: default left out
            actual = real[pname].default
            assert actual is not inspect.Parameter.empty and actual == value, (
                f"INTERFACES.md, section {module}: `{span}`: {name}'s {pname} defaults to {actual!r}, not {value!r}")
    if not partial:
        missing = [p for p in real if p not in shown]
        assert not missing, (f"INTERFACES.md, section {module}: `{span}`: {name} also has {missing} "
                             f"(list them, or end the list with ...)")
