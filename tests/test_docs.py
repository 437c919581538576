"""The docs run: every fenced ```python block of README.md and docs/*.md is a test, on demo data.

- Blocks of one page run in order in one namespace, so a page may build on its earlier blocks
  (running one block alone, e.g. with -k, first runs the page's earlier blocks).
- Each page runs in a folder of its own (a fresh temporary one) holding ``train/``: the demo
  ImageFolder, 48 ImageNet-like JPEGs in 4 classes, made once per session by
  ``scripts/tools/make_dataset.py``. Paths in the docs (``"train/"``, ``"train.plc"``,
  ``"shards/..."``, ``"corpus"``) are used there as written.
- Names a page may use without defining them (the docs' placeholders), each the real thing:
  ``DATA`` (the demo ImageFolder's path), ``dataset`` and ``ds`` (one ``vision.ImageFolder`` of
  it: decode, RandomResizedCrop(64), flip, ToCHW; real JPEG decoding in real workers).
- A block runs unless it is marked ``<!-- not run: REASON -->`` on the line before its fence
  (tests/doc_blocks.py); pytest shows REASON as the skip reason (``pytest -rs`` or ``-v``).
- Every link and image of the top-level pages, docs/ and scripts/README.md must point to a file
  that exists, and every ``#anchor`` to a heading of its target (GitHub's rules); http(s) links
  are checked for form only (no network).
"""
from __future__ import annotations

import gc
import glob
import importlib.util
import os
import textwrap

import pytest

from doc_blocks import Block, broken_links, python_blocks, run_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCKS = [b for page in PAGES for b in python_blocks(os.path.join(ROOT, page))]
LINKED_PAGES = sorted(glob.glob(os.path.join(ROOT, "*.md"))
                      + glob.glob(os.path.join(ROOT, "docs", "*.md"))
                      + [os.path.join(ROOT, "scripts", "README.md")])
DEMO_IMAGES, DEMO_CLASSES = 48, 4


@pytest.fixture(scope="session")
def demo_folder(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location(
        "make_dataset", os.path.join(ROOT, "scripts", "tools", "make_dataset.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    out = str(tmp_path_factory.mktemp("docs_data") / "imagenet_demo")
    maker.make_dataset(out, n=DEMO_IMAGES, classes=DEMO_CLASSES, seed=0, progress=False)
    return out


class Pages:
    """One namespace and one folder per page; the blocks of a page run once, in order."""

    def __init__(self, data: str, tmp_path_factory) -> None:
        self.data, self.tmp = data, tmp_path_factory
        self.spaces: dict[str, dict] = {}
        self.folders: dict[str, str] = {}
        self.done: dict[str, set[int]] = {}

    def folder(self, page: str) -> str:
        if page not in self.folders:
            folder = self.tmp.mktemp("page_" + os.path.basename(page).replace(".", "_"))
            os.symlink(self.data, folder / "train")
            self.folders[page] = str(folder)
        return self.folders[page]

    def namespace(self, page: str) -> dict:
        if page not in self.spaces:
            from pooled_loader.vision import (Compose, DecodeImage, ImageFolder,
                                              RandomHorizontalFlip, RandomResizedCrop, ToCHW)
            ds = ImageFolder(self.data, transform=Compose([
                DecodeImage(), RandomResizedCrop(64), RandomHorizontalFlip(), ToCHW()]))
            self.spaces[page] = {"__name__": "__doc_page__", "DATA": self.data,
                                 "dataset": ds, "ds": ds}
            self.done[page] = set()
        return self.spaces[page]

    def run(self, block: Block) -> None:
        """Run the page's earlier blocks not run yet (their failures are their own tests'),
        then this one, whose failure fails the test."""
        page = block.path
        space = self.namespace(page)
        for earlier in python_blocks(page):
            if earlier.line >= block.line:
                break
            if earlier.skip is None and earlier.line not in self.done[page]:
                self.done[page].add(earlier.line)
                try:
                    run_block(earlier, space)
                except Exception:  # noqa: BLE001 - reported by that block's own test
                    pass
        self.done[page].add(block.line)
        run_block(block, space)

    def close(self) -> None:
        from pooled_loader import PooledLoader
        for space in self.spaces.values():
            for value in list(space.values()):
                if isinstance(value, PooledLoader):
                    value.close()
            space.clear()
        gc.collect()


@pytest.fixture(scope="module")
def pages(demo_folder, tmp_path_factory):
    state = Pages(demo_folder, tmp_path_factory)
    yield state
    state.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{os.path.relpath(b.path, ROOT)}:{b.line}"
                                                for b in BLOCKS])
def test_doc_block_runs(block, pages, monkeypatch):
    if block.skip:
        pytest.skip(f"{os.path.relpath(block.path, ROOT)}:{block.line}: not run: {block.skip}")
    monkeypatch.chdir(pages.folder(block.path))
    pages.run(block)


def test_most_doc_blocks_run():
    """Not-run is the exception: at least three in four blocks run."""
    skipped = [f"{b.path}:{b.line} ({b.skip})" for b in BLOCKS if b.skip]
    assert len(BLOCKS) >= 10 and len(skipped) * 4 <= len(BLOCKS), skipped


def test_a_raising_block_fails_and_names_its_markdown_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        # A page
        ```python
        x = 41
        ```
        Text.
        <!-- not run: needs a GPU -->
        ```python
        import nothing_here
        ```
        ```python
        y = x + 1
        raise RuntimeError(f"boom {y}")
        ```
        """))
    first, gpu, failing = python_blocks(str(page))
    assert (first.line, first.skip, gpu.skip, failing.line) == (3, None, "needs a GPU", 11)
    space: dict = {}
    run_block(first, space)
    with pytest.raises(RuntimeError, match="boom 42") as info:
        run_block(failing, space)
    where = info.traceback[-1]
    assert (str(where.path), where.lineno + 1) == (str(page), 12)  # the raise's markdown line


def test_a_not_run_marker_needs_a_reason_and_a_python_fence_below(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="without a reason"):
        python_blocks(str(page))
    page.write_text("<!-- not run: slow -->\n\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="right before"):
        python_blocks(str(page))


@pytest.mark.parametrize("path", LINKED_PAGES, ids=[os.path.relpath(p, ROOT) for p in LINKED_PAGES])
def test_every_link_and_anchor_of_a_page_resolves(path):
    assert broken_links(path, ROOT) == []


def test_the_link_check_finds_a_missing_file_a_missing_anchor_and_a_bad_url(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n## Cache, prefetch: `x.y`\n## Cache, prefetch: `x.y`\n")
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        # Top
        [ok](other.md#cache-prefetch-xy) [ok too](other.md#cache-prefetch-xy-1) [self](#top)
        [gone](missing.md) ![img](pics/none.png) [no anchor](other.md#nowhere)
        [bad](https://) `[in code](missing.md)`
        ```
        [in a fence](missing.md)
        ```
        """))
    problems = broken_links(str(page), str(tmp_path))
    assert len(problems) == 4, problems
    assert all(p.startswith("page.md:3:") for p in problems[:3]) and "page.md:4:" in problems[3]
    assert "missing.md" in problems[0] and "pics/none.png" in problems[1]
    assert "#nowhere" in problems[2] and "malformed URL" in problems[3]
