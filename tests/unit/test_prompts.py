import json

import pytest
import torch

from leangrpo_mcore.data.prompts import PromptDataset, PromptSampler, eval_source, has_split
from leangrpo_mcore.errors import UserError


def test_builtin_set_is_varied_and_unique():
    ds = PromptDataset.from_source("builtin")
    assert 24 <= len(ds) <= 48
    assert len(set(ds.prompts)) == len(ds)
    assert all(p == p.strip() and p for p in ds.prompts)
    assert ds.metadata([0]) == [{}]


def test_txt_skips_blank_lines_and_strips(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("  a cat \n\n   \nthe sea\r\n\na dog\n", encoding="utf-8")
    ds = PromptDataset.from_source(path)
    assert ds.prompts == ["a cat", "the sea", "a dog"]
    assert ds.get([2, 0]) == ["a dog", "a cat"]
    assert ds[1] == "the sea"
    same = PromptDataset(["a cat", "the sea", "a dog"])
    assert same.fingerprint() == ds.fingerprint() != PromptDataset(["a cat", "the sea"]).fingerprint()


def test_jsonl_keeps_metadata(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a sign that says \"hi\"", "tag": "ocr", "id": 7}, {"prompt": "a fox"}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:1]) + "\n\n" + json.dumps(lines[1]) + "\n")
    ds = PromptDataset.from_source(path)
    assert ds.prompts == ['a sign that says "hi"', "a fox"]
    assert ds.metadata([1, 0]) == [{}, {"tag": "ocr", "id": 7}]
    ds.metadata([0])[0]["tag"] = "changed"  # a copy: the dataset keeps its record
    assert ds.metadata([0]) == [{"tag": "ocr", "id": 7}]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "ok"}\n{"prompt": oops}\n', "line 2: invalid JSON"),
        ('{"prompt": "ok"}\n\n[1, 2]\n', "line 3: expected a JSON object"),
        ('{"text": "no prompt key"}\n', "line 1: needs a non-empty string field 'prompt'"),
    ],
)
def test_bad_jsonl_line_names_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as info:
        PromptDataset.from_source(path)
    assert "\n" not in str(info.value)


def test_missing_empty_and_unknown_sources(tmp_path):
    with pytest.raises(UserError, match="prompt file not found"):
        PromptDataset.from_source(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(UserError, match="has no prompts"):
        PromptDataset.from_source(tmp_path / "empty.txt")
    with pytest.raises(UserError, match=r"\.txt or \.jsonl"):
        PromptDataset.from_source(tmp_path / "prompts.csv")


def _geneval_line(prompt: str, tag: str, include: list) -> str:
    return json.dumps({"tag": tag, "include": include, "prompt": prompt})


def test_flowgrpo_txt_directory_reads_the_split(tmp_path):
    """pickscore / drawbench: train.txt and test.txt."""
    (tmp_path / "train.txt").write_text("a cat\na dog\n\n")
    (tmp_path / "test.txt").write_text("a fox\n")
    train, test = PromptDataset.from_source(tmp_path), PromptDataset.from_source(tmp_path, split="test")
    assert train.prompts == ["a cat", "a dog"] and test.prompts == ["a fox"]
    assert train.source == str(tmp_path / "train.txt") and train.metadata([0, 1]) == [{}, {}]
    # The same records hash the same whatever holds them, and the splits differ.
    assert train.fingerprint() == PromptDataset(["a cat", "a dog"]).fingerprint() != test.fingerprint()
    # A file reads the same whatever the split.
    assert PromptDataset.from_source(tmp_path / "test.txt", split="train").prompts == ["a fox"]
    assert has_split(tmp_path, "train") and has_split(tmp_path, "test") and not has_split(tmp_path, "val")
    assert not has_split(tmp_path / "train.txt", "train") and not has_split("builtin", "test")
    assert eval_source(str(tmp_path)) == (str(tmp_path), "test")
    assert eval_source(str(tmp_path / "train.txt")) == (str(tmp_path / "train.txt"), "train")
    assert eval_source("builtin") == ("builtin", "train")


def test_flowgrpo_metadata_directory_keeps_each_lines_fields(tmp_path):
    """geneval / ocr: train_metadata.jsonl and test_metadata.jsonl, every field but the prompt kept."""
    lines = [_geneval_line("a photo of a bench", "single_object", [{"class": "bench", "count": 1}]),
             _geneval_line("a photo of two cats", "counting", [{"class": "cat", "count": 2}])]
    (tmp_path / "train_metadata.jsonl").write_text("\n".join(lines) + "\n")
    ds = PromptDataset.from_source(str(tmp_path), split="train")
    assert ds.prompts == ["a photo of a bench", "a photo of two cats"]
    assert ds.metadata([1]) == [{"tag": "counting", "include": [{"class": "cat", "count": 2}]}]
    # The fingerprint covers the metadata: the same prompts with another count are another dataset.
    other = tmp_path / "other"
    other.mkdir()
    (other / "train_metadata.jsonl").write_text(
        lines[0] + "\n" + _geneval_line("a photo of two cats", "counting", [{"class": "cat", "count": 3}]) + "\n")
    assert PromptDataset.from_source(other).prompts == ds.prompts
    assert PromptDataset.from_source(other).fingerprint() != ds.fingerprint()
    # No test split here: evaluation falls back to the training prompts.
    assert not has_split(tmp_path, "test") and eval_source(str(tmp_path)) == (str(tmp_path), "train")


def test_flowgrpo_directory_errors_are_one_line(tmp_path):
    (tmp_path / "train.txt").write_text("a cat\n")
    (tmp_path / "train_metadata.jsonl").write_text(_geneval_line("a cat", "x", []) + "\n")
    with pytest.raises(UserError, match="holds both train.txt and train_metadata.jsonl for the 'train' split") as info:
        PromptDataset.from_source(tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError) as info:
        PromptDataset.from_source(tmp_path, split="test")
    assert str(info.value) == (f"prompt directory {tmp_path} has no 'test' split: expected test.txt or "
                               f"test_metadata.jsonl in it (FlowGRPO's dataset layout)")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.txt").write_text("\n")
    with pytest.raises(UserError, match="has no prompts"):
        PromptDataset.from_source(empty)


def test_sampler_epochs_are_seeded_permutations():
    sampler = PromptSampler(10, 4, seed=3)
    steps = [sampler.next_indices() for _ in range(5)]  # 20 indices = exactly two epochs
    assert all(len(s) == 4 for s in steps)
    flat = [i for s in steps for i in s]
    epoch0 = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    epoch1 = torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert flat == epoch0 + epoch1
    assert epoch0 != epoch1
    # The step crossing the epoch boundary takes the tail of epoch 0 and the head of epoch 1.
    assert steps[2] == epoch0[8:] + epoch1[:2]
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["offset"] == 0


def test_sampler_is_identical_across_instances_and_unshuffled_mode():
    a, b = PromptSampler(7, 3, seed=11), PromptSampler(7, 3, seed=11)
    assert [next(a) for _ in range(6)] == [next(b) for _ in range(6)]
    plain = PromptSampler(5, 2, shuffle=False)
    assert [plain.next_indices() for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]
    big = PromptSampler(3, 5, seed=0)  # more prompts per step than prompts: spans two epochs
    first = big.next_indices()
    assert sorted(first[:3]) == [0, 1, 2] and len(first) == 5


def test_sampler_resume_continues_exactly():
    reference = PromptSampler(9, 4, seed=5)
    expected = [reference.next_indices() for _ in range(8)]
    first = PromptSampler(9, 4, seed=5)
    head = [first.next_indices() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(9, 4, seed=5)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices() for _ in range(5)] == expected


def test_sampler_state_mismatch_and_bad_args():
    state = PromptSampler(9, 4, seed=5).state_dict()
    with pytest.raises(UserError, match="num_prompts=9"):
        PromptSampler(10, 4, seed=5).load_state_dict(state)
    with pytest.raises(UserError, match="seed=5"):
        PromptSampler(9, 4, seed=6).load_state_dict(state)
    with pytest.raises(UserError, match="lacks offset"):
        PromptSampler(9, 4, seed=5).load_state_dict({k: v for k, v in state.items() if k != "offset"})
    with pytest.raises(UserError, match="invalid position"):
        PromptSampler(9, 4, seed=5).load_state_dict({**state, "offset": 9})
    with pytest.raises(ValueError, match="prompts_per_step"):
        PromptSampler(9, 0)
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler(0, 1)
