"""What tests/test_docs.py reads out of the markdown pages: fenced ```python blocks and links.

A ```python block runs as a test unless the line right before its fence is a marker with a reason:

    <!-- not run: needs a CUDA device -->

The reason is the pytest skip reason. A marker without a reason, or not right before a ```python
fence, is an error, so a marker cannot silently switch off a block further down.

Links: ``[text](target)``, ``![alt](target)`` and HTML ``href=``/``src=`` outside code. Anchors
(``#part``) are matched against the target page's headings as GitHub names them: the heading's
text without markup, lower-cased, every character that is not a letter, digit, space, ``-`` or
``_`` dropped, spaces turned into ``-``, and ``-1``, ``-2``, ... added to repeats.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

FENCE = re.compile(r"^( *)(`{3,}|~{3,})\s*([\w+-]*)")  # indented: inside a list item
MARKER = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]*)\"", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


@dataclass
class Block:
    """One ```python block: where it is, its code, and the reason it is not run (or None)."""
    path: str
    line: int  # the markdown line of the block's first code line (1-based)
    code: str
    skip: Optional[str]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
        elif fence is not None and line.strip().startswith(fence) \
                and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            out.append((n, line))
    return out


def python_blocks(path: str, text: Optional[str] = None) -> list[Block]:
    """The ```python blocks of a markdown file, in order, with their not-run reasons."""
    lines = (open(path, encoding="utf-8").read() if text is None else text).split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker:
            reason = marker.group(1).strip()
            if not reason:
                raise ValueError(f"{path}:{i + 1}: 'not run:' marker without a reason")
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not nxt or nxt.group(3) != "python":
                raise ValueError(f"{path}:{i + 1}: a 'not run:' marker must be the line right "
                                 "before a ```python fence")
        fence = FENCE.match(lines[i])
        if fence:
            indent, mark = len(fence.group(1)), fence.group(2)
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(mark):
                end += 1
            if end == len(lines):
                raise ValueError(f"{path}:{i + 1}: code fence never closed")
            if fence.group(3) == "python":
                before = MARKER.match(lines[i - 1].strip()) if i else None
                code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
                blocks.append(Block(path, i + 2, code, before.group(1).strip() if before else None))
            i = end
        i += 1
    return blocks


def run_block(block: Block, namespace: dict) -> None:
    """Run a block in `namespace`; a traceback names the markdown file and its line."""
    code = compile("\n" * (block.line - 1) + block.code, block.path, "exec")
    exec(code, namespace)  # noqa: S102 - the project's own documentation


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("**", "").replace("*", "")
    text = "".join(c for c in text.strip().lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside code."""
    out = []
    for n, line in _prose_lines(text):
        prose = CODE_SPAN.sub("", line)
        out += [(n, m.group(1)) for m in LINK.finditer(prose)]
        out += [(n, m.group(1)) for m in HTML_LINK.finditer(prose)]
    return out


def broken_links(path: str, root: str) -> list[str]:
    """What is wrong with the links of one markdown file (an empty list when nothing is)."""
    text = open(path, encoding="utf-8").read()
    where = os.path.relpath(path, root)
    problems = []
    for n, target in links(text):
        url = urlparse(target)
        if url.scheme in ("http", "https"):
            if not url.netloc or " " in target:
                problems.append(f"{where}:{n}: malformed URL {target!r}")
            continue
        if url.scheme:
            problems.append(f"{where}:{n}: unexpected link scheme in {target!r}")
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            dest = os.path.join(root, file_part.lstrip("/"))
        else:
            dest = (os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                    if file_part else path)
        if not os.path.exists(dest):
            problems.append(f"{where}:{n}: {target!r}: no such file {os.path.relpath(dest, root)}")
            continue
        if anchor:
            if not dest.endswith(".md") or os.path.isdir(dest):
                problems.append(f"{where}:{n}: {target!r}: an anchor into a non-markdown file")
            elif anchor not in anchors(open(dest, encoding="utf-8").read()):
                problems.append(f"{where}:{n}: {target!r}: no heading #{anchor} in "
                                f"{os.path.relpath(dest, root)}")
    return problems
