"""Every shell command that ``README.md`` and ``docs/*.md`` show runs as written on a CPU, or is listed below with
the reason it cannot run here.

The commands are read from the pages' fenced ``bash`` / ``sh`` / ``shell`` / ``console`` blocks
(``tests/doc_commands.py``: continuations joined, comments dropped, ``&&`` chains cut into steps). Each page runs
in a sandbox of its own, a fresh directory laid out as a checkout, and a command runs after the earlier commands
of its block, so that it sees what they wrote, as a reader's shell would. A command missing from ``NOT_RUN`` is
run; a new command that cannot run fails until it is listed here with its reason. Every command also has its
flags and config keys checked against the tools' own parsers and the config schema, in the quick tier.

A block whose first line is a comment naming a file (``# my_rewards.py``) is saved under that name in its page's
sandbox first. Placeholders are filled in one way, ``placeholders()``: ``RUN`` is the run directory that the
README's training command (``DEMO_TRAIN``) writes in the README's sandbox, ``<N>`` its last step, and the example
reward server's port ``8765`` a free port.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.doc_commands import (Command, Sandbox, commands_of, config_word, fenced_blocks, file_blocks, free_port,
                                override_words, produced_paths, program_words)
from tests.kontext_checks import check_edit_run

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))

GPU = "needs a GPU"
WEIGHTS = "needs downloaded weights or data"
CLUSTER = "needs a cluster (several machines or a batch scheduler)"
TOO_LONG = "runs on a CPU, but for longer than the test suite may take"
SETUP = "sets up the environment the tests run in, or runs the test suite itself"

_FLUX_DEV_8 = "leangrpo-plan --model flux-dev --nodes 1 --gpus-per-node 8"
NOT_RUN = {
    # the Quickstart's and the walkthrough's installation (the tests run in the installed environment)
    "python3 -m venv .venv": (SETUP, "creates the environment the tests already run in"),
    ". .venv/bin/activate": (SETUP, "activates that environment"),
    "pip install -q torch==2.13.0": (SETUP, "installs the pinned CPU torch"),
    "pip install -q -e .": (SETUP, "installs the package"),
    'pip install -q -e ".[test,ocr,wandb]"': (SETUP, "installs the package with the test extras"),
    "python -m pytest -q -n 2 --dist loadgroup": (SETUP, "the whole suite, of which this test is part (.ci/run)"),
    'python -m pytest -q -m "not slow" -n 2': (SETUP, "the quick tier, of which this test is part"),
    # the current stack's environment (docs/testing.md), which .ci/run makes and tests
    "python3.12 -m venv .venv-current": (SETUP, "creates the current stack's environment (.ci/run)"),
    ". .venv-current/bin/activate": (SETUP, "activates that environment"),
    "pip install -q -r .ci/current-stack.txt": (SETUP, "installs torch's CUDA build and megatron-core 0.19.2"),
    'pip install -q -c .ci/current-stack.txt -e ".[test,ocr,wandb]"': (SETUP, "installs the package there"),
    "python -m pytest -q -m stack -n 2 --dist loadgroup": (SETUP, "the current stack's tests (.ci/run)"),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128": (
        GPU, "the CUDA build of torch, for a GPU machine"),
    'pip install -e ".[te,rewards,video,wandb]"': (GPU, "Transformer Engine builds only against CUDA"),
    # downloads and the runs made from them
    "huggingface-cli login": (WEIGHTS, "a Hugging Face account and the network"),
    'huggingface-cli download black-forest-labs/FLUX.1-dev --local-dir models/FLUX.1-dev --exclude '
    '"flux1-dev.safetensors" "ae.safetensors"': (WEIGHTS, "downloads FLUX.1-dev (about 34 GB)"),
    "huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir models/PickScore_v1": (
        WEIGHTS, "downloads PickScore"),
    'huggingface-cli download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --local-dir models/CLIP-ViT-H-14-laion2B-s32B-b79K '
    '--include "*.json" "*.txt"': (WEIGHTS, "downloads CLIP's processor files"),
    "git clone --depth 1 https://github.com/yifan123/flow_grpo /tmp/flow_grpo": (
        WEIGHTS, "downloads FlowGRPO's prompt sets"),
    "mkdir -p datasets": (WEIGHTS, "part of copying the cloned prompt set"),
    "cp -r /tmp/flow_grpo/dataset/pickscore datasets/pickscore": (WEIGHTS, "copies the cloned prompt set"),
    "wc -l datasets/pickscore/train.txt datasets/pickscore/test.txt": (WEIGHTS, "counts the cloned prompts"),
    "cat datasets/pickscore/train.txt datasets/pickscore/test.txt > /tmp/pickscore_all.txt": (
        WEIGHTS, "reads the cloned prompts"),
    "python tools/precompute_embeddings.py --family flux --text-encoder-path models/FLUX.1-dev --prompts "
    "/tmp/pickscore_all.txt --out datasets/pickscore_flux_t5 --dtype bfloat16 --device cuda": (
        GPU, "T5-XXL over the prompt set on a GPU, from the downloaded FLUX.1-dev"),
    "torchrun --standalone --nproc-per-node 8 -m leangrpo_mcore.train "
    "--config yaml_configs/flux_dev/flowgrpo_lora.yaml model.path=models/FLUX.1-dev/transformer "
    "model.text_encoder_path=models/FLUX.1-dev model.vae_path=models/FLUX.1-dev/vae "
    "reward.options.path=models/PickScore_v1 "
    "reward.options.processor_path=models/CLIP-ViT-H-14-laion2B-s32B-b79K data.prompts=datasets/pickscore": (
        GPU, "FLUX.1-dev on 8 GPUs from the downloads"),
    "torchrun --nproc-per-node 8 -m leangrpo_mcore.train --config yaml_configs/flux_dev/flowgrpo_lora.yaml "
    "model.path=/models/FLUX.1-dev/transformer model.text_encoder_path=/models/FLUX.1-dev "
    "model.vae_path=/models/FLUX.1-dev/vae reward.options.path=/models/PickScore_v1 "
    "reward.options.processor_path=/models/CLIP-ViT-H-14-laion2B-s32B-b79K data.prompts=/datasets/pickscore": (
        GPU, "FLUX.1-dev on 8 GPUs from the downloads"),
    "tensorboard --logdir runs/flux_dev_flowgrpo_lora/tensorboard --port 6006": (
        WEIGHTS, "serves the walkthrough's FLUX.1-dev run until stopped"),
    "leangrpo-eval --config runs/flux_dev_flowgrpo_lora/config.yaml --checkpoint "
    "runs/flux_dev_flowgrpo_lora/checkpoints/step_<N> --out eval.json": (WEIGHTS, "the walkthrough's FLUX.1-dev run"),
    "leangrpo-convert mcore-to-diffusers --src runs/flux_dev_flowgrpo_lora/checkpoints/step_<N> "
    "--dst exports/flux_dev_pickscore --dtype bfloat16": (WEIGHTS, "the walkthrough's FLUX.1-dev run"),
    "leangrpo-eval --config yaml_configs/flux_dev/flowgrpo_lora.yaml model.path=/models/FLUX.1-dev/transformer "
    "eval.num_prompts=null": (WEIGHTS, "FLUX.1-dev, PickScore and the prompt set"),
    "leangrpo-convert diffusers-to-mcore --model flux --src /models/FLUX.1-dev/transformer --dst ckpt/flux-dev-mcore": (
        WEIGHTS, "FLUX.1-dev's transformer"),
    "leangrpo-convert diffusers-to-mcore --model wan --src /models/Wan2.1-T2V-14B-Diffusers/transformer "
    "--dst ckpt/wan-14b-mcore": (WEIGHTS, "Wan2.1-T2V-14B's transformer"),
    "leangrpo-convert diffusers-to-mcore --model sd3 --src /models/stable-diffusion-3.5-medium/transformer "
    "--dst ckpt/sd35m-mcore": (WEIGHTS, "SD3.5 Medium's transformer"),
    "leangrpo-convert diffusers-to-mcore --model wan --src /models/Wan2.2-T2V-A14B-Diffusers "
    "--dst ckpt/wan22-a14b-mcore": (WEIGHTS, "Wan2.2-T2V-A14B's pipeline (both experts)"),
    "leangrpo-convert diffusers-to-mcore --model qwen_image --src /models/Qwen-Image/transformer "
    "--dst ckpt/qwen-image-mcore": (WEIGHTS, "Qwen-Image's transformer"),
    'huggingface-cli download black-forest-labs/FLUX.1-Kontext-dev --local-dir models/FLUX.1-Kontext-dev --exclude '
    '"flux1-kontext-dev.safetensors" "ae.safetensors"': (WEIGHTS, "downloads FLUX.1-Kontext-dev (about 34 GB)"),
    "huggingface-cli download openai/clip-vit-large-patch14 --local-dir models/clip-vit-large-patch14": (
        WEIGHTS, "downloads CLIP ViT-L/14"),
    "torchrun --standalone --nproc-per-node 8 -m leangrpo_mcore.train "
    "--config yaml_configs/flux_kontext/flowgrpo_edit.yaml model.path=models/FLUX.1-Kontext-dev/transformer "
    "model.text_encoder_path=models/FLUX.1-Kontext-dev model.vae_path=models/FLUX.1-Kontext-dev/vae "
    "reward.options.reward_options.clip_consistency.path=models/clip-vit-large-patch14 "
    "reward.options.reward_options.clip_score.path=models/clip-vit-large-patch14 data.prompts=datasets/kontext_edit": (
        GPU, "FLUX.1-Kontext-dev on 8 GPUs from the downloads"),
    # several machines
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/train_multi_node.sh yaml_configs/wan/dancegrpo_wan21_1.3b.yaml": (
        CLUSTER, "waits for the other node at MASTER_ADDR"),
    "sbatch --nodes=4 examples/train_slurm.sbatch yaml_configs/flux_dev/flowgrpo_lora.yaml train.max_steps=1000": (
        CLUSTER, "SLURM"),
    "tools/gpu_check.sh --out runs/gpu_check": (GPU, "measures the GPU-only claims; its --cpu dry run is "
                                                     "tests/unit/test_gpu_check.py"),
    # long on a CPU
    "python tools/calibrate_activations.py --write": (TOO_LONG, "about 10 minutes of measured forwards"),
    f"{_FLUX_DEV_8} --gpu-mem-gb 80 --num-steps 16 --selected-steps 16 --group-size 8 --simulate all --json": (
        TOO_LONG, "three full-scale simulations, 2 to 8 minutes each (docs/planning.md's table)"),
    f"{_FLUX_DEV_8} --gpu-mem-gb 48 --num-steps 16 --selected-steps 16 --group-size 8 --lora-rank 64 --simulate all "
    "--json": (TOO_LONG, "three full-scale simulations, 1 to 2 minutes each"),
    "leangrpo-plan --model wan2.1-14b --nodes 4 --gpus-per-node 8 --gpu-mem-gb 80 --resolution 480x832 --frames 33 "
    "--num-steps 16 --selected-steps 16 --group-size 8 --simulate all --json": (
        TOO_LONG, "three full-scale simulations"),
    "leangrpo-plan --model wan2.2-ti2v-5b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 48 --resolution 704x1280 "
    "--frames 49 --num-steps 16 --selected-steps 16 --group-size 8 --simulate all --json": (
        TOO_LONG, "three full-scale simulations, up to 4 minutes each"),
    "leangrpo-plan --model qwen-image --gpus-per-node 8 --gpu-mem-gb 80 --simulate --json": (
        TOO_LONG, "a full-scale simulation of Qwen-Image, about 70 s; every preset simulates without weights at tiny "
                  "sizes in tests/unit/test_plan_without_weights.py"),
    "leangrpo-plan --config yaml_configs/flux_dev/flowgrpo_lora.yaml --gpus-per-node 8 --gpu-mem-gb 48 --simulate": (
        TOO_LONG, "a full-scale simulation of about 2 minutes; every preset simulates without weights at tiny sizes "
                  "in tests/unit/test_plan_without_weights.py"),
    "leangrpo-plan --model wan2.2-t2v-a14b --gpus-per-node 8 --gpu-mem-gb 80 --resolution 480x832 --frames 33 "
    "--num-steps 16 --selected-steps 16 --group-size 8 --simulate all --json": (
        TOO_LONG, "three full-scale simulations of two experts, 2 to 3 minutes each"),
    "leangrpo-plan --model wan2.2-t2v-a14b --gpus-per-node 8 --gpu-mem-gb 80 --resolution 480x832 --frames 33 "
    "--num-steps 16 --selected-steps 8 --group-size 8 --lora-rank 32 --experts-train high --simulate all --json": (
        TOO_LONG, "three full-scale simulations of two experts, 4 to 14 minutes each on a loaded CPU"),
}
CATEGORIES = (GPU, WEIGHTS, CLUSTER, TOO_LONG, SETUP)

KNOWN_FAILING: dict[str, str] = {}
"""Commands that run here but fail today, each with the behaviour that fails; strict, so a fix shows."""
EXPECTED_EXIT = {
    "leangrpo-torchrun --standalone --nproc-per-node 2 -m leangrpo_mcore.train --config "
    "yaml_configs/demo/tiny_flux_cpu.yaml grpo.group_size=3 train.output_dir=runs/bad_input": 2,
}
"""Commands the docs show failing on purpose, with their exit code (and exactly one ``error:`` line)."""

DEMO_TRAIN = "leangrpo-train --config yaml_configs/demo/tiny_flux_cpu.yaml train.max_steps=2 train.output_dir=runs/demo"
"""The README's training command: ``RUN`` and ``<N>`` stand for its run directory and last step."""
SERVER_PORT = free_port()


def placeholders(readme_sandbox: Path) -> dict[str, str]:
    """What each placeholder of the docs stands for."""
    return {"RUN": str(readme_sandbox / "runs" / "demo"), "<N>": "2", "8765": str(SERVER_PORT)}


def fill(text: str, values: dict[str, str]) -> str:
    text = re.sub(r"\bRUN\b", values["RUN"], text)
    return re.sub(r"\b8765\b", values["8765"], text.replace("<N>", values["<N>"]))


def documented() -> list[Command]:
    return [c for page in PAGES for c in commands_of((ROOT / page).read_text(encoding="utf-8"), page)]


def runnable(commands: list[Command]) -> list[Command]:
    """Each command that runs here, once, in page order (a command shown on two pages is tested on the first; the
    second page's sandbox runs it too where a later command of its block needs it)."""
    seen, out = set(), []
    for command in commands:
        if command.text not in NOT_RUN and command.text not in seen:
            seen.add(command.text)
            out.append(command)
    return out


COMMANDS = documented()
RUNNABLE = runnable(COMMANDS)


def _demo_rewards_rise(output: str, sandbox: Path) -> None:
    first, last = map(float, re.search(r"reward: first (\S+) -> last (\S+)", output).groups())
    assert last > first, f"the demo's reward did not rise: {first} -> {last}"


CHECKS = {
    "torchrun --standalone --nproc-per-node 2 -m leangrpo_mcore.train "
    "--config yaml_configs/demo/tiny_flux_cpu.yaml": _demo_rewards_rise,
    # docs/walkthrough.md, "Editing with Kontext": the tiny edit run's [source | result] grids and evaluation
    "torchrun --standalone --nproc-per-node 2 -m leangrpo_mcore.train "
    "--config yaml_configs/flux_kontext/tiny_edit.yaml": check_edit_run,
}
"""What a command's page says it does, beyond its exit code and the files it names."""


# --- every command is run or listed, and a listed one still parses ------------------------------------------------

CLI_MODULES = {"train": "train", "eval": "eval", "plan": "plan", "bench": "bench", "convert": "convert",
               "plan_layout": "plan", "convert_checkpoint": "convert"}


def _cli_and_args(argv: list[str]):
    """(the project CLI a command runs, its arguments), or None for another program."""
    name, rest = argv[0], argv[1:]
    if name.startswith("leangrpo-") and name != "leangrpo-torchrun":
        return name[len("leangrpo-"):], rest
    if name in ("torchrun", "leangrpo-torchrun") or rest[:2] == ["-m", "leangrpo_mcore.launch"]:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(rest[2:] if name.startswith("python") else rest)
        module = args.training_script.rsplit(".", 1)[-1] if args.module else Path(args.training_script).stem
        return CLI_MODULES.get(module), args.training_script_args
    if name in ("python", "python3") and rest[:1] == ["-m"]:
        return CLI_MODULES.get(rest[1].rsplit(".", 1)[-1]), rest[2:]
    if name in ("python", "python3") and rest[:1] and rest[0].startswith("tools/"):
        return CLI_MODULES.get(Path(rest[0]).stem), rest[1:]
    return None


def check_arguments(command: str) -> None:
    """The flags of a project CLI through its own parser, and the config keys through the schema."""
    import importlib

    from leangrpo_mcore.config import load_config

    found = _cli_and_args(program_words(command))
    if found is not None and found[0] is not None:
        parser = importlib.import_module(f"leangrpo_mcore.cli.{found[0]}").build_parser()
        try:
            parser.parse_args(found[1])
        except SystemExit as exit_:  # --version and --help exit 0
            if exit_.code in (0, None):
                return
            raise AssertionError(f"{command}: {found[0]} refuses its arguments (exit {exit_.code})") from None
    config = config_word(command)
    if config is not None:
        load_config(str(ROOT / config), override_words(command))


def test_every_block_names_its_language():
    """An unmarked block would hide its commands from this test: output and diagrams say ``text``."""
    unmarked = [f"{b.doc}:{b.line}" for page in PAGES
                for b in fenced_blocks((ROOT / page).read_text(encoding="utf-8"), page) if not b.language]
    assert not unmarked, f"fenced blocks without a language: {unmarked}"


def test_the_reader_takes_commands_as_a_shell_does():
    text = ("```bash\n# a comment\nA=1 tool --x 1 \\\n    --y '#2' # note\nstep1 && step2 \"a && b\" &&\\\n"
            "  step3\nserver --port 1 &\n```\n```text\nnot a command\n```\n"
            "```console\n$ one \\\n  two\noutput line\n$ three\n```\n")
    got = [(c.line, c.text, c.background) for c in commands_of(text, "page.md")]
    assert got == [(3, "A=1 tool --x 1 --y '#2'", False), (5, "step1", False), (5, 'step2 "a && b"', False),
                   (5, "step3", False), (7, "server --port 1", True), (13, "one two", False),
                   (16, "three", False)], got
    assert program_words("A=1 B=2 tool --x") == ["tool", "--x"]
    assert file_blocks("```python\n# my_file.py\nx = 1\n```\n```python\nnot saved\n```\n", "page.md") == {
        "my_file.py": "# my_file.py\nx = 1\n"}
    assert fill("--src RUN/checkpoints/step_<N> --port 8765 RUNS", {"RUN": "/r", "<N>": "4", "8765": "9"}) == \
        "--src /r/checkpoints/step_4 --port 9 RUNS"


def test_every_command_runs_or_is_listed_with_a_reason():
    texts = {c.text for c in COMMANDS}
    assert not set(NOT_RUN) - texts, f"listed but no longer documented: {sorted(set(NOT_RUN) - texts)}"
    assert not set(KNOWN_FAILING) - texts and not set(EXPECTED_EXIT) - texts and not set(CHECKS) - texts
    assert all(category in CATEGORIES and reason for category, reason in NOT_RUN.values())
    assert DEMO_TRAIN in {c.text for c in COMMANDS if c.doc == "README.md"}
    assert {c.doc for c in RUNNABLE} >= {"README.md", "docs/training.md", "docs/evaluation.md"}
    odd = [c.where for c in RUNNABLE if re.search(r"<(?!N>)[A-Za-z_]+>|\.\.\.", c.text)]
    assert not odd, f"runnable commands with a placeholder PLACEHOLDERS does not fill: {odd}"


@pytest.mark.parametrize("command", list({c.text: c for c in COMMANDS}.values()), ids=lambda c: c.where)
def test_a_command_parses(command):
    """Cheap before the run (and the only check of a listed command): flags, config file and keys."""
    check_arguments(command.text)


# --- the runnable commands, run --------------------------------------------------------------------------------


class Pages:
    """One sandbox per page; a command runs after the earlier commands of its block, and after ``DEMO_TRAIN`` when
    it names a placeholder of that run."""

    def __init__(self, base: Path) -> None:
        self.base, self.sandboxes, self.results = base, {}, {}

    def sandbox(self, page: str) -> Sandbox:
        """The page's sandbox, holding the files the page asks the reader to save (``file_blocks``)."""
        if page not in self.sandboxes:
            box = self.sandboxes[page] = Sandbox(self.base / page.replace("/", "_"), ROOT)
            for name, text in file_blocks((ROOT / page).read_text(encoding="utf-8"), page).items():
                (box.path / name).write_text(text)
        return self.sandboxes[page]

    def run(self, command: Command):
        key = (command.doc, command.text)  # the same command on two pages runs in each page's sandbox
        if key in self.results:
            return self.results[key]
        for earlier in COMMANDS[:COMMANDS.index(command)]:  # a block's earlier commands run in its own sandbox,
            # also one shown on an earlier page too (where its test runs)
            if (earlier.doc, earlier.block) == (command.doc, command.block) and earlier.text not in NOT_RUN:
                self.run(earlier)
        if "RUN" in command.text or "<N>" in command.text:
            self.run(next(c for c in RUNNABLE if c.text == DEMO_TRAIN))
        box, text = self.sandbox(command.doc), fill(command.text, placeholders(self.sandbox("README.md").path))
        if command.background:
            box.start(text, timeout=300)
            self.results[key] = None
        else:
            self.results[key] = box.run(text, timeout=540)
        return self.results[key]

    def failed_before(self, command: Command) -> list[str]:
        """The commands it ran after (its block's earlier ones, the demo run) that failed."""
        before = [c for c in COMMANDS[:COMMANDS.index(command)]
                  if (c.doc, c.block) == (command.doc, command.block) or c.text == DEMO_TRAIN]
        return [c.where for c in before if self.results.get((c.doc, c.text)) is not None
                and self.results[(c.doc, c.text)].returncode != EXPECTED_EXIT.get(c.text, 0)]

    def close(self) -> None:
        for box in self.sandboxes.values():
            box.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    opened = Pages(tmp_path_factory.mktemp("pages"))
    yield opened
    opened.close()


def _param(command: Command):
    reason = KNOWN_FAILING.get(command.text)
    return pytest.param(command, id=command.where,
                        marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.distributed
@pytest.mark.parametrize("command", [_param(c) for c in RUNNABLE])
def test_a_documented_command_runs_as_written(pages, command):
    done = pages.run(command)
    box = pages.sandbox(command.doc)
    if done is None:
        assert box.background[-1].poll() is None, f"{command.where}: the background command exited"
        return
    output = done.stdout + done.stderr
    context = f"{command.where}: {command.text}\n(failed before it: {pages.failed_before(command)})\n{output[-3000:]}"
    assert done.returncode == EXPECTED_EXIT.get(command.text, 0), context
    if command.text in EXPECTED_EXIT:
        assert len([l for l in output.splitlines() if l.startswith("error:")]) == 1, context
        return
    values = placeholders(pages.sandbox("README.md").path)
    missing = [p for p in produced_paths(fill(command.text, values)) if not (box.path / p).exists()]
    assert not missing, f"{context}\nnot written: {missing}"
    steps = re.search(r"train\.max_steps=(\d+)", command.text)
    for path in produced_paths(fill(command.text, values)):
        if path.endswith("metrics.jsonl") and steps:
            rows = [json.loads(line) for line in (box.path / path).read_text().splitlines()]
            assert rows[-1]["step"] == int(steps.group(1)), context
    if command.text in CHECKS:
        CHECKS[command.text](output, box.path)
