"""The learned rewards (pickscore, clip_score, aesthetic, hpsv2) on tiny random models of the real classes, and the
video ``frames`` option of every reward.

Each score is checked against an independent computation: transformers' own ``CLIPProcessor`` on the uint8 PIL
images and ``CLIPModel``'s forward with the scorer's formula written here, and for hpsv2 a plain-torch forward of
the open_clip state dict following open_clip's math.
"""

import importlib.util
import json
import math
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from leangrpo_mcore.errors import UserError
from tests.reward_models import (CONTEXT, IMAGE, LAYERS, OPENAI_MEAN, OPENAI_STD, PATCH, PROJ, WIDTH,
                                  write_tiny_clip_dir)
from leangrpo_mcore.rl.rewards import (
    REWARDS,
    ValidatedReward,
    build_reward,
    clip_config_from_openclip,
    openclip_to_transformers,
    register_reward,
)

transformers = pytest.importorskip("transformers")

HAS_OPEN_CLIP = importlib.util.find_spec("open_clip") is not None
HEADS = 16
PROMPTS = ["the cat", "a dog on the grass", "THE  Cat", "a red apple", "dog dog"]
LONG_PROMPT = " ".join(["the cat and a dog"] * 20)  # over 77 tokens: truncated with the end token kept


def _tiny_openclip_state_dict(vocab, generator):
    """An open_clip CLIP state dict (ViT-H-14's layout, tiny sizes) with random weights, built from scratch."""
    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=generator) * scale

    def blocks(prefix):
        out = {}
        for i in range(LAYERS):
            p = f"{prefix}transformer.resblocks.{i}."
            out.update({p + "ln_1.weight": 1 + rand(WIDTH), p + "ln_1.bias": rand(WIDTH),
                        p + "attn.in_proj_weight": rand(3 * WIDTH, WIDTH, scale=0.3),
                        p + "attn.in_proj_bias": rand(3 * WIDTH),
                        p + "attn.out_proj.weight": rand(WIDTH, WIDTH, scale=0.3),
                        p + "attn.out_proj.bias": rand(WIDTH),
                        p + "ln_2.weight": 1 + rand(WIDTH), p + "ln_2.bias": rand(WIDTH),
                        p + "mlp.c_fc.weight": rand(4 * WIDTH, WIDTH, scale=0.3), p + "mlp.c_fc.bias": rand(4 * WIDTH),
                        p + "mlp.c_proj.weight": rand(WIDTH, 4 * WIDTH, scale=0.3), p + "mlp.c_proj.bias": rand(WIDTH)})
        return out

    grid = IMAGE // PATCH
    state = {"visual.class_embedding": rand(WIDTH), "visual.positional_embedding": rand(grid * grid + 1, WIDTH),
             "visual.proj": rand(WIDTH, PROJ, scale=0.3),
             "visual.conv1.weight": rand(WIDTH, 3, PATCH, PATCH, scale=0.05),
             "visual.ln_pre.weight": 1 + rand(WIDTH), "visual.ln_pre.bias": rand(WIDTH),
             "visual.ln_post.weight": 1 + rand(WIDTH), "visual.ln_post.bias": rand(WIDTH),
             "positional_embedding": rand(CONTEXT, WIDTH), "text_projection": rand(WIDTH, PROJ, scale=0.3),
             "logit_scale": torch.tensor(math.log(100.0)), "token_embedding.weight": rand(vocab, WIDTH, scale=0.5),
             "ln_final.weight": 1 + rand(WIDTH), "ln_final.bias": rand(WIDTH)}
    state.update(blocks("visual."))
    state.update(blocks(""))
    return state


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of a tiny CLIPModel + processor dir, an aesthetic MLP .pth and an open_clip (HPS-format) .pt."""
    root = tmp_path_factory.mktemp("learned_rewards")
    clip_dir = root / "clip"
    clip_dir.mkdir()
    write_tiny_clip_dir(clip_dir)
    generator = torch.Generator().manual_seed(1)
    sizes = [PROJ, 24, 12, 8, 4, 1]
    mlp = {}
    for index, (fan_in, fan_out) in zip((0, 2, 4, 6, 7), zip(sizes, sizes[1:])):
        mlp[f"layers.{index}.weight"] = torch.randn(fan_out, fan_in, generator=generator) / math.sqrt(fan_in)
        mlp[f"layers.{index}.bias"] = torch.randn(fan_out, generator=generator) * 0.1
    torch.save(mlp, root / "mlp.pth")
    vocab = len(transformers.CLIPTokenizer.from_pretrained(clip_dir))
    openclip = _tiny_openclip_state_dict(vocab, generator)
    torch.save({"state_dict": {"module." + k: v for k, v in openclip.items()}}, root / "hps.pt")
    return {"clip": str(clip_dir), "mlp": str(root / "mlp.pth"), "hps": str(root / "hps.pt"),
            "mlp_state": mlp, "openclip": openclip}


def _images(sizes=((224, 224), (256, 320), (301, 250), (160, 200), (224, 260)), seed=0):
    """Float images in [0, 1] of several sizes, smooth plus noise, (3, H, W) each."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for height, width in sizes:
        ramp = torch.linspace(0, 1, width).expand(height, width)
        base = torch.stack([ramp, ramp.flip(-1), torch.full((height, width), 0.4)])
        out.append((base + 0.3 * torch.rand(3, height, width, generator=generator)).clamp(0, 1))
    return out


def _pil(image):
    return Image.fromarray((image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())


def _processor(tiny):
    return transformers.CLIPProcessor(transformers.CLIPImageProcessorPil.from_pretrained(tiny["clip"]),
                                      transformers.CLIPTokenizer.from_pretrained(tiny["clip"]))


def _close(actual, expected, rtol):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=rtol * 1e-2)


def _score_each(reward, images, prompts):
    """Score images of different sizes one at a time (a batch needs one size)."""
    return torch.cat([reward(image[None], [prompt]) for image, prompt in zip(images, prompts)])


def _feed_pixel_values(reward, pixel_values):
    """Make the reward's encoder see exactly ``pixel_values`` (the processor's) instead of its own transform."""
    reward.fn.encoder.transform = lambda images: pixel_values


def test_transform_matches_clip_processor(tiny):
    processor = _processor(tiny)
    reward = build_reward("clip_score", path=tiny["clip"])
    for image in _images():
        expected = processor(images=[_pil(image)], return_tensors="pt")["pixel_values"]
        ours = reward.fn.encoder.transform(image[None])
        assert ours.shape == expected.shape == (1, 3, IMAGE, IMAGE)
        level = (ours - expected).abs() * torch.tensor(OPENAI_STD).view(1, 3, 1, 1) * 255
        # A few resized pixels in 10^4 may land one uint8 level apart (float vs PIL's fixed-point bicubic).
        assert float(level.max()) < 1.001 and float((level > 0.5).float().mean()) < 2e-3


def _pickscore_expected(tiny, images, prompts):
    model = transformers.CLIPModel.from_pretrained(tiny["clip"]).eval()
    inputs = _processor(tiny)(text=prompts, images=[_pil(i) for i in images], padding=True, truncation=True,
                              max_length=CONTEXT, return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        text = model.get_text_features(input_ids=inputs["input_ids"],
                                       attention_mask=inputs["attention_mask"]).pooler_output
    image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
    return model.logit_scale.exp() * (text * image).sum(-1) / 26, inputs["pixel_values"]


def test_pickscore_matches_clipmodel(tiny):
    images, prompts = _images(), PROMPTS[:4] + [LONG_PROMPT]
    expected, pixel_values = _pickscore_expected(tiny, images, prompts)
    reward = build_reward("pickscore", path=tiny["clip"])
    _close(_score_each(reward, images, prompts), expected, 1e-3)
    _feed_pixel_values(reward, pixel_values)
    _close(reward(torch.zeros(5, 3, 8, 8), prompts), expected, 1e-5)


def test_clip_score_matches_logits_per_image(tiny):
    images, prompts = _images(), PROMPTS
    model = transformers.CLIPModel.from_pretrained(tiny["clip"]).eval()
    inputs = _processor(tiny)(text=prompts, images=[_pil(i) for i in images], padding="max_length",
                              truncation=True, max_length=CONTEXT, return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).logits_per_image.diagonal() / 30
    reward = build_reward("clip_score", path=tiny["clip"], processor_path=tiny["clip"])
    _close(_score_each(reward, images, prompts), expected, 1e-3)
    _feed_pixel_values(reward, inputs["pixel_values"])
    _close(reward(torch.zeros(5, 3, 8, 8), prompts), expected, 1e-5)


def test_aesthetic_matches_mlp_on_image_embedding(tiny):
    images = _images()
    model = transformers.CLIPModel.from_pretrained(tiny["clip"]).eval()
    pixel_values = _processor(tiny)(images=[_pil(i) for i in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        x = model.get_image_features(pixel_values=pixel_values).pooler_output
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    for index in (0, 2, 4, 6, 7):  # linear layers only: the released head has no activations
        x = x @ tiny["mlp_state"][f"layers.{index}.weight"].T + tiny["mlp_state"][f"layers.{index}.bias"]
    expected = x.squeeze(-1)
    reward = build_reward("aesthetic", path=tiny["clip"], mlp_path=tiny["mlp"])
    _close(_score_each(reward, images, PROMPTS), expected, 1e-3)
    _feed_pixel_values(reward, pixel_values)
    _close(reward(torch.zeros(5, 3, 8, 8), PROMPTS), expected, 1e-5)


# ---------------------------------------------------------------------------------- hpsv2: open_clip math by hand


def _block(x, state, prefix, causal):
    width = x.shape[-1]
    h = F.layer_norm(x, (width,), state[prefix + "ln_1.weight"], state[prefix + "ln_1.bias"], 1e-5)
    q, k, v = (h @ state[prefix + "attn.in_proj_weight"].T + state[prefix + "attn.in_proj_bias"]).chunk(3, dim=-1)
    heads = lambda t: t.view(t.shape[0], t.shape[1], HEADS, width // HEADS).transpose(1, 2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(width // HEADS)
    if causal:
        length = x.shape[1]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(x.shape)
    x = x + attended @ state[prefix + "attn.out_proj.weight"].T + state[prefix + "attn.out_proj.bias"]
    h = F.layer_norm(x, (width,), state[prefix + "ln_2.weight"], state[prefix + "ln_2.bias"], 1e-5)
    h = F.gelu(h @ state[prefix + "mlp.c_fc.weight"].T + state[prefix + "mlp.c_fc.bias"])
    return x + h @ state[prefix + "mlp.c_proj.weight"].T + state[prefix + "mlp.c_proj.bias"]


def _openclip_image(state, pixels):
    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([state["visual.class_embedding"].expand(x.shape[0], 1, -1), x], dim=1)
    x = F.layer_norm(x + state["visual.positional_embedding"], (WIDTH,), state["visual.ln_pre.weight"],
                     state["visual.ln_pre.bias"], 1e-5)
    for i in range(LAYERS):
        x = _block(x, state, f"visual.transformer.resblocks.{i}.", causal=False)
    x = F.layer_norm(x, (WIDTH,), state["visual.ln_post.weight"], state["visual.ln_post.bias"], 1e-5)
    return x[:, 0] @ state["visual.proj"]


def _openclip_text(state, ids):
    x = state["token_embedding.weight"][ids] + state["positional_embedding"]
    for i in range(LAYERS):
        x = _block(x, state, f"transformer.resblocks.{i}.", causal=True)
    x = F.layer_norm(x, (WIDTH,), state["ln_final.weight"], state["ln_final.bias"], 1e-5)
    return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ state["text_projection"]


def _openclip_tokens(tiny, prompts):
    """open_clip's tokenize: <sot> bpe <eot>, cut to 77 with <eot> last, zeros after."""
    tokenizer = transformers.CLIPTokenizer.from_pretrained(tiny["clip"])
    ids = torch.zeros(len(prompts), CONTEXT, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False) + \
            [tokenizer.eos_token_id]
        if len(tokens) > CONTEXT:
            tokens = tokens[:CONTEXT]
            tokens[-1] = tokenizer.eos_token_id
        ids[row, :len(tokens)] = torch.tensor(tokens)
    return ids


def _openclip_pixels(image):
    """open_clip's eval transform: PIL bicubic resize of the short side, torchvision's centre crop (rounded)."""
    pil = _pil(image)
    width, height = pil.size
    scale = IMAGE / min(width, height)
    size = (IMAGE, int(IMAGE * height / width)) if width <= height else (int(IMAGE * width / height), IMAGE)
    pil = pil.resize(size, Image.BICUBIC) if scale != 1 else pil
    top, left = int(round((pil.size[1] - IMAGE) / 2)), int(round((pil.size[0] - IMAGE) / 2))
    array = np.asarray(pil.crop((left, top, left + IMAGE, top + IMAGE)), dtype=np.float32) / 255
    array = (array - np.array(OPENAI_MEAN, dtype=np.float32)) / np.array(OPENAI_STD, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1)


def _hps_expected(tiny, pixels, prompts):
    state = {k: v.double() for k, v in tiny["openclip"].items()}
    with torch.no_grad():
        image = _openclip_image(state, pixels.double())
        text = _openclip_text(state, _openclip_tokens(tiny, prompts))
    image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
    return (image * text).sum(-1)


def test_hpsv2_matches_openclip_forward(tiny):
    images, prompts = _images(), PROMPTS[:4] + [LONG_PROMPT]
    pixels = torch.stack([_openclip_pixels(image) for image in images])
    expected = _hps_expected(tiny, pixels, prompts)
    reward = build_reward("hpsv2", path=tiny["hps"], processor_path=tiny["clip"])
    model = reward.fn.encoder.model
    assert model.config.vision_config.hidden_act == model.config.text_config.hidden_act == "gelu"
    assert model.config.text_config.max_position_embeddings == CONTEXT
    _close(_score_each(reward, images, prompts), expected, 1e-3)
    _feed_pixel_values(reward, pixels)
    _close(reward(torch.zeros(5, 3, 8, 8), prompts), expected, 1e-5)


def test_clip_config_and_keys_from_openclip_shapes(tiny):
    state = tiny["openclip"]
    vocab = state["token_embedding.weight"].shape[0]
    config = clip_config_from_openclip(state)
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.patch_size, vision.image_size) == (32, 2, 32, 224)
    assert (vision.intermediate_size, text.intermediate_size, config.projection_dim) == (128, 128, PROJ)
    assert (text.vocab_size, text.max_position_embeddings, text.eos_token_id) == (vocab, CONTEXT, vocab - 1)
    mapped = openclip_to_transformers(state)
    q, k, v = state["transformer.resblocks.1.attn.in_proj_weight"].chunk(3)
    torch.testing.assert_close(mapped["text_model.encoder.layers.1.self_attn.k_proj.weight"], k)
    torch.testing.assert_close(mapped["visual_projection.weight"], state["visual.proj"].T)
    with pytest.raises(UserError, match="^reward.options.path: unknown open_clip parameter visual.extra_head$"):
        openclip_to_transformers({**state, "visual.extra_head": torch.zeros(1)})


@pytest.mark.skipif(not HAS_OPEN_CLIP, reason="open_clip is not installed")
def test_hpsv2_matches_open_clip_model(tiny):
    import open_clip  # noqa: PLC0415 -- optional, only where installed

    vocab = tiny["openclip"]["token_embedding.weight"].shape[0]
    model = open_clip.model.CLIP(
        embed_dim=PROJ, quick_gelu=False,
        vision_cfg=open_clip.model.CLIPVisionCfg(layers=LAYERS, width=WIDTH, head_width=WIDTH // HEADS,
                                                 patch_size=PATCH, image_size=IMAGE),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=CONTEXT, vocab_size=vocab, width=WIDTH, heads=HEADS,
                                             layers=LAYERS))
    model.load_state_dict(tiny["openclip"], strict=True)
    model.eval()
    images, prompts = _images(), PROMPTS[:4] + [LONG_PROMPT]
    pixels = torch.stack([_openclip_pixels(image) for image in images])
    with torch.no_grad():
        image = model.encode_image(pixels, normalize=True)
        text = model.encode_text(_openclip_tokens(tiny, prompts), normalize=True)
    reward = build_reward("hpsv2", path=tiny["hps"], processor_path=tiny["clip"])
    _feed_pixel_values(reward, pixels)
    _close(reward(torch.zeros(5, 3, 8, 8), prompts), (image * text).sum(-1), 1e-5)


# ---------------------------------------------------------------------------------- options, errors, frames


def test_batch_size_chunks_give_the_same_values(tiny):
    images = torch.stack([image[:, :256, :256] for image in _images(((256, 300),) * 5)])
    whole = build_reward("pickscore", path=tiny["clip"])(images, PROMPTS)
    chunked = build_reward("pickscore", path=tiny["clip"], batch_size=2)
    assert chunked.fn.batch_size == 2
    torch.testing.assert_close(chunked(images, PROMPTS), whole, rtol=1e-5, atol=1e-7)
    assert len(set(whole.tolist())) == 5  # five different values: the chunks did not reuse one another's


@pytest.mark.parametrize("name,options,key,download", [
    ("pickscore", {"path": "/nonexistent/pickscore"}, "path", "yuvalkirstain/PickScore_v1"),
    ("clip_score", {"path": "./missing_clip_dir"}, "path", "openai/clip-vit-large-patch14"),
    ("aesthetic", {"path": "CLIP", "mlp_path": "/nonexistent/ava.pth"}, "mlp_path",
     "sac+logos+ava1-l14-linearMSE.pth"),
    ("hpsv2", {"path": "/nonexistent/HPS_v2.1_compressed.pt", "processor_path": "x"}, "path", "xswu/HPSv2"),
    ("pickscore", {}, "path", "yuvalkirstain/PickScore_v1"),
])
def test_missing_files_are_one_user_error_line(name, options, key, download):
    with pytest.raises(UserError) as error:
        build_reward(name, **options)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"reward.options.{key}") and download in message


def _truncated_clip_dir(tiny, tmp_path):
    """A copy of the tiny CLIP directory whose ``model.safetensors`` lost its second half (an interrupted download)."""
    import shutil

    copy = tmp_path / "clip_truncated"
    shutil.copytree(tiny["clip"], copy)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    return copy


def _garbage(path, payload=b"not a checkpoint " * 8):
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize("case", ["pickscore", "clip_score", "aesthetic_clip", "aesthetic_garbage_mlp",
                                  "aesthetic_truncated_mlp", "aesthetic_tensorless_mlp", "hpsv2_truncated"])
def test_damaged_weight_files_are_one_line_naming_the_file(tiny, tmp_path, case):
    """A truncated weight file, or a garbage / wrong aesthetic head, is one UserError line naming that file."""
    truncated = _truncated_clip_dir(tiny, tmp_path)
    mlp = tiny["mlp"]
    if case in ("pickscore", "clip_score"):
        name, options, key, culprit = case, {"path": str(truncated)}, "path", truncated / "model.safetensors"
    elif case == "aesthetic_clip":
        name, options, key, culprit = "aesthetic", {"path": str(truncated), "mlp_path": mlp}, "path", \
            truncated / "model.safetensors"
    elif case == "hpsv2_truncated":
        data = open(tiny["hps"], "rb").read()
        culprit = tmp_path / "hps_truncated.pt"
        culprit.write_bytes(data[:len(data) // 3])
        name, options, key = "hpsv2", {"path": str(culprit), "processor_path": tiny["clip"]}, "path"
    else:
        culprit = tmp_path / "head.pth"
        if case == "aesthetic_garbage_mlp":
            _garbage(culprit)
        elif case == "aesthetic_truncated_mlp":
            data = open(mlp, "rb").read()
            culprit.write_bytes(data[:len(data) // 2])
        else:
            torch.save({"layers.0.weight": "a string, not a tensor"}, culprit)
        name, options, key = "aesthetic", {"path": tiny["clip"], "mlp_path": str(culprit)}, "mlp_path"
    with pytest.raises(UserError) as error:
        build_reward(name, **options)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"reward.options.{key}: "), message
    assert str(culprit) in message, message
    assert "Please file an issue" not in message  # torch's advice paragraph is reduced to its cause


def test_aesthetic_head_wider_than_the_clip_projection_is_refused(tiny, tmp_path):
    """A head for 768-wide ViT-L/14 embeddings on a CLIP that projects to 16 is refused at load, not at scoring."""
    state = {key: value.clone() for key, value in tiny["mlp_state"].items()}
    state["layers.0.weight"] = torch.zeros(state["layers.0.weight"].shape[0], 768)
    torch.save(state, tmp_path / "wide.pth")
    with pytest.raises(UserError, match=rf"^reward.options.mlp_path: .*wide.pth takes 768-wide embeddings.* {PROJ}$"):
        build_reward("aesthetic", path=tiny["clip"], mlp_path=str(tmp_path / "wide.pth"))


def test_bad_device_dtype_and_batch_size_options(tiny):
    for options, key in (({"dtype": "fp8"}, "dtype"), ({"batch_size": 0}, "batch_size"),
                         ({"device": "warp-drive"}, "device")):
        with pytest.raises(UserError, match=f"^reward.options.{key}"):
            build_reward("pickscore", path=tiny["clip"], **options)


def _video(batch=2, frames=5, seed=3):
    return torch.rand(batch, 3, frames, 32, 40, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def mean_pixel():
    """A throw-away function reward: the mean pixel value of each image."""
    register_reward("_mean_pixel_frames")(lambda images, prompts: images.mean(dim=(1, 2, 3)))
    yield "_mean_pixel_frames"
    REWARDS.pop("_mean_pixel_frames")


class _SubmittingMean:
    """A reward with its own ``submit`` (as the remote reward): the mean pixel value."""

    def __call__(self, images, prompts):
        return images.mean(dim=(1, 2, 3))

    def submit(self, images, prompts):
        future = Future()
        future.set_result(self(images, prompts))
        return future


def test_frames_pick_and_average(mean_pixel):
    video, prompts = _video(), ["a", "b"]
    per_frame = video.mean(dim=(1, 3, 4))  # (B, F)
    torch.testing.assert_close(build_reward(mean_pixel)(video, prompts), per_frame[:, 0])
    torch.testing.assert_close(build_reward(mean_pixel, frames="mean")(video, prompts), per_frame.mean(1))
    # 3 evenly spaced of 5 frames: 0, 2, 4; 4 of 5: round(0, 1.33, 2.67, 4) = 0, 1, 3, 4.
    torch.testing.assert_close(build_reward(mean_pixel, frames=3)(video, prompts), per_frame[:, [0, 2, 4]].mean(1))
    torch.testing.assert_close(build_reward(mean_pixel, frames="4")(video, prompts),
                               per_frame[:, [0, 1, 3, 4]].mean(1))
    images = video[:, :, 0]
    torch.testing.assert_close(build_reward(mean_pixel, frames="mean")(images, prompts), per_frame[:, 0])
    weighted = build_reward("weighted", weights={mean_pixel: 2.0}, frames="mean")
    torch.testing.assert_close(weighted(video, prompts), 2 * per_frame.mean(1))
    torch.testing.assert_close(build_reward(mean_pixel, frames=2).submit(video, prompts).result(),
                               per_frame[:, [0, 4]].mean(1))
    own_submit = ValidatedReward("own_submit", _SubmittingMean(), frames=3)  # the remote reward's path
    torch.testing.assert_close(own_submit.submit(video, prompts).result(), per_frame[:, [0, 2, 4]].mean(1))
    for bad in ("last", 0, -2, 1.5, True):
        with pytest.raises(UserError, match=r"^reward.options.frames must be first, mean or an integer >= 1"):
            build_reward(mean_pixel, frames=bad)
    with pytest.raises(ValueError, match="one per video"):
        build_reward(mean_pixel)(video, ["a"])


def test_learned_reward_on_video_is_mean_of_frames(tiny):
    video, prompts = _video(batch=2, frames=4, seed=5), ["the cat", "a dog"]
    reward = build_reward("pickscore", path=tiny["clip"], frames="mean")
    frames = [build_reward("pickscore", path=tiny["clip"])(video[:, :, f], prompts) for f in range(4)]
    torch.testing.assert_close(reward(video, prompts), torch.stack(frames, 1).mean(1), rtol=1e-5, atol=1e-7)
