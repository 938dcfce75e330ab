"""wandb logging in offline mode, end to end: the run's history holds the step scalars and the sample grids, a
resumed run continues the same wandb run, and a missing wandb is one line naming the extra.

Offline runs need no network; the proxies point at a closed port so that any attempt to reach one would fail.
The history is read back from the run's ``.wandb`` file: a log of 32 KiB blocks of (crc32, length, type) framed
chunks after a 7-byte header, each record a ``wandb_internal_pb2.Record`` protobuf.
"""

import glob
import importlib.util
import json
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.output.wandb_log import RUN_ID_FILE, resolve_run_id

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_wandb = pytest.mark.skipif(not HAS_WANDB, reason="wandb (the 'wandb' extra) is not installed")

BLOCK = 32768
HEADER = 7


def _chunks(path: str):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a wandb run log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            yield pending + chunk


def _records(run_file: str) -> list:
    """The records of an offline run's .wandb file, as far as it is written."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for chunk in _chunks(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _finished(run_file: str, timeout_s: float = 300.0) -> list:
    """The records of ``run_file`` once wandb has written the run's ``exit`` record, its last: wandb's service
    process writes the file after ``finish()`` returns, later on a loaded machine. Waits for that record (not for a
    fixed time), failing after ``timeout_s``."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = _records(run_file)
        except (OSError, AssertionError, DecodeError):  # not created yet, its header or a record not written yet
            records = []
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"wandb wrote no exit record to {run_file} in {timeout_s} s"
        time.sleep(0.05)


def _history(run_file: str) -> tuple[str, list[dict]]:
    """The run id and the history rows ({key: value}) of a finished offline run's .wandb file."""
    run_id, rows = None, []
    for record in _finished(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, its files under tmp_path/wandb_files, no reachable network, one intra-op thread."""
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_files").mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path / "wandb_files"
    torch.set_num_threads(threads)


def _run_files(wandb_dir: Path, count: int, timeout_s: float = 300.0) -> list[str]:
    """The ``count`` offline run files under ``wandb_dir``, waiting for wandb's service to create them."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
        if len(files) >= count:
            return files
        assert time.monotonic() < deadline, f"wandb created {len(files)} of {count} run files in {timeout_s} s"
        time.sleep(0.05)


@needs_wandb
def test_offline_run_and_resume_continue_one_wandb_run(offline, tmp_path):
    run = tmp_path / "run"
    common = ["--config", TINY_FLUX, f"train.output_dir={run}", "logging.wandb={project: tests, mode: offline}"]
    assert train_main([*common, "train.max_steps=1"]) == 0
    run_id = (run / RUN_ID_FILE).read_text().strip()
    assert train_main([*common, "train.max_steps=2", "checkpoint.resume=auto"]) == 0
    assert (run / RUN_ID_FILE).read_text().strip() == run_id  # the resume kept the id

    files = _run_files(offline, 2)
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {}
    for path in files:
        file_id, rows = _history(path)
        assert file_id == run_id
        steps.update({row["_step"]: row for row in rows})
    assert sorted(steps) == [1, 2]
    for row in metrics:  # the same scalars as metrics.jsonl / TensorBoard, at the same steps
        logged = steps[row["step"]]
        for key in ("reward_mean", "reward_std", "loss", "grad_norm", "lr", "time_step_s"):
            assert logged[key] == pytest.approx(row[key], rel=1e-12), key
    # The last step of each launch writes a sample grid: logged as an image with the grid's size.
    assert steps[2]["samples/_type"] == "image-file" and steps[2]["samples/width"] > 0


@needs_wandb
def test_only_finite_numbers_are_logged(offline):
    import wandb

    from leangrpo_mcore.engine.output.wandb_log import WandbRun

    logger = WandbRun(wandb, wandb.init(mode="offline", id="finite01", dir=str(offline),
                                        settings=wandb.Settings(console="off")))
    logger.log(3, {"step": 3, "a": float("nan"), "b": 1.5, "c.d": 2, "e": float("inf"), "f": True, "g": "x"})
    logger.close()
    # the run directory and its file are named at init; the file is complete once its exit record is in it
    (path,) = _run_files(offline, 1)
    _, rows = _history(path)
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows] == [{"b": 1.5, "c/d": 2}]
    assert rows[0]["_step"] == 3


def test_run_id_is_kept_for_a_resume_and_new_for_a_fresh_run(tmp_path):
    first = resolve_run_id(str(tmp_path), resumed=False)
    assert len(first) == 8 and (tmp_path / RUN_ID_FILE).read_text() == first + "\n"
    assert resolve_run_id(str(tmp_path), resumed=True) == first
    second = resolve_run_id(str(tmp_path), resumed=False)
    assert second != first and resolve_run_id(str(tmp_path), resumed=True) == second
    os.remove(tmp_path / RUN_ID_FILE)
    assert resolve_run_id(str(tmp_path), resumed=True) not in (first, second)


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    code = train_main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", "logging.wandb.mode=offline"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: logging.wandb needs the 'wandb' extra: pip install 'leangrpo_mcore[wandb]'"]
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")
    # mode: disabled is the same as no section: wandb is neither needed nor started.
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'off'}", "train.max_steps=1",
                       "logging.wandb.mode=disabled", "logging.tensorboard=false"]) == 0
    assert not (tmp_path / "off" / RUN_ID_FILE).exists() and not (tmp_path / "off" / "wandb").exists()
