"""The fleet page read back as a browser sees it: tiles, banners, counts, scripts and every
element with its attributes (for the page as served, or as Chromium's ``--dump-dom`` has it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser

#: Elements that have no end tag.
_VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "wbr"})


@dataclass
class Tile:
    """One host's tile: its name, state (from its colour class), link, hover text, second
    line, and whether it is outlined (a problem besides the state)."""

    name: str = ""
    state: str = ""
    href: str = ""
    title: str = ""
    second: str = ""
    outlined: bool = False


@dataclass
class Element:
    """A start tag with its attributes (values unescaped, as a browser has them)."""

    tag: str
    attrs: dict[str, str | None]


@dataclass
class Page:
    """What a page holds, in document order."""

    elements: list[Element] = field(default_factory=list)
    tiles: list[Tile] = field(default_factory=list)
    banners: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    scripts: list[str] = field(default_factory=list)
    styles: list[str] = field(default_factory=list)
    pres: list[str] = field(default_factory=list)
    title: str = ""
    text: str = ""

    @property
    def states(self) -> dict[str, str]:
        """Host name -> state, from the tiles."""
        return {tile.name: tile.state for tile in self.tiles}


class _Reader(HTMLParser):
    """Collects a Page while the parser walks the document."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._stack: list[tuple[str, dict[str, str | None]]] = []
        self._tile: Tile | None = None
        self._part = ""  # what the current text belongs to
        self._buffer: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Note the element; start collecting the text of a tile's lines, a banner, a count,
        a script, a style, a ``pre`` or the title."""
        a = dict(attrs)
        self.page.elements.append(Element(tag, a))
        classes = (a.get("class") or "").split()
        if tag == "a" and "t" in classes:
            state = next((c[2:] for c in classes if c.startswith("s-")), "")
            self._tile = Tile(
                state=state,
                href=a.get("href") or "",
                title=a.get("title") or "",
                outlined="x" in classes,
            )
        elif self._tile is not None and tag in ("b", "i"):
            self._start(tag)
        elif tag == "div" and "banner" in classes:
            self._start("banner")
        elif tag == "li" and self._stack and "counts" in (self._stack[-1][1].get("class") or ""):
            self._start("count")
        elif tag in ("script", "style", "pre", "title"):
            self._start(tag)
        if tag not in _VOID:
            self._stack.append((tag, a))

    def _start(self, part: str) -> None:
        """Collect text for ``part`` (unless something is being collected already)."""
        if not self._part:
            self._part, self._buffer = part, []

    def handle_endtag(self, tag: str) -> None:
        """File the text collected for the part this tag ends."""
        if self._stack and self._stack[-1][0] == tag:
            self._stack.pop()
        part, done = self._part, "".join(self._buffer)
        ends = {"banner": "div", "count": "li"}.get(part, part)
        if part and tag == ends:
            self._part = ""
            if part == "b" and self._tile is not None:
                self._tile.name = done
            elif part == "i" and self._tile is not None:
                self._tile.second = done
            elif part == "banner":
                self.page.banners.append(done)
            elif part == "count":
                label, _, number = done.rpartition(" ")
                self.page.counts[label] = int(number)
            elif part == "script":
                self.page.scripts.append(done)
            elif part == "style":
                self.page.styles.append(done)
            elif part == "pre":
                self.page.pres.append(done)
            elif part == "title":
                self.page.title = done
        if tag == "a" and self._tile is not None:
            self.page.tiles.append(self._tile)
            self._tile = None

    def handle_data(self, data: str) -> None:
        """Text: to the part being collected, and to the page's text (not scripts, styles)."""
        if self._part:
            self._buffer.append(data)
        if self._part not in ("script", "style"):
            self._text.append(data)

    def close(self) -> None:
        """Finish; the page's text is complete."""
        super().close()
        self.page.text = "".join(self._text)


def parse_page(html: str) -> Page:
    """The page ``html`` as read back."""
    reader = _Reader()
    reader.feed(html)
    reader.close()
    return reader.page
