"""Prompt datasets and the deterministic prompt sampler of a GRPO run.

A :class:`PromptDataset` holds the prompt texts (and, for JSONL sources, every other field of a line as
metadata). Its source is ``builtin``, a .txt (one prompt per line) or .jsonl (``{"prompt": ..., ...}`` per line)
file, or a directory in FlowGRPO's dataset layout, one file per split: ``<split>.txt`` (pickscore, drawbench) or
``<split>_metadata.jsonl`` (geneval, ocr).

A :class:`PromptSampler` decides which prompts each optimizer step trains on: ``prompts_per_step`` dataset
indices per step, each of which the layout code expands into ``grpo.group_size`` generations (the "K-repeat" of
FlowGRPO's sampler). The order depends only on ``(seed, epoch)``, never on the rank or the world size, so every
rank computes the same indices without communication; the position ``(epoch, offset)`` is the whole state, so a
resumed run continues with exactly the prompts an uninterrupted run would have used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from leangrpo_mcore.errors import UserError

BUILTIN = "builtin"
_BUILTIN_FILE = "builtin_prompts.txt"
TRAIN_SPLIT = "train"
TEST_SPLIT = "test"


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and the extra fields of its source line (empty for .txt sources)."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompt file {path}: {exc}") from None


def _parse_txt(text: str) -> list[PromptRecord]:
    return [PromptRecord(line.strip()) for line in text.splitlines() if line.strip()]


def _parse_jsonl(text: str, source: str) -> list[PromptRecord]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{source} line {number}: invalid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise UserError(f"{source} line {number}: expected a JSON object, got {type(item).__name__}")
        prompt = item.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{source} line {number}: needs a non-empty string field 'prompt'")
        records.append(PromptRecord(prompt.strip(), {k: v for k, v in item.items() if k != "prompt"}))
    return records


def split_files(split: str) -> tuple[str, str]:
    """The file names a prompt directory may hold for ``split``: ``<split>.txt`` and ``<split>_metadata.jsonl``."""
    if not split or "/" in split or "\\" in split or split.startswith("."):
        raise ValueError(f"prompt split must be a plain name such as 'train' or 'test', got {split!r}")
    return f"{split}.txt", f"{split}_metadata.jsonl"


def _split_file(directory: Path, split: str) -> Path | None:
    """The file of ``split`` in ``directory``, None when it has none; UserError when it has both kinds."""
    found = [directory / name for name in split_files(split) if (directory / name).is_file()]
    if len(found) > 1:
        raise UserError(f"prompt directory {directory} holds both {found[0].name} and {found[1].name} for the "
                        f"'{split}' split: keep one")
    return found[0] if found else None


def has_split(source: str | Path, split: str) -> bool:
    """Whether ``source`` is a directory holding a file of ``split`` (False for ``builtin`` and for files)."""
    if str(source) == BUILTIN:
        return False
    directory = Path(source)
    return directory.is_dir() and any((directory / name).is_file() for name in split_files(split))


def eval_source(data_prompts: str) -> tuple[str, str]:
    """``(source, split)`` of the evaluation prompts when only ``data.prompts`` is given.

    The test split of ``data.prompts`` where it is a directory holding one (``test.txt`` or
    ``test_metadata.jsonl``); otherwise the training prompts themselves (a file or ``builtin`` reads the same
    whatever the split, a directory without a test file gives its train split).
    """
    if has_split(data_prompts, TEST_SPLIT):
        return data_prompts, TEST_SPLIT
    return data_prompts, TRAIN_SPLIT


class PromptDataset:
    """An ordered, immutable list of prompts with per-prompt metadata."""

    def __init__(self, records: Sequence[PromptRecord | str], *, source: str = "<memory>") -> None:
        """Wrap ``records`` (PromptRecord or plain strings); UserError when there are none."""
        self.records: tuple[PromptRecord, ...] = tuple(
            r if isinstance(r, PromptRecord) else PromptRecord(str(r)) for r in records
        )
        self.source = source
        if not self.records:
            raise UserError(f"prompt source {source} has no prompts")

    @classmethod
    def from_source(cls, source: str | Path, split: str = TRAIN_SPLIT) -> PromptDataset:
        """``'builtin'`` (the demo set shipped with the package), a .txt / .jsonl file path, or a directory in
        FlowGRPO's layout, of which ``split``'s file is read (``<split>.txt`` or ``<split>_metadata.jsonl``).

        ``split`` applies to directories only: ``builtin`` and a file read the same whatever the split. A
        directory without the split's file, or with both, is a UserError.
        """
        text_name, jsonl_name = split_files(split)
        if str(source) == BUILTIN:
            text = resources.files("leangrpo_mcore.data").joinpath(_BUILTIN_FILE).read_text(encoding="utf-8")
            return cls(_parse_txt(text), source=BUILTIN)
        path = Path(source)
        if path.is_dir():
            found = _split_file(path, split)
            if found is None:
                raise UserError(f"prompt directory {path} has no '{split}' split: expected {text_name} or "
                                f"{jsonl_name} in it (FlowGRPO's dataset layout)")
            path = found
        suffix = path.suffix.lower()
        if suffix not in (".txt", ".jsonl"):
            raise UserError(f"prompt file {path} must end in .txt or .jsonl, or be a directory holding "
                            f"{text_name} or {jsonl_name} (or use data.prompts=builtin)")
        text = _read_text(path)
        records = _parse_txt(text) if suffix == ".txt" else _parse_jsonl(text, str(path))
        return cls(records, source=str(path))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> str:
        return self.records[index].prompt

    @property
    def prompts(self) -> list[str]:
        """All prompt texts, in dataset order."""
        return [r.prompt for r in self.records]

    def metadata(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The extra JSONL fields of the prompts at ``indices``, in that order (copies; empty for .txt sources)."""
        return [dict(self.records[i].metadata) for i in indices]

    def get(self, indices: Sequence[int]) -> list[str]:
        """The prompt texts at ``indices``, in that order."""
        return [self.records[i].prompt for i in indices]

    def fingerprint(self) -> str:
        """A stable hash of the records (prompt texts and metadata), to detect a changed dataset.

        A record without metadata hashes its text only, so a .txt source keeps the hash it always had.
        """
        digest = hashlib.blake2b(digest_size=16)
        for record in self.records:
            digest.update(record.prompt.encode("utf-8") + b"\0")
            if record.metadata:
                fields = json.dumps(record.metadata, sort_keys=True, ensure_ascii=False, default=str)
                digest.update(b"\1" + fields.encode("utf-8") + b"\0")
        return digest.hexdigest()


class PromptSampler:
    """Deterministic stream of prompt indices, ``prompts_per_step`` per optimizer step.

    Epoch ``e`` visits every prompt once, in the order of ``torch.randperm`` seeded with ``seed + e`` (or in
    dataset order when ``shuffle`` is False). Steps are consecutive slices of that stream: a step that crosses
    an epoch boundary takes the rest of epoch ``e`` and the start of epoch ``e + 1``, so no prompt is skipped.
    The sampler takes no rank: every rank draws the same indices and the layout assigns the generations.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, *, seed: int = 0, shuffle: bool = True) -> None:
        """Start at epoch 0, offset 0; ValueError for a non-positive size."""
        if num_prompts < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got num_prompts={num_prompts}")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the prompts."""
        if epoch != self._order_epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.num_prompts, generator=generator).tolist()
            else:
                self._order = list(range(self.num_prompts))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        """The prompt indices of the next step; advances the position."""
        indices: list[int] = []
        while len(indices) < self.prompts_per_step:
            order = self.epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(indices), self.num_prompts - self.offset)
            indices.extend(order[self.offset:self.offset + take])
            self.offset += take
            if self.offset == self.num_prompts:
                self.epoch, self.offset = self.epoch + 1, 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return self.next_indices()

    def state_dict(self) -> dict[str, Any]:
        """The position and the settings that determine the order (plain JSON-serialisable values)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": self.num_prompts,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; UserError when it belongs to another dataset or seed."""
        missing = sorted({"epoch", "offset", "seed", "shuffle", "num_prompts"} - set(state))
        if missing:
            raise UserError(f"prompt sampler state lacks {', '.join(missing)}")
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise UserError(
                    f"prompt sampler state has {key}={state[key]!r}, this run has {getattr(self, key)!r}: "
                    "resume with the same prompts and seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.num_prompts:
            raise UserError(f"prompt sampler state has an invalid position (epoch={epoch}, offset={offset})")
        self.epoch, self.offset = epoch, offset
