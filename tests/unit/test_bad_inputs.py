"""Bad inputs that used to escape as tracebacks or leak secrets, each now one `error:` line naming its key (exit 2):
a noise-free SDE sampler, an absurd learning rate, a reward plugin calling sys.exit (its own traceback shown with
LEANGRPO_TRACEBACK=1), a layout that does not fit the ranks, a reward server echoing the bearer token; and
``model.path`` at a diffusers pipeline root, whose scheduler gives the shift (against diffusers' own scheduler)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.cli.convert import main as convert
from leangrpo_mcore.cli.train import main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.model_source import resolve_model_source, sampler_shift
from leangrpo_mcore.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
TOKEN = "s3cret-token-0123456789abcdef"
PLUGIN = f"{__name__}:exit_reward"


def exit_reward(images, prompts):
    """A reward plugin that ends its process (as a careless script might)."""
    raise SystemExit(3)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _one_line_error(capsys, *argv) -> str:
    code = main(list(argv))
    captured = capsys.readouterr()
    output = captured.err + captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


def test_noise_free_sde_sampler_and_absurd_lr_are_refused_by_the_config(capsys, tmp_path):
    run = tmp_path / "run"
    line = _one_line_error(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "sampler.noise_level=0")
    assert "'sampler.noise_level' = 0 leaves sampler.sde_kind=flow_grpo no noise" in line
    for kind in ("flow_grpo_cps", "dance_grpo"):
        with pytest.raises(UserError, match="'sampler.noise_level' = 0"):
            load_config(TINY_FLUX, ["sampler.noise_level=0", f"sampler.sde_kind={kind}"])
    assert load_config(TINY_FLUX, ["sampler.noise_level=0", "sampler.sde_kind=wan"]).sampler.noise_level == 0
    line = _one_line_error(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "optim.lr=3e38")
    assert "'optim.lr' = 3e+38 must be <= 1000.0" in line
    assert not run.exists()


def test_a_reward_plugin_calling_sys_exit_is_its_one_line(capsys, tmp_path):
    line = _one_line_error(capsys, "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}",
                           f"reward.name={PLUGIN}")
    assert f"reward '{PLUGIN}' raised SystemExit: 3" in line


def test_traceback_flag_shows_the_plugins_own_traceback(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_TRACEBACK", "1")
    with pytest.raises(UserError, match="raised SystemExit"):
        main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", f"reward.name={PLUGIN}"])
    err = capsys.readouterr().err
    assert "Traceback" in err and "in exit_reward" in err and "raise SystemExit(3)" in err


def test_a_layout_that_does_not_fit_the_ranks_names_its_keys():
    config = load_config(TINY_FLUX, ["grpo.group_size=3"])
    with pytest.raises(UserError) as err:
        build.check_layout_early(config, SimpleNamespace(dp_size=2))
    assert str(err.value).startswith("grpo.group_size=3, grpo.prompts_per_step=2 and parallel.layout=shared do not "
                                     "fit 2 data-parallel ranks")


class _EchoHeaders(BaseHTTPRequestHandler):
    """A reward server that answers every request with an error quoting its Authorization header."""

    status = 401

    def do_POST(self):  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": f"rejected credentials {self.headers.get('Authorization')}"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [401, 503])
def test_the_bearer_token_is_redacted_from_the_error_line_and_file(capsys, tmp_path, monkeypatch, status):
    handler = type("Echo", (_EchoHeaders,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("REWARD_TOKEN", TOKEN)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        line = _one_line_error(capsys, "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}",
                               "reward.name=remote", f"reward.url=http://127.0.0.1:{server.server_port}/score",
                               "reward.auth_env=REWARD_TOKEN", "reward.retries=0")
    finally:
        server.shutdown()
        server.server_close()
    assert f"HTTP {status}" in line and "rejected credentials Bearer [redacted]" in line, line
    assert TOKEN not in line and TOKEN[:8] not in line
    recorded = error_file.read_text()
    assert "[redacted]" in recorded and TOKEN[:8] not in recorded


@pytest.fixture(scope="module")
@once_per_process
def pipeline_root(tmp_path_factory):
    """A diffusers pipeline root: the tiny FLUX policy under transformer/, a scheduler config with shift 5."""
    base = tmp_path_factory.mktemp("pipeline")
    torch.set_num_threads(1)
    assert main(["--config", TINY_FLUX, f"train.output_dir={base / 'run'}", "train.max_steps=1"]) == 0
    root = base / "flux-pipeline"
    assert convert(["mcore-to-diffusers", "--src", str(base / "run" / "checkpoints" / "step_1"),
                    "--dst", str(root / "transformer")]) == 0
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 5.0}))
    return root


def test_model_path_at_a_pipeline_root_takes_its_transformer_and_shift(capsys, pipeline_root, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = load_config(TINY_FLUX, [f"model.path={pipeline_root}", "sampler.sigma_schedule=sd3"])
    source = resolve_model_source(config)
    assert source.kind == "diffusers" and source.family.name == "flux"
    assert sampler_shift(config) == 5.0
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(pipeline_root), subfolder="scheduler")
    scheduler.set_timesteps(3)
    torch.testing.assert_close(build.sigma_schedule(config, 3, (4,)), scheduler.sigmas.float())
    pinned = load_config(TINY_FLUX, [f"model.path={pipeline_root}", "sampler.shift=2.0"])
    assert sampler_shift(pinned) == 2.0 and sampler_shift(load_config(TINY_FLUX)) == 3.0
    code = main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", f"model.path={pipeline_root}",
                 "sampler.sigma_schedule=sd3", "train.max_steps=1"])
    assert code == 0, capsys.readouterr().err
