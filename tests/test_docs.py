"""The documents hold together: every relative link resolves, and CI runs exactly the README's test command."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)   # code blocks hold no links
    return LINK.findall(text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.exists()
    dead = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto: are not checked (no network)
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            dead.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, f"dead links in {doc.relative_to(ROOT)}: {dead}"


def test_slug_matches_github():
    assert slug("The decision API (`/v1/systemone`)") == "the-decision-api-v1systemone"
    assert slug("Ray Serve's throughput mode and HAProxy") == "ray-serves-throughput-mode-and-haproxy"
    assert slug("The engine on a thread (`bench.engine_loop`)") == "the-engine-on-a-thread-benchengine_loop"


def readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert len(commands) == 1, f"the README should show one test command, found {commands}"
    return commands[0].strip()


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [line for line in ci if line and not line.startswith("#")]
    assert ci[-1] == readme_test_command(), ".ci/run must end with exactly the README's test command"
    assert sum("pytest" in line for line in ci) == 1
    assert any("apt-get install" in line and "chromium" in line for line in ci), "CI installs the browser tests' browser"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
