"""Write docs/ckptfs.1, the ckptfs(1) man page, from the CLI's parser (ckptfs.cliref.man), so
that the page cannot drift from the options: run it after changing an option or its help.

    .venv/bin/python scripts/gen_man.py           # writes docs/ckptfs.1
    .venv/bin/python scripts/gen_man.py --check   # exit 1 if docs/ckptfs.1 is not up to date

tests/unit/test_cli_conventions.py fails when the checked-in page differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckptfs import cliref
from ckptfs.cli import build_parser

PAGE = Path(__file__).resolve().parent.parent / "docs" / "ckptfs.1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only compare: exit 1 if the page is not what the parser gives")
    ap.add_argument("--out", type=Path, default=PAGE, help=f"where to write (default {PAGE})")
    a = ap.parse_args(argv)
    text = cliref.man(build_parser())
    if a.check:
        current = a.out.read_text() if a.out.exists() else ""
        if current != text:
            print(f"gen_man: {a.out} is out of date; run scripts/gen_man.py", file=sys.stderr)
            return 1
        return 0
    a.out.write_text(text)
    print(f"gen_man: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
