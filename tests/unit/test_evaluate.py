"""Evaluation: the deterministic eval rollout against an Euler loop written here, its fixed noise, the statistics,
``leangrpo-eval`` on a checkpoint and on a converted diffusers directory, and ``eval.jsonl`` on resume."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.cli.eval import main as eval_main
from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.diffusion.seeding import derive_seed, eval_inputs
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.eval_run import evaluate_model
from leangrpo_mcore.engine.evaluate import reward_summary
from leangrpo_mcore.engine.launch import init_distributed, shutdown
from leangrpo_mcore.engine.output.run_dir import RunDir, prepare
from leangrpo_mcore.parallel.mesh import destroy_parallel_context
from leangrpo_mcore.rl.rewards import REWARDS, register_reward

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
SMOOTH = "eval.rewards=[{name: mean_intensity_for_eval_tests}]"
EVAL = ("eval.num_prompts=3", "eval.samples_per_prompt=2", "eval.seed=7", SMOOTH)

if "mean_intensity_for_eval_tests" not in REWARDS:
    @register_reward("mean_intensity_for_eval_tests")
    def _mean_intensity(images, prompts):
        """Mean pixel intensity: continuous in the pixels, so rounding shows as rounding (not a JPEG byte)."""
        return images.mean(dim=(1, 2, 3))


def test_eval_noise_depends_only_on_seed_prompt_and_sample():
    init, seeds = eval_inputs(3, [0, 1, 2], [1, 0, 1], (4, 8), 5)
    alone, alone_seeds = eval_inputs(3, [1], [0], (4, 8), 5)
    assert torch.equal(init[1], alone[0]) and torch.equal(seeds[1], alone_seeds[0])
    expected = torch.randn((4, 8), generator=torch.Generator().manual_seed(derive_seed(3, "eval_noise", 0, 2, 1)))
    assert torch.equal(init[2], expected)
    assert not torch.equal(init[0], init[2])  # samples differ
    assert not torch.equal(eval_inputs(4, [0], [1], (4, 8), 5)[0][0], init[0])  # and so do seeds


def test_reward_summary_is_the_formula():
    values = np.array([[1.0, 3.0], [2.0, 6.0]])
    stats = reward_summary(values)
    assert stats["per_prompt"] == [2.0, 4.0]
    assert stats["mean"] == 3.0 and stats["min"] == 1.0 and stats["max"] == 6.0
    assert stats["std"] == pytest.approx(((4 + 0 + 1 + 9) / 4) ** 0.5)


def _flow_grpo_step(x, v, sigma, sigma_next, sigma_1, noise_level, noise):
    """FlowGRPO's SDE step, written out in float32: std_t = a sqrt(s / (1 - s~)) (s~ = the schedule's sigma_1 where
    s = 1), mean x (1 + std_t^2 dt / 2s) + v dt (1 + std_t^2 (1 - s) / 2s), plus std_t sqrt(-dt) noise."""
    dt = sigma_next - sigma
    std_t = noise_level * torch.sqrt(sigma / (1 - (sigma_1 if float(sigma) == 1.0 else sigma)))
    mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    return mean + std_t * torch.sqrt(-dt) * noise


def _reference_rewards(config) -> list[list[float]]:
    """The eval rewards computed here: the tiny policy's velocity stepped by x + v (s' - s), written out (with
    ``eval.noise_level`` > 0 FlowGRPO's SDE step with the noise of step t drawn from (eval.seed, i, j, t))."""
    dist_ctx = init_distributed()
    try:
        pctx = build.build_context(config, dist_ctx)
        family, hyper = build.policy_hyper(config)
        text, decoder = build.build_text_and_vae(config, family, hyper, dist_ctx.device)
        parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx))
        velocity = build.build_velocity(config, parts, pctx, cfg_scale=1.0)
        shape = build.policy_latent_shape(config, parts.policy, family)
        sigmas = get_sigmas("flux", config.eval.num_steps or config.sampler.num_steps, image_seq_len=shape[0])
        prompts = build.PromptDataset.from_source(config.data.prompts).prompts[:3]
        out = []
        for i, prompt in enumerate(prompts):
            row = []
            for j in range(2):
                gen = torch.Generator().manual_seed(derive_seed(7, "eval_noise", 0, i, j))
                x = torch.randn(shape, generator=gen).unsqueeze(0)
                cond = text.encode([prompt])
                with torch.no_grad():
                    for t in range(sigmas.numel() - 1):
                        v = velocity(x, sigmas[t].expand(1), cond)
                        if config.eval.noise_level == 0:
                            x = x + v * (sigmas[t + 1] - sigmas[t])
                            continue
                        seed = derive_seed(7, "eval_noise", 1, i, j, t)
                        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).unsqueeze(0)
                        x = _flow_grpo_step(x, v.float(), sigmas[t], sigmas[t + 1], sigmas[1],
                                            config.eval.noise_level, noise)
                    images = decoder.decode(x, height=config.sampler.height, width=config.sampler.width).images
                row.append(float(images.mean()))
            out.append(row)
        return out
    finally:
        destroy_parallel_context()
        shutdown(dist_ctx)


def test_eval_rollout_is_the_euler_ode_of_the_policy():
    config = load_config(TINY_FLUX, list(EVAL))
    result = evaluate_model(config)
    reference = np.array(_reference_rewards(config))
    stats = result.rewards["mean_intensity_for_eval_tests"]
    np.testing.assert_allclose(stats["per_prompt"], reference.mean(axis=1), rtol=1e-5)
    assert stats["min"] == pytest.approx(reference.min(), rel=1e-5)
    assert stats["max"] == pytest.approx(reference.max(), rel=1e-5)
    assert result.num_prompts == 3 and result.samples_per_prompt == 2 and len(result.samples) == 6
    # more steps is a different rollout: the step count reaches the sampler
    more = evaluate_model(load_config(TINY_FLUX, [*EVAL, "eval.num_steps=5"]))
    assert more.rewards["mean_intensity_for_eval_tests"]["mean"] != pytest.approx(stats["mean"], rel=1e-6)


@pytest.mark.slow
def test_sde_evaluation_draws_every_step_from_its_own_seed_as_the_rollout_written_here(monkeypatch):
    """eval.noise_level > 0: the SDE noise of step t of eval sample (i, j) is drawn from (eval.seed, i, j, t), for
    every prompt, sample and step, no seed twice; and the evaluation equals FlowGRPO's SDE rollout written here."""
    from leangrpo_mcore.diffusion import sampler

    config = load_config(TINY_FLUX, [*EVAL, "eval.noise_level=0.7"])
    drawn: dict[int, list[int]] = {}
    real_step_noise = sampler.step_noise

    def recording(noise_seeds, t, rows, shape):
        drawn.setdefault(t, []).extend(noise_seeds[list(rows), t].tolist())
        return real_step_noise(noise_seeds, t, rows, shape)

    monkeypatch.setattr(sampler, "step_noise", recording)
    result = evaluate_model(config)
    steps = config.eval.num_steps or config.sampler.num_steps
    assert sorted(drawn) == list(range(steps))
    for t in range(steps):
        expected = [derive_seed(7, "eval_noise", 1, i, j, t) for i in range(3) for j in range(2)]
        assert sorted(drawn[t]) == sorted(expected), t
    every = [seed for t in range(steps) for seed in drawn[t]]
    assert len(set(every)) == len(every) == 3 * 2 * steps
    reference = np.array(_reference_rewards(config))
    stats = result.rewards["mean_intensity_for_eval_tests"]
    np.testing.assert_allclose(stats["per_prompt"], reference.mean(axis=1), rtol=1e-5)
    assert (stats["min"], stats["max"]) == pytest.approx((reference.min(), reference.max()), rel=1e-5)


@pytest.fixture(scope="module")
@once_per_process
def trained(tmp_path_factory):
    """A tiny FLUX run of 2 steps that evaluates before training and after each step."""
    run = tmp_path_factory.mktemp("eval") / "run"
    torch.set_num_threads(1)
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=2", *EVAL,
                       "eval.every=1", "eval.before_train=true"]) == 0
    return run


def test_training_run_writes_eval_rows_grids_and_tensorboard(trained):
    rows = [json.loads(line) for line in (trained / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        stats = row["rewards"]["mean_intensity_for_eval_tests"]
        assert set(stats) >= {"mean", "std", "min", "max", "per_prompt"} and len(stats["per_prompt"]) == 3
        assert stats["min"] <= stats["mean"] <= stats["max"]
    assert rows[0]["rewards"] != rows[2]["rewards"]  # the policy moved
    assert {f"eval_step_{n}.png" for n in range(3)} <= set(p.name for p in (trained / "samples").iterdir())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "eval/mean_intensity_for_eval_tests/mean" in scalars
    logged = [e.value for e in events.Scalars("eval/mean_intensity_for_eval_tests/mean")]
    assert logged == pytest.approx([r["rewards"]["mean_intensity_for_eval_tests"]["mean"] for r in rows], rel=1e-6)


def test_leangrpo_eval_of_a_checkpoint_and_of_its_converted_directory(trained, tmp_path, capsys):
    rows = [json.loads(line) for line in (trained / "eval.jsonl").read_text().splitlines()]
    out = tmp_path / "eval.json"
    assert eval_main(["--config", str(trained / "config.yaml"), "--checkpoint", str(trained / "checkpoints" / "step_2"),
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean_intensity_for_eval_tests" in printed and "step 2: 3 prompts x 2 samples" in printed
    result = json.loads(out.read_text())
    assert result["step"] == 2
    assert result["rewards"] == rows[2]["rewards"]  # the training run's own evaluation of those weights
    export = tmp_path / "export"
    assert convert_main(["mcore-to-diffusers", "--src", str(trained / "checkpoints" / "step_2"),
                         "--dst", str(export)]) == 0
    converted = tmp_path / "converted.json"
    assert eval_main(["--config", str(trained / "config.yaml"), f"model.path={export}", "--out", str(converted)]) == 0
    stats = json.loads(converted.read_text())["rewards"]["mean_intensity_for_eval_tests"]
    np.testing.assert_allclose(stats["per_prompt"], rows[2]["rewards"]["mean_intensity_for_eval_tests"]["per_prompt"],
                               rtol=1e-6)


def test_leangrpo_eval_bad_input_is_one_line(trained, tmp_path, capsys):
    assert eval_main(["--config", str(trained / "config.yaml"), "--checkpoint", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --checkpoint: no such directory")
    assert eval_main(["--config", TINY_FLUX, "model.preset=flux-tiny", "model.arch={num_layers: 2}",
                      "--checkpoint", str(trained / "checkpoints" / "step_2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match --config: its model_config" in err[0]
    assert eval_main(["--config", TINY_FLUX, "eval.rewards=[{name: no_such_reward}]"]) == 2
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err


def test_resume_drops_eval_rows_past_the_checkpoint(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    Path(run.eval_path).write_text("".join(json.dumps({"step": s, "rewards": {}}) + "\n" for s in (0, 2, 4, 6)))
    prepare(run, "x: 1\n", resume_step=4)
    assert [json.loads(line)["step"] for line in Path(run.eval_path).read_text().splitlines()] == [0, 2, 4]


_FAIL_EVAL_AT_CALL: list[int] = []
"""The call of ``failing_eval_reward_for_tests`` that raises (a server that went away mid-run), if any."""
_EVAL_CALLS: list[int] = []

if "failing_eval_reward_for_tests" not in REWARDS:
    @register_reward("failing_eval_reward_for_tests")
    def _failing_mean_intensity(images, prompts):
        """Mean pixel intensity; raises at the call named by ``_FAIL_EVAL_AT_CALL``."""
        _EVAL_CALLS.append(1)
        if _FAIL_EVAL_AT_CALL and len(_EVAL_CALLS) == _FAIL_EVAL_AT_CALL[0]:
            raise RuntimeError("the scoring service went away")
        return images.mean(dim=(1, 2, 3))


@pytest.mark.slow
def test_a_failed_evaluation_is_redone_on_resume(tmp_path, capsys):
    """The evaluation after step 2 fails (its checkpoint is saved): the run stops in one line, and the resumed run
    evaluates step 2 before step 3, so eval.jsonl has a row for every evaluated step."""
    torch.set_num_threads(1)
    run = tmp_path / "run"
    common = ["--config", TINY_FLUX, f"train.output_dir={run}", "checkpoint.save_every=1", "eval.every=1",
              "eval.num_prompts=1", "eval.samples_per_prompt=1", "eval.rewards=[{name: failing_eval_reward_for_tests}]",
              "logging.tensorboard=false", "logging.progress_bar=false"]
    _EVAL_CALLS.clear()
    _FAIL_EVAL_AT_CALL[:] = [2]  # one sample per evaluation: the second call is the evaluation of step 2
    try:
        assert train_main([*common, "train.max_steps=3"]) == 2
        err = capsys.readouterr().err
        assert "the scoring service went away" in err and "Traceback" not in err
    finally:
        _FAIL_EVAL_AT_CALL.clear()
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [1]
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert train_main([*common, "train.max_steps=3", "checkpoint.resume=auto"]) == 0
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [1, 2, 3]
    metrics = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3]  # the redone evaluation trains nothing twice


def test_eval_prompts_are_the_test_split_of_a_dataset_directory(tmp_path):
    from leangrpo_mcore.engine.evaluate import eval_dataset
    from leangrpo_mcore.errors import UserError

    data = tmp_path / "pickscore"
    data.mkdir()
    (data / "train.txt").write_text("a train prompt\nanother\n")
    (data / "test.txt").write_text("held out one\nheld out two\nheld out three\n")
    config = load_config(TINY_FLUX, [f"data.prompts={data}", "eval.num_prompts=2"])
    assert eval_dataset(config).prompts == ["held out one", "held out two"]
    (tmp_path / "only_train").mkdir()
    (tmp_path / "only_train" / "train.txt").write_text("x\n")
    assert eval_dataset(load_config(TINY_FLUX, [f"eval.prompts={tmp_path / 'only_train'}"])).prompts == ["x"]
    with pytest.raises(UserError, match=r"^eval\.prompts: prompt file not found"):
        eval_dataset(load_config(TINY_FLUX, [f"eval.prompts={tmp_path / 'missing.txt'}"]))
    with pytest.raises(UserError, match=r"^data\.prompts: "):
        build.prompts_from("data.prompts", str(tmp_path / "nothing"), "train")


def test_eval_uses_the_ema_weights_and_leaves_training_untouched(tmp_path):
    """With train.ema_decay the evaluation scores the EMA shadow, restored afterwards: the training run with
    evaluations equals the one without, and leangrpo-eval with and without EMA differ."""
    torch.set_num_threads(1)
    common = ["--config", TINY_FLUX, "train.max_steps=2", "train.ema_decay=0.5", "checkpoint.save_every=1"]
    assert train_main([*common, f"train.output_dir={tmp_path / 'plain'}"]) == 0
    assert train_main([*common, f"train.output_dir={tmp_path / 'eval'}", *EVAL, "eval.every=1"]) == 0
    plain, evaluated = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                        for name in ("plain", "eval"))
    assert [r["reward_mean"] for r in plain] == [r["reward_mean"] for r in evaluated]
    assert [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in evaluated]
    logged = [json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    config, ckpt = str(tmp_path / "eval" / "config.yaml"), str(tmp_path / "eval" / "checkpoints" / "step_1")
    for use_ema, out in (("true", "ema.json"), ("false", "raw.json")):
        assert eval_main(["--config", config, "--checkpoint", ckpt, "--out", str(tmp_path / out),
                          f"eval.use_ema={use_ema}"]) == 0
    ema, raw = (json.loads((tmp_path / out).read_text())["rewards"]["mean_intensity_for_eval_tests"]
                for out in ("ema.json", "raw.json"))
    assert ema == logged[0]["rewards"]["mean_intensity_for_eval_tests"]  # the run evaluated its EMA by default
    assert ema["mean"] != pytest.approx(raw["mean"], rel=1e-7)


if "metadata_score_for_tests" not in REWARDS:
    @register_reward("metadata_score_for_tests")
    def _metadata_score(images, prompts, metadata):
        """The 'score' field of each prompt's metadata line (what a GenEval-style reward reads)."""
        return torch.tensor([float(m["score"]) for m in metadata])


def test_prompt_metadata_reaches_a_reward_that_takes_it(tmp_path):
    data = tmp_path / "geneval"
    data.mkdir()
    (data / "train_metadata.jsonl").write_text('{"prompt": "two cats", "score": 1.5}\n'
                                               '{"prompt": "a red cube", "score": -0.5}\n')
    (data / "test_metadata.jsonl").write_text('{"prompt": "a cup", "score": 3}\n{"prompt": "two dogs", "score": 7}\n')
    run = tmp_path / "run"
    torch.set_num_threads(1)
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1", f"data.prompts={data}",
                       "reward.name=metadata_score_for_tests", "eval.every=1"]) == 0
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["reward_mean"] == pytest.approx(0.5)  # both training prompts, two generations each
    (evaluated,) = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evaluated["rewards"]["metadata_score_for_tests"]["per_prompt"] == [3.0, 7.0]  # the test split's lines
    from leangrpo_mcore.rl.rewards import build_reward

    video_reward = build_reward("metadata_score_for_tests", frames=2)
    assert video_reward(torch.rand(2, 3, 5, 8, 8), ["a", "b"], [{"score": 2}, {"score": 4}]).tolist() == [2.0, 4.0]


def test_model_path_is_read_once_by_training_and_evaluation(trained, tmp_path, monkeypatch):
    """The model source is resolved once and handed on: no second reading of model.path's metadata."""
    from leangrpo_mcore.models.common import checkpoint as ckpt

    export = tmp_path / "diffusers"
    ours = tmp_path / "ours"
    assert convert_main(["mcore-to-diffusers", "--src", str(trained / "checkpoints" / "step_2"),
                         "--dst", str(export)]) == 0
    assert convert_main(["diffusers-to-mcore", "--model", "flux", "--src", str(export), "--dst", str(ours)]) == 0
    calls = []
    for name in ("read_policy_checkpoint", "read_diffusers_dir"):
        original = getattr(ckpt, name)
        monkeypatch.setattr(ckpt, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    torch.set_num_threads(1)
    for path, reader in ((ours, "read_policy_checkpoint"), (export, "read_diffusers_dir")):
        calls.clear()
        assert train_main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / reader}", "train.max_steps=1",
                           f"model.path={path}"]) == 0
        assert calls == [reader]
        calls.clear()
        assert eval_main(["--config", TINY_FLUX, f"model.path={path}", *EVAL]) == 0
        assert calls == [reader]
