"""Tasks: where prompts (and what their rewards need) come from, one file each, registered by name (`task=`).

    file            registered names
    arithmetic.py   task arithmetic (the embedded default) and its verifier, reward arithmetic
    files.py        task files: prompts from jsonl / json / parquet / a datasets folder
    add4.py         task add4: the ladder's rung 1, 4-digit addition (verifier: reward arithmetic)
    mul2.py         task mul2: rung 2, 2-digit by 2-digit multiplication (verifier: reward arithmetic)
    sum3.py         task sum3: the top rung, three 3-digit operands (no warm start yet; reward arithmetic)
    shapes.py       task shapes: pictures drawn with PIL, count or compare shapes (reward vision; docs/vision.md)
"""
from tasks import add4, arithmetic, files, mul2, shapes, sum3  # noqa: F401  (each file registers itself)
