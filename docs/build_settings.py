"""Writes the table of docs/settings.md from statefulset/settings.py (tests/test_layout.py checks it is current)."""

from __future__ import annotations

from pathlib import Path

from statefulset import settings

PAGE = Path(__file__).resolve().parent / "settings.md"
INTRO = """# Settings: environment variables

Every environment variable statefulset reads, generated from `statefulset/settings.py`
(`python docs/build_settings.py`). A variable is read where it is used, so a launcher may set it
any time before; a blank value counts as unset; a value that does not parse stops with a
`StatefulsetError` naming the variable, the value and what it must be.

"""
OUTRO = """
The storage libraries' own variables (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_S3`, `AWS_PROFILE`,
credentials) work as those libraries document them. In its worker processes `statefulset
preprocess` sets `TOKENIZERS_PARALLELISM=false` (one core per worker).
"""


def main() -> None:
    PAGE.write_text(INTRO + settings.table() + OUTRO, encoding="utf-8")


if __name__ == "__main__":
    main()
