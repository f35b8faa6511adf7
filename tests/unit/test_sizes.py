"""The size limits scripts/lint.sh holds the code to (scripts/sizes.py): a module of at most 1000
code lines, a class of at most 400, a function of at most 120; blank, comment and docstring
lines are not counted. One over each limit fails, the limit itself passes, and the checkout
passes as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import sizes


def function(name: str, code_lines: int, indent: str = "") -> str:
    """A function of exactly `code_lines` code lines (its def included), with a docstring, a
    comment and blank lines between, none of which count."""
    body = [f"{indent}def {name}() -> int:", f'{indent}    """A docstring.', "",
            f'{indent}    Over two lines."""', f"{indent}    x = 0"]
    for i in range(code_lines - 3):
        body += ["", f"{indent}    # a comment", f"{indent}    x += {i}"]
    body.append(f"{indent}    return x")
    return "\n".join(body) + "\n"


def klass(code_lines: int) -> str:
    """A class of exactly `code_lines` code lines: its header and methods of 100 lines."""
    parts, left, i = ["class Big:", '    """Docstring."""'], code_lines - 1, 0
    while left > 0:
        n = min(100, left)
        if n < 3:  # the smallest method here is 3 lines: take them from the one before
            parts[-1] = function(f"m{i - 1}", 100 - (3 - n), "    ")
            n = 3
        parts.append(function(f"m{i}", n, "    "))
        left -= n
        i += 1
    return "\n".join(parts)


def breaches(source: str) -> list[sizes.Breach]:
    return list(sizes.check_source("t.py", source))


@pytest.mark.parametrize("n", [120, 121])
def test_function_limit(n):
    found = breaches(function("f", n))
    want = [] if n <= 120 else [("function", "f", n)]
    assert [(b.kind, b.name, b.lines) for b in found] == want


@pytest.mark.parametrize("n", [400, 401])
def test_class_limit(n):
    found = [b for b in breaches(klass(n)) if b.kind == "class"]
    assert [(b.name, b.lines) for b in found] == ([] if n <= 400 else [("Big", n)])


@pytest.mark.parametrize("n", [1000, 1001])
def test_module_limit(n):
    src = "".join(function(f"f{i}", 100) for i in range(n // 100))
    if n % 100:
        src += "".join(f"y{i} = {i}\n" for i in range(n % 100))
    found = breaches(src)
    assert [(b.kind, b.lines) for b in found] == ([] if n <= 1000 else [("module", n)])


def test_the_checkout_keeps_to_the_limits():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "sizes.py")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == ""


def test_breaches_exit_1_and_name_the_place(tmp_path):
    (tmp_path / "m.py").write_text(function("too_long", 121))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "sizes.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    where = tmp_path / "m.py"
    assert res.stdout == f"{where}:1: function too_long has 121 code lines (limit 120)\n"
