"""Every fenced block of README.md and docs/ is run (tiny sizes) or parsed, page by page, as
tests/docs/harness.py describes; the counts of what ran and what was only parsed are printed at the end of
the session (``docs blocks: ...``)."""

from __future__ import annotations

import shutil

import pytest

from tests.docs.harness import PAGES, walk

#: pages whose commands use another page's outputs: that page's runs/ is copied in first. The docs pages
#: assume the README's commands ran (``runs/tiny``); docs/serve_rm.md serves docs/rm.md's reward model.
NEEDS = {**{p: "README.md" for p in PAGES if p.startswith("docs/")}, "docs/serve_rm.md": "docs/rm.md"}
COUNTS: dict[str, dict[str, int]] = {}
COUNTS_KEY = "docs_block_counts"  # read by tests/conftest.py (pytest_runtest_logreport)


@pytest.fixture(scope="module")
def pages_home(tmp_path_factory):
    return tmp_path_factory.mktemp("docs_pages")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_or_parse(page, pages_home, record_property):
    folder = pages_home / page.replace("/", "_")
    needed = NEEDS.get(page)
    if needed:
        source = pages_home / needed.replace("/", "_") / "runs"
        if not source.is_dir():
            walk(needed, pages_home / needed.replace("/", "_"))
        shutil.copytree(source, folder / "runs", symlinks=True)
    # through the test report (record_property), so the counts reach the controller under pytest-xdist too
    # (tests/conftest.py collects them from every report and prints the summary line)
    record_property(COUNTS_KEY, {"page": page, "counts": walk(page, folder)})


def docs_summary() -> str | None:
    if not COUNTS:
        return None
    total: dict[str, int] = {}
    for counts in COUNTS.values():
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
    ran = sum(n for k, n in total.items() if " run" in k)
    parsed = sum(n for k, n in total.items() if "parsed" in k)
    detail = ", ".join(f"{k}: {n}" for k, n in sorted(total.items()))
    return f"docs blocks: {len(COUNTS)} pages, {ran} run, {parsed} only parsed ({detail})"
