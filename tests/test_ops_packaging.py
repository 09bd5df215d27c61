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
    assert "pipx install streamfence" in readme
    assert "`proxy.py`" in readme  # why: the same import name, `proxy`
