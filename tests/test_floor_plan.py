"""The floor plan's rules that import-linter does not check (scripts/lint runs it for the
layers and cycles, docs/architecture.md): no module over 350 lines, and nothing outside the
registry asks which registry backend it has."""

from __future__ import annotations

import re
from pathlib import Path

PROXY = Path(__file__).resolve().parent.parent / "proxy"
MODULES = sorted(PROXY.rglob("*.py"))


def test_there_are_modules_to_check() -> None:
    assert len(MODULES) > 50


def test_no_module_is_over_350_lines() -> None:
    long = {
        str(m.relative_to(PROXY)): n
        for m in MODULES
        if (n := len(m.read_text().splitlines())) > 350
    }
    assert long == {}


def test_only_the_registry_knows_its_backends() -> None:
    backend = re.compile(r"\b(RedisRegistry|MemoryRegistry)\b")
    outside = [
        f"{m.relative_to(PROXY)}:{i}"
        for m in MODULES
        if m.parent.name != "registry" and "registry" not in m.parts
        for i, line in enumerate(m.read_text().splitlines(), 1)
        if backend.search(line)
    ]
    assert outside == []
