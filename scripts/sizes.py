"""Size limits on the code, run by scripts/lint.sh: a module of at most 1000 code lines, a class
of at most 400 and a function (or method) of at most 120. Code lines are what is left without
blank lines, comment-only lines and docstrings: the limits are about how much logic one reader
must hold at once, not about how well it is explained.

    python scripts/sizes.py [PATH ...]      # default: ckptfs cachemgr scripts

Prints one line per breach, `path:line: kind name has N code lines (limit L)`, and exits 1 if
there is any, 0 otherwise (2 for a file that does not parse)."""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MODULE_LIMIT = 1000
CLASS_LIMIT = 400
FUNCTION_LIMIT = 120
DEFAULT_PATHS = ("ckptfs", "cachemgr", "scripts")


@dataclass(frozen=True)
class Breach:
    path: str
    line: int
    kind: str
    name: str
    lines: int
    limit: int

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.kind} {self.name} has {self.lines} code lines "
                f"(limit {self.limit})")


def _non_code_lines(source: str, tree: ast.Module) -> set[int]:
    """Line numbers (1-based) that hold only a comment, only whitespace, or part of a
    docstring."""
    skip: set[int] = set()
    lines = source.splitlines()
    for i, text in enumerate(lines, 1):
        if not text.strip():
            skip.add(i)
    code_on: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        for ln in range(tok.start[0], tok.end[0] + 1):
            code_on.add(ln)
    skip.update(i for i in range(1, len(lines) + 1) if i not in code_on)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                end = body[0].end_lineno or body[0].lineno
                skip.update(range(body[0].lineno, end + 1))
    return skip


def _count(first: int, last: int, skip: set[int]) -> int:
    return sum(1 for ln in range(first, last + 1) if ln not in skip)


def check_source(path: str, source: str) -> Iterator[Breach]:
    """Every breach of the limits in one module's source."""
    tree = ast.parse(source, filename=path)
    skip = _non_code_lines(source, tree)
    total = _count(1, len(source.splitlines()), skip)
    if total > MODULE_LIMIT:
        yield Breach(path, 1, "module", Path(path).stem, total, MODULE_LIMIT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", CLASS_LIMIT
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", FUNCTION_LIMIT
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = _count(first, node.end_lineno or node.lineno, skip)
        if n > limit:
            yield Breach(path, node.lineno, kind, node.name, n, limit)


def _generated(path: Path) -> bool:
    """Code a generator wrote (protoc's stubs, scripts/gen_csi.sh): nobody's logic to hold."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return "DO NOT EDIT!" in f.read(200)


def python_files(paths: list[str]) -> Iterator[Path]:
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*.py")
                              if ".venv" not in f.parts and not _generated(f))
        else:
            yield p


def main(argv: list[str]) -> int:
    paths = argv or list(DEFAULT_PATHS)
    breaches = 0
    for f in python_files(paths):
        try:
            found = list(check_source(str(f), f.read_text(encoding="utf-8")))
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            print(f"sizes: {f}: {e}", file=sys.stderr)
            return 2
        for b in found:
            print(b)
        breaches += len(found)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
