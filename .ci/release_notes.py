#!/usr/bin/env python3
"""Print the CHANGELOG.md section of a release: the text of its GitHub release.

    python3 .ci/release_notes.py v0.2.0

prints the body of `## [0.2.0] - YYYY-MM-DD`. It exits 2 with one line saying what is wrong
when the tag is not a `vX.Y.Z` version, or that version's section is missing, has no valid date
or has no `### Upgrade notes` (a release with nothing to do says so there). The release workflow
(.github/workflows/release.yml) runs it before creating the release; tests/test_release.py
checks the newest released section with the same functions. Standard library only.
"""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"
HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?P<rest>[^\n]*)$", re.M)


def sections(changelog: str) -> dict[str, tuple[str, str]]:
    """{version: (what follows the heading's `]`, body)} for every `## [...]` section."""
    found: dict[str, tuple[str, str]] = {}
    headings = list(HEADING.finditer(changelog))
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        end = following.start() if following else len(changelog)
        found[heading["version"]] = (heading["rest"], changelog[heading.end() : end].strip())
    return found


def newest_release(changelog: str) -> str:
    """The version of the first section that is not `[Unreleased]`."""
    released = [version for version in sections(changelog) if version != "Unreleased"]
    if not released:
        raise ValueError("CHANGELOG.md has no released section (## [X.Y.Z] - YYYY-MM-DD)")
    return released[0]


def release_section(changelog: str, version: str) -> str:
    """The body of `version`'s section; ValueError saying what is missing when it is unfit."""
    found = sections(changelog).get(version)
    if found is None:
        raise ValueError(f"CHANGELOG.md has no '## [{version}] - YYYY-MM-DD' section")
    rest, body = found
    date = re.fullmatch(r" - (\d{4}-\d{2}-\d{2})", rest)
    try:
        datetime.date.fromisoformat(date[1] if date else "")
    except ValueError:
        raise ValueError(
            f"CHANGELOG.md's section [{version}] has no date: its heading must read "
            f"'## [{version}] - YYYY-MM-DD'"
        ) from None
    notes = re.search(r"^### Upgrade notes[^\n]*\n(.*?)(?=^### |\Z)", body, re.M | re.S)
    if notes is None or not notes[1].strip():
        raise ValueError(
            f"CHANGELOG.md's section [{version}] has no '### Upgrade notes' (write 'None: "
            "copier update merges this release by itself.' when there is nothing to do)"
        )
    return body


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not re.fullmatch(r"v\d+(\.\d+)*\S*", argv[0]):
        print("usage: release_notes.py vX.Y.Z (a release tag)", file=sys.stderr)
        return 2
    try:
        body = release_section(CHANGELOG.read_text(encoding="utf-8"), argv[0][1:])
    except ValueError as error:
        print(f"{error}; nothing released (docs/releasing.md)", file=sys.stderr)
        return 2
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
