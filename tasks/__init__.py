"""Tasks: where prompts (and what their rewards need) come from, one file each, registered by name (`task=`).

    file            registered names
    arithmetic.py   task arithmetic (the embedded default) and its verifier, reward arithmetic
    files.py        task files: prompts from jsonl / json / parquet / a datasets folder
"""
from tasks import arithmetic, files  # noqa: F401  (each file registers itself)
