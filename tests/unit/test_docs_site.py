"""The documentation: the README is the newcomer's page, the reference lives in docs/ and builds as an MkDocs
site (mkdocs.yml) whose strict build fails on any warning, a link to a missing page or anchor included.
`make docs` runs that build in `make test`; here the same build runs in-process (about a second), and again on
a copy of the site with a broken link planted, to prove the configuration makes it fail."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"


def _build(config: Path, site: Path) -> None:
    build(load_config(str(config), site_dir=str(site)))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("site")
    _build(ROOT / "mkdocs.yml", d)
    return d


def test_the_site_builds_with_every_page_in_it(site):
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert {"index", "usage", "layout", "live", "logs", "releases", "fleet", "undo", "security", "tests",
            "speed"} <= set(pages)
    for page in pages:
        assert (site / f"{page}.html").is_file(), page


def test_the_site_loads_nothing_from_the_network(site):
    """The built pages open offline: no script or stylesheet from a CDN (the theme's highlight.js is off)."""
    for html in site.glob("*.html"):
        text = html.read_text()
        assert not re.search(r'<script[^>]+src="(https?:)?//', text), html.name
        assert not re.search(r'<link[^>]+href="(https?:)?//', text), html.name


@pytest.fixture
def copy(tmp_path) -> Path:
    """mkdocs.yml and docs/ copied (the benchmark page's symlink followed), to plant a fault in."""
    shutil.copy2(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


@pytest.mark.parametrize("plant, said", [
    ("[x](no-such-page.md)", "'no-such-page.md', but the target is not found"),
    ("[x](usage.md#no-such-anchor)", "does not contain an anchor '#no-such-anchor'"),
    ("[x](#no-such-anchor-here)", "no such anchor on this page"),
    ("[x](/usage.md)", "absolute link '/usage.md'"),
])
def test_a_broken_internal_link_fails_the_strict_build(copy, plant, said, caplog):
    with (copy / "docs" / "index.md").open("a") as f:
        f.write(f"\nSee {plant}.\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort):
        _build(copy / "mkdocs.yml", copy / "site")
    assert said in caplog.text


def test_a_page_left_out_of_the_nav_fails_the_strict_build(copy, caplog):
    (copy / "docs" / "orphan.md").write_text("# Orphan\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort):
        _build(copy / "mkdocs.yml", copy / "site")
    assert "orphan.md" in caplog.text


def test_every_link_of_the_readme_resolves(site):
    """The README is not part of the site: its links into docs/ are checked against the built pages' anchors."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert sum(link.startswith("docs/") for link in links) >= 10, links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README links to {link}: no {target}"
        if anchor:
            assert path.startswith("docs/") and path.endswith(".md"), f"{link}: an anchor the site cannot check"
            html = (site / Path(path).relative_to("docs").with_suffix(".html")).read_text()
            assert f'id="{anchor}"' in html, f"README links to {link}: no such anchor"


def test_the_readme_first_screen_goes_from_install_to_an_answer():
    first = "\n".join(README.read_text().splitlines()[:45])
    assert "pipx install" in first
    assert re.search(r"^mla-doctor run --host \S+", first, re.M), first


def test_make_test_builds_the_docs_strictly_right_after_the_guard():
    text = MAKEFILE.read_text().replace("\\\n", " ")
    prereqs = re.search(r"^test:(.*)$", text, re.M).group(1).split()
    assert prereqs.index("docs") == prereqs.index("guard") + 1, prereqs
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    assert "mkdocs build --strict" in recipe
    assert not re.search(r"\s(-q|--quiet)\b", recipe), "--quiet hides the warnings --strict counts"
    assert "docs" in re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^test = \[.*"mkdocs==1\.6\.1"', pyproject, re.M)  # `make setup` installs it
