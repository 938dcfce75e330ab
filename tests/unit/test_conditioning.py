import hashlib
import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.data.conditioning import HashedTextEncoder, TextDims, build_text_encoder
from leangrpo_mcore.data.embedding_cache import write_embedding_cache
from leangrpo_mcore.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["a", "red", "cat", "dog", "on", "the", "sea", "blue", "photo", "of", ",", "&"]


def _cfg(name, path=None):
    return SimpleNamespace(text_encoder=name, text_encoder_path=None if path is None else str(path))


def _hashed_vector(domain, word, seed, dim):
    key = seed.to_bytes(8, "little")
    digest = hashlib.blake2b(f"{domain}\x1f{word}".encode(), digest_size=8, key=key).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randn(dim, generator=generator)


def test_hashed_matches_its_definition():
    dims = TextDims(text_dim=6, pooled_dim=5, max_length=8)
    enc = HashedTextEncoder("flux", dims, seed=7)
    cond = enc(["A red cat, on the sea", "a dog"])
    assert cond.encoder_hidden_states.shape == (2, 8, 6) and cond.encoder_hidden_states.dtype == torch.float32
    assert cond.pooled_projections.shape == (2, 5)
    assert cond.negative_encoder_hidden_states is None and cond.guidance is None
    words = ["a", "red", "cat", ",", "on", "the", "sea", "</s>"]
    expected = torch.stack([_hashed_vector("token", w, 7, 6) for w in words])
    assert torch.equal(cond.encoder_hidden_states[0], expected)
    pooled = torch.stack([_hashed_vector("pooled", w, 7, 5) for w in ["a", "dog", "</s>"]]).mean(0)
    assert torch.allclose(cond.pooled_projections[1], pooled, rtol=0, atol=1e-7)
    # Padding after the end token is zero; the same word has the same vector everywhere.
    assert torch.count_nonzero(cond.encoder_hidden_states[1, 3:]) == 0
    assert torch.equal(cond.encoder_hidden_states[1, 0], cond.encoder_hidden_states[0, 0])


def test_hashed_truncation_dedup_seed_negative_and_guidance():
    dims = TextDims(text_dim=4, max_length=3)
    enc = HashedTextEncoder("wan", dims, seed=0, negative_prompt="", guidance=None)
    cond = enc(["one two three four", "one two three four", "x"])
    end = _hashed_vector("token", "</s>", 0, 4)
    assert torch.equal(cond.encoder_hidden_states[0, 2], end)  # truncated, the end token kept
    assert torch.equal(cond.encoder_hidden_states[0], cond.encoder_hidden_states[1])
    assert cond.pooled_projections is None
    negative = cond.negative_encoder_hidden_states
    assert negative.shape == (3, 3, 4) and torch.equal(negative[0, 0], end)
    assert torch.count_nonzero(negative[:, 1:]) == 0
    other = HashedTextEncoder("wan", dims, seed=1)(["one two three four"]).encoder_hidden_states
    assert not torch.allclose(other[0], cond.encoder_hidden_states[0])
    flux = HashedTextEncoder("flux", TextDims(4, 3, 3), guidance=3.5)(["a", "b"])
    assert torch.equal(flux.guidance, torch.tensor([3.5, 3.5]))


def test_text_dims_and_factory_errors():
    dims = TextDims.for_policy("flux", {"joint_attention_dim": 32, "pooled_projection_dim": 16}, max_length=20)
    assert dims == TextDims(32, 16, 20)
    assert TextDims.for_policy("wan", {"text_dim": 24}) == TextDims(24, None, 512)
    with pytest.raises(UserError, match="pooled_projection_dim"):
        TextDims.for_policy("flux", {"joint_attention_dim": 32})
    assert isinstance(build_text_encoder(_cfg("hashed"), "wan", TextDims(4)), HashedTextEncoder)
    with pytest.raises(ValueError, match="valid: hashed, diffusers, precomputed"):
        build_text_encoder(_cfg("clip"), "wan", TextDims(4))
    with pytest.raises(UserError, match="needs model.text_encoder_path"):
        build_text_encoder(_cfg("diffusers"), "wan", TextDims(4))
    with pytest.raises(ValueError, match="unknown model family"):
        HashedTextEncoder("sdxl", TextDims(4))
    with pytest.raises(ValueError, match="pooled_dim"):
        HashedTextEncoder("flux", TextDims(4))


def _tokenizer(path, max_length):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
@once_per_process
def pipelines(tmp_path_factory):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("pipelines")
    flux, wan = root / "flux", root / "wan"
    vocab = len(WORDS) + 3
    CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=12, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=12, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )).save_pretrained(str(flux / "text_encoder"))
    t5 = dict(vocab_size=vocab, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2)
    T5EncoderModel(T5Config(**t5)).save_pretrained(str(flux / "text_encoder_2"))
    UMT5EncoderModel(UMT5Config(**t5)).save_pretrained(str(wan / "text_encoder"))
    _tokenizer(flux / "tokenizer", 77)
    _tokenizer(flux / "tokenizer_2", 512)
    _tokenizer(wan / "tokenizer", 512)
    return flux, wan


def test_diffusers_flux_encoders(pipelines):
    from transformers import CLIPTextModel, T5EncoderModel

    flux, _ = pipelines
    enc = build_text_encoder(_cfg("diffusers", flux), "flux", TextDims(16, 12, 10), guidance=3.5)
    prompts = ["a red cat on the sea", "a blue dog", "a red cat on the sea"]
    cond = enc(prompts)
    assert cond.encoder_hidden_states.shape == (3, 10, 16) and cond.pooled_projections.shape == (3, 12)
    assert torch.equal(cond.encoder_hidden_states[0], cond.encoder_hidden_states[2])
    again = build_text_encoder(_cfg("diffusers", flux), "flux", TextDims(16, 12, 10))(prompts)
    assert torch.equal(again.encoder_hidden_states, cond.encoder_hidden_states)
    # Independent reference: the saved models on hand-tokenized ids (word ids + </s>, padded with 0).
    ids = {w: i + 3 for i, w in enumerate(WORDS)}
    row = [ids[w] for w in "a blue dog".split()] + [1]
    clip = CLIPTextModel.from_pretrained(str(flux / "text_encoder")).eval()
    t5 = T5EncoderModel.from_pretrained(str(flux / "text_encoder_2")).eval()
    with torch.no_grad():
        pooled = clip(torch.tensor([row + [0] * (77 - len(row))])).pooler_output
        tokens = t5(torch.tensor([row + [0] * (10 - len(row))]))[0]
    assert torch.allclose(cond.pooled_projections[1], pooled[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(cond.encoder_hidden_states[1], tokens[0], rtol=1e-5, atol=1e-6)


def test_diffusers_wan_encoder_masks_padding(pipelines):
    _, wan = pipelines
    enc = build_text_encoder(_cfg("diffusers", wan), "wan", TextDims(16, None, 12), negative_prompt="")
    cond = enc(["the  sea &amp; a   cat", "a dog"])
    assert cond.encoder_hidden_states.shape == (2, 12, 16) and cond.pooled_projections is None
    # "the sea & a cat" + </s> = 6 real tokens (whitespace collapsed, HTML unescaped); the rest is exactly 0.
    assert torch.count_nonzero(cond.encoder_hidden_states[0, 6:]) == 0
    assert torch.count_nonzero(cond.encoder_hidden_states[0, :6].abs().sum(-1)) == 6
    same = enc(["the sea & a cat"]).encoder_hidden_states
    assert torch.equal(same[0], cond.encoder_hidden_states[0])
    negative = cond.negative_encoder_hidden_states
    assert negative.shape == (2, 12, 16) and torch.count_nonzero(negative[:, 1:]) == 0


def test_diffusers_errors(pipelines, tmp_path):
    _, wan = pipelines
    with pytest.raises(UserError, match="text encoder path not found"):
        build_text_encoder(_cfg("diffusers", tmp_path / "none"), "wan", TextDims(16))
    with pytest.raises(UserError, match="has no 'tokenizer_2' folder"):
        build_text_encoder(_cfg("diffusers", wan), "flux", TextDims(16, 12))
    shutil.copytree(wan / "tokenizer", tmp_path / "broken" / "tokenizer")
    (tmp_path / "broken" / "text_encoder").mkdir()
    with pytest.raises(UserError, match="cannot load UMT5EncoderModel from .*text_encoder: ") as info:
        build_text_encoder(_cfg("diffusers", tmp_path / "broken"), "wan", TextDims(16))
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"policy needs \(10, 32\)"):
        build_text_encoder(_cfg("diffusers", wan), "wan", TextDims(32, None, 10))(["a cat"])


def _precompute_tool():
    spec = importlib.util.spec_from_file_location("precompute_embeddings", ROOT / "tools" / "precompute_embeddings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_precomputed_cache_from_the_tool_equals_hashed(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\na blue dog\nthe sea\n")
    out = tmp_path / "cache"
    tool = _precompute_tool()
    argv = ["--family", "flux", "--prompts", str(prompts), "--out", str(out), "--encoder", "hashed",
            "--text-dim", "8", "--pooled-dim", "4", "--max-length", "6", "--shard-size", "2", "--seed", "3"]
    assert tool.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "embeddings-00000.safetensors", "embeddings-00001.safetensors", "index.json"]
    assert tool.main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    dims = TextDims(8, 4, 6)
    cached = build_text_encoder(_cfg("precomputed", out), "flux", dims, guidance=2.0)(["the sea", "a red cat"])
    direct = HashedTextEncoder("flux", dims, seed=3)(["the sea", "a red cat"])
    assert torch.equal(cached.encoder_hidden_states, direct.encoder_hidden_states)
    assert torch.equal(cached.pooled_projections, direct.pooled_projections)
    assert torch.equal(cached.guidance, torch.tensor([2.0, 2.0]))
    with pytest.raises(UserError, match="prompt not in the embedding cache .*'a green frog'"):
        build_text_encoder(_cfg("precomputed", out), "flux", dims)(["a green frog"])
    with pytest.raises(UserError, match="the policy needs"):
        build_text_encoder(_cfg("precomputed", out), "flux", TextDims(8, 4, 7))
    with pytest.raises(UserError, match="no embedding cache"):
        build_text_encoder(_cfg("precomputed", tmp_path), "flux", dims)


def test_precomputed_cache_of_diffusers_encoder_in_bf16(pipelines, tmp_path):
    _, wan = pipelines
    enc = build_text_encoder(_cfg("diffusers", wan), "wan", TextDims(16, None, 12))
    prompts = ["a cat", "the sea", ""]
    write_embedding_cache(enc, prompts, tmp_path, dtype=torch.bfloat16)
    cached = build_text_encoder(_cfg("precomputed", tmp_path), "wan", TextDims(16, None, 12), negative_prompt="")
    cond = cached(prompts[:2])
    reference = enc.embed(prompts)[0]
    assert cond.encoder_hidden_states.dtype == torch.float32
    assert torch.equal(cond.encoder_hidden_states, reference[:2].to(torch.bfloat16).float())
    assert torch.equal(cond.negative_encoder_hidden_states[1], reference[2].to(torch.bfloat16).float())
