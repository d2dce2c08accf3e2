"""The loader lm-eval calls for the YAML tasks here (`custom_dataset: !function local_jsonl.load`).

It reads a task JSONL that sits beside this file, so the tasks run offline and from any
working directory; lm-eval passes the YAML's dataset_kwargs (and its metadata) as keywords.
"""
import json
from pathlib import Path

import datasets


def load(file, **_):
    path = Path(__file__).resolve().parent / file
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
