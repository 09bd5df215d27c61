"""What a package index shows: the README's links work off the repository (absolute), the
metadata names the licence by SPDX (PEP 639) and ships its file, and the project has URLs,
classifiers and keywords. The wheel itself is built and inspected in test_ops_docker.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_readme_links_are_absolute() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets, "no links found: the pattern is broken"
    relative = [t for t in targets if not t.startswith(("https://", "http://", "#"))]
    assert relative == [], f"relative links break on a package index: {relative}"
    # The pictures too (an index renders images from absolute URLs only).
    assert "raw.githubusercontent.com/streamfence/streamfence/main/docs/" in readme


def test_licence_metadata_follows_pep_639() -> None:
    project = PROJECT["project"]
    assert project["license"] == "MIT"  # an SPDX expression, not a table
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    # setuptools reads PEP 639 metadata from version 77 on.
    (backend,) = PROJECT["build-system"]["requires"]
    assert re.fullmatch(r"setuptools>=(\d+)", backend)
    assert int(backend.split(">=")[1]) >= 77
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639


def test_index_metadata() -> None:
    project = PROJECT["project"]
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(project["urls"])
    assert all(url.startswith("https://") for url in project["urls"].values())
    assert len(project["keywords"]) >= 5
    classifiers = project["classifiers"]
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert any(c.startswith("Topic :: Internet :: Proxy Servers") for c in classifiers)
    assert "otel" in project["optional-dependencies"]


def test_readme_says_to_install_in_its_own_environment() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "`proxy.py`" in readme  # why: the same import name, `proxy`
    assert "python3 -m venv ~/.streamfence" in readme


def _shell_blocks(readme: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)


def test_readme_installs_from_what_exists() -> None:
    # The package is not on PyPI yet: `pipx install streamfence`, the README's first install
    # line once, failed for every new user. Commands install from the repository (the lock,
    # then the package without dependencies); the index's name only where the README says
    # "once published".
    readme = (ROOT / "README.md").read_text()
    assert "not published on PyPI yet" in readme
    first = _shell_blocks(readme)[0]
    assert "pip install --require-hashes -r requirements.txt" in first
    assert "pip install --no-deps ." in first
    from_index = re.compile(r"\bpipx? install ['\"]?streamfence\b")
    for block in _shell_blocks(readme):
        assert not from_index.search(block), block
    for paragraph in readme.split("\n\n"):
        if from_index.search(paragraph):
            assert "once the package is published" in paragraph.lower(), paragraph
