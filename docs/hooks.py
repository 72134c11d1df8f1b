"""mkdocs hooks: the knob tables, and the repository's pictures the pages show.

- Each `<!-- knobs: SPEC -->` line of a page becomes the knob table that tools/knobs.py
  generates from the config dataclasses' declarations.
- A picture a page links from the repository outside docs/ (`../experiments/results/x.png`,
  the link that also works when the page is read as a file) is copied into the site at the
  same path, and the link points there.
- Any other link to a file outside docs/ (`../benchmarks/README.md`) becomes the file's path
  in the repository, as code: the site holds docs/ only.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _importable() -> None:
    """The repository's own folders (tools/, the example models/) are not installed: put the
    checkout on the path (mkdocs loads hooks with its own path, and restores it after)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


_importable()
from tools import knobs  # noqa: E402

PICTURE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+\.(?:png|svg|jpg|jpeg|gif))(\))")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<link>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def _outside(src_uri: str, link: str) -> str | None:
    """The repository path of what `link` on page `src_uri` names, if it lies outside docs/."""
    if "://" in link or link.startswith("/"):
        return None
    target = (DOCS / posixpath.dirname(src_uri) / link).resolve()
    if target.is_relative_to(DOCS) or not target.is_relative_to(ROOT) or not target.exists():
        return None
    return target.relative_to(ROOT).as_posix()


def on_files(files, config):
    wanted = set()
    for page in files.documentation_pages():
        text = Path(page.abs_src_path).read_text()
        wanted |= {p for m in PICTURE.finditer(text) if (p := _outside(page.src_uri, m[2]))}
    for path in sorted(wanted):
        if files.get_file_from_path(path) is None:
            files.append(File.generated(config, path, abs_src_path=str(ROOT / path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    _importable()
    src = page.file.src_uri

    def relink(m: re.Match) -> str:
        path = _outside(src, m[2])
        if path is None:
            return m[0]
        return m[1] + posixpath.relpath(path, posixpath.dirname(src) or ".") + m[3]

    def to_path(m: re.Match) -> str:
        path = _outside(src, m["link"])
        if path is None:
            return m[0]
        return f"`{path}`" if m["text"].strip("`") == path else f"{m['text']} (`{path}`)"

    return LINK.sub(to_path, PICTURE.sub(relink, knobs.expand(markdown)))
