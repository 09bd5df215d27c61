"""What a reader of the repository and a package index see: the README's and the docs' links
resolve in a clone (relative: offline, on any host), every "CONTRACT section N" names a section
of docs/contract.md, the metadata names the licence by SPDX (PEP 639) and ships its file, and
the project has URLs, classifiers and keywords. The wheel itself is built and inspected in
test_ops_docker.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub (and most renderers) make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_in_the_readme_and_docs_resolve_in_the_repository() -> None:
    # Relative, so that they work in a clone, offline, and on any host of the repository
    # (the status page's picture included): each names a file that exists and, with an
    # anchor, a heading of it. Absolute links to the project's own repository go stale.
    checked = 0
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("https://", "http://", "mailto:")):
                assert "github.com/streamfence" not in target, f"{doc.name}: {target}"
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
                assert anchor in {_slug(h) for h in headings}, f"{doc.name}: {target}"
            checked += 1
    assert checked > 20, "no links found: the pattern is broken"


def test_every_contract_reference_resolves() -> None:
    # Code and docs cite "CONTRACT section N": docs/contract.md, shipped with the project.
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs/contract.md").read_text(), re.M))
    assert sections == {str(n) for n in range(1, 9)}
    files = [*DOCS, *ROOT.glob("proxy/**/*.py"), *ROOT.glob("tests/**/*.py")]
    cited = {
        (f.name, n)
        for f in files
        if "node_modules" not in f.parts
        for n in re.findall(r"CONTRACT(?: section|,? section)? (\d+)", f.read_text())
    }
    assert cited, "no references found: the pattern is broken"
    assert {n for _, n in cited} <= sections, sorted(c for c in cited if c[1] not in sections)


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
    assert "environment of its own" in readme
    assert "`proxy.py`" in readme  # why: the same import name, `proxy`
    assert "python3 -m venv ~/.streamfence" in (ROOT / "docs/operations.md").read_text()


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
