"""A tiny random CLIP model directory for CPU demos and tests: NOT a trained model.

``write_tiny_clip_dir(directory)`` saves a transformers ``CLIPModel`` (2 layers of width 32 per tower, 224 px
images, patch 32) with random weights fixed by a seed, its ``CLIPImageProcessor`` (OpenAI's normalisation) and a
CLIP byte-level BPE tokenizer built from a small vocabulary: what the CLIP-based rewards load, without a model hub.
Its scores mean nothing; they let the image-editing demo (``tools/make_edit_demo.py``) and the tests run the real
reward code end to end.
"""

import json

import torch

from leangrpo_mcore.errors import require_extra

WIDTH, LAYERS, PATCH, IMAGE, PROJ, CONTEXT = 32, 2, 32, 224, 16, 77
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _bytes_to_unicode():
    """CLIP's (GPT-2's) byte -> printable character table of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def _write_tokenizer(directory):
    transformers = require_extra("transformers", "rewards", "the tiny CLIP model")

    chars = _bytes_to_unicode()
    merges = ["t h", "th e</w>", "c a", "ca t</w>", "d o", "do g</w>", "a p", "ap p"]
    vocab_list = chars + [c + "</w>" for c in chars] + [m.replace(" ", "") for m in merges]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab_list)}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = transformers.CLIPTokenizer(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"))
    tokenizer.save_pretrained(directory)
    return len(vocab_list)


def write_tiny_clip_dir(directory):
    """A tiny random ``CLIPModel`` (2 layers of width 32, 224 px images, patch 32), its ``CLIPImageProcessor`` and
    tokenizer saved to ``directory`` (a ``pathlib.Path``): what PickScore, CLIPScore and the aesthetic CLIP load."""
    transformers = require_extra("transformers", "rewards", "the tiny CLIP model")

    vocab = _write_tokenizer(directory)
    tokenizer = transformers.CLIPTokenizer.from_pretrained(directory)
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=4, vocab_size=vocab, max_position_embeddings=CONTEXT,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                           num_attention_heads=4, image_size=IMAGE, patch_size=PATCH),
        projection_dim=PROJ)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.CLIPModel(config).save_pretrained(directory)
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": IMAGE},
                                                   crop_size={"height": IMAGE, "width": IMAGE},
                                                   image_mean=list(OPENAI_MEAN), image_std=list(OPENAI_STD))
    processor.save_pretrained(directory)
