"""`leangrpo-convert`: help, bit-exact round trip, sharded input, and one-line errors with exit code 2."""

import json

import pytest
import torch
from safetensors.torch import load_file

from leangrpo_mcore.cli.convert import main
from tests.unit.test_flux_model import make_diffusers_flux


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


def test_help_lists_both_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "diffusers-to-mcore" in out and "mcore-to-diffusers" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["mcore-to-diffusers", "--help"])
    assert exit_info.value.code == 0 and "--keep-lora" in capsys.readouterr().out


@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip_is_bit_exact(tmp_path, capsys, sharded):
    from diffusers import FluxTransformer2DModel

    save_kwargs = {"max_shard_size": "20KB"} if sharded else {}
    make_diffusers_flux(tmp_path / "src", dtype=torch.bfloat16, guidance=not sharded, **save_kwargs)
    if sharded:
        assert (tmp_path / "src" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "src"),
                "--dst", str(tmp_path / "ours"))[0] == 0
    meta = json.loads((tmp_path / "ours" / "leangrpo_model.json").read_text())
    assert meta["format"] == "leangrpo_mcore.policy" and meta["version"] == 2 and meta["family"] == "flux"
    assert meta["lora"] is None and meta["config"]["num_single_layers"] == 1
    assert _run(capsys, "mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "back"))[0] == 0
    original = FluxTransformer2DModel.from_pretrained(str(tmp_path / "src")).state_dict()
    back = load_file(str(tmp_path / "back" / "diffusion_pytorch_model.safetensors"))
    assert set(back) == set(original)
    for key, tensor in original.items():
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], tensor), key
    reloaded = FluxTransformer2DModel.from_pretrained(str(tmp_path / "back"))
    assert reloaded.config.guidance_embeds is (not sharded)


def _assert_one_line_error(code, err, fragment):
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and fragment in err, err


def test_wrong_model_missing_and_corrupt_inputs_exit_2(tmp_path, capsys):
    make_diffusers_flux(tmp_path / "flux")
    code, err = _run(capsys, "diffusers-to-mcore", "--model", "wan", "--src", str(tmp_path / "flux"),
                     "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "FluxTransformer2DModel")
    code, err = _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "absent"),
                     "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "absent")
    code, err = _run(capsys, "mcore-to-diffusers", "--src", str(tmp_path / "flux"), "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "leangrpo_model.json")

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((tmp_path / "flux" / "config.json").read_text())
    (corrupt / "diffusion_pytorch_model.safetensors").write_bytes(b"\x07not a safetensors file")
    code, err = _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(corrupt),
                     "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "safetensors")

    assert _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "flux"),
                "--dst", str(tmp_path / "ours"))[0] == 0
    code, err = _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "flux"),
                     "--dst", str(tmp_path / "ours"))
    _assert_one_line_error(code, err, "not empty")
    (tmp_path / "ours" / "leangrpo_model.json").write_text("{broken")
    code, err = _run(capsys, "mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "not valid JSON")


def test_truncated_tensor_set_is_rejected(tmp_path, capsys):
    from safetensors.torch import save_file

    make_diffusers_flux(tmp_path / "flux")
    weights = tmp_path / "flux" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    tensors.pop("proj_out.bias")
    save_file(tensors, str(weights))
    code, err = _run(capsys, "diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "flux"),
                     "--dst", str(tmp_path / "out"))
    _assert_one_line_error(code, err, "missing keys ['proj_out.bias']")
