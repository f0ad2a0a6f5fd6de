"""Writes the table of docs/settings.md from statefulset/settings.py (tests/test_layout.py checks it is current)."""

from __future__ import annotations

from pathlib import Path

from statefulset import settings

CACHES = [  # docs/settings.md: what the user cache folder holds, and what moves each part
    (
        "`indices/`",
        (
            "megatron-packing indices (`document_index`, `sample_index`, `shuffle_index`, blend "
            "indices) and the facts folder of a spec with `path_to_cache: null`"
        ),
        (
            "`path_to_cache: /shared/cache` in the spec (relative paths resolve against the YAML file):"
            " one folder every node mounts, so indices are built once ([scale.md](scale.md))"
        ),
    ),
    (
        "`memo/`",
        ("facts about file versions (an `.idx` passed every check, a content digest) when no `path_to_cache` is given"),
        "a spec's `path_to_cache` (they go to its `facts/`)",
    ),
    (
        "`remote-idx/`",
        "this node's local copies of remote `.idx` files (`s3://...`), named by URL and version",
        "`STATEFULSET_REMOTE_CACHE=/local/ssd/idx`",
    ),
    (
        "`kernels/`",
        (
            "only when the installed compiled kernels are missing or stale: a private build, owned by "
            "you and writable by nobody else"
        ),
        "`STATEFULSET_KERNEL_DIR=/private/dir`",
    ),
    (
        "`demo-corpus/`",
        "the shards `statefulset.tools.demo.demo_spec()` writes for examples",
        "`demo_spec(folder=...)`",
    ),
]

PAGE = Path(__file__).resolve().parent / "settings.md"
INTRO = """# Settings: environment variables

Every environment variable statefulset reads, generated from `statefulset/settings.py`
(`python docs/build_settings.py`). A variable is read where it is used, so a launcher may set it
any time before; a blank value counts as unset; a value that does not parse stops with a
`StatefulsetError` naming the variable, the value and what it must be.

"""
OUTRO = (
    """
The storage libraries' own variables (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_S3`, `AWS_PROFILE`,
credentials) work as those libraries document them. In its worker processes `statefulset
preprocess` sets `TOKENIZERS_PARALLELISM=false` (one core per worker).

## Where files go by default, and how to move them

statefulset writes nothing next to your shards unless a spec asks it to. What it keeps goes in
this user's cache folder, `$XDG_CACHE_HOME/statefulset`, which is `~/.cache/statefulset` when
`XDG_CACHE_HOME` is unset:

```python
from statefulset import settings

print(settings.user_cache_dir())   # .../statefulset
```

"""
    + "\n".join(
        ["| under the user cache folder | what it holds | to put it elsewhere |", "|---|---|---|"]
        + [f"| {a} | {b} | {c} |" for a, b, c in CACHES]
    )
    + """

To move all of it at once, set `XDG_CACHE_HOME` (for example to a local SSD on a cluster whose
home directories are on a slow or small network file system) in the training job's environment:

<!-- illustration: shows a job's environment; the folder is yours -->
```bash
export XDG_CACHE_HOME=/local/ssd/$USER/cache    # statefulset then uses /local/ssd/$USER/cache/statefulset
```

Every entry is derived and may be deleted at any time when no job runs: indices are rebuilt (the
same bytes), copies downloaded again, facts checked again. A folder that is missing is created
(with your umask). `statefulset preprocess` keeps its staging files for outputs on object storage
under the system's temporary folder (`TMPDIR`), and its Ray parts next to the output
(`<output-prefix>.parts/`, removed after the merge).
"""
)


def main() -> None:
    PAGE.write_text(INTRO + settings.table() + OUTRO, encoding="utf-8")


if __name__ == "__main__":
    main()
