"""Writes docs/modules.md: one line per module of pdserve, from the first sentence of its docstring.

  python docs/gen_modules.py          (tests/test_structure.py checks the file lists every module)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".") if text else ""


def render() -> str:
    lines = ["# Modules", "", "One line per module, from its docstring (`python docs/gen_modules.py` rewrites this "
             "file).", ""]
    for path in sorted((ROOT / "pdserve").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py" and not first_line(path):
            continue
        lines.append(f"- `{rel.as_posix()}`: {first_line(path) or '(no docstring)'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = ROOT / "docs" / "modules.md"
    out.write_text(render())
    print(f"wrote {out}", file=sys.stderr)
