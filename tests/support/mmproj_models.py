"""A tiny random multimodal projector (mmproj) GGUF that the pinned mtmd (``libmtmd``) loads,
and a tiny image for it, for the multimodal end-to-end check (tests/e2e/test_e2e_mmproj.py).

Why this projector: the LLaVA-1.5 layout (``clip.projector_type = "mlp"``) is the plainest one
the pinned ``tools/mtmd/clip.cpp`` loads: a CLIP ViT (conv patch embedding, class embedding,
learned positions, pre-norm, layer-norm attention blocks) and a two-layer GELU MLP into the text
model's embedding width (``clip_graph_llava::build`` in ``tools/mtmd/models/llava.cpp``). Its
graph carries ops no text model sends: IM2COL (the patch conv), CONCAT (the class embedding),
GELU and the non-causal attention over the patches. The keys and tensor names are those of
``clip-impl.h`` (``KEY_*``, ``TN_*``); shapes are ggml ``ne``. Weights are random but seeded.

The image is a BMP (stb_image in mtmd decodes it; no image library is needed to write one),
``IMAGE_SIZE`` square so the preprocessing neither pads nor tiles it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

IMAGE_SIZE, PATCH_SIZE = 32, 8            # 4 x 4 = 16 patches: 16 image tokens in the prompt
N_EMBD, N_HEAD, N_FF, N_LAYER = 32, 2, 64, 2
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2


def write_mmproj_gguf(path: Path, n_embd_text: int, *, seed: int = 0) -> Path:
    """A LLaVA-style projector whose output width is the text model's ``n_embd_text`` (mtmd
    refuses a projector whose width differs from the text model's, ``mtmd_context``)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")
    w.add_name("tiny random projector")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", N_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", N_FF)
    w.add_uint32("clip.vision.block_count", N_LAYER)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", N_HEAD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_file_type(1)

    def mat(name: str, *ne: int, scale: float = 0.1) -> None:
        w.add_tensor(name, (rng.standard_normal(ne[::-1]) * scale).astype(np.float16))

    def vec(name: str, *ne: int, mean: float = 0.0, scale: float = 0.1) -> None:
        w.add_tensor(name, (mean + scale * rng.standard_normal(ne[::-1])).astype(np.float32))

    mat("v.patch_embd.weight", PATCH_SIZE, PATCH_SIZE, 3, N_EMBD)
    vec("v.class_embd", N_EMBD)
    vec("v.position_embd.weight", N_EMBD, N_PATCHES + 1)
    vec("v.pre_ln.weight", N_EMBD, mean=1.0)
    vec("v.pre_ln.bias", N_EMBD)
    for il in range(N_LAYER):
        blk = f"v.blk.{il}"
        for norm in ("ln1", "ln2"):
            vec(f"{blk}.{norm}.weight", N_EMBD, mean=1.0)
            vec(f"{blk}.{norm}.bias", N_EMBD)
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(f"{blk}.{part}.weight", N_EMBD, N_EMBD)
            vec(f"{blk}.{part}.bias", N_EMBD)
        mat(f"{blk}.ffn_up.weight", N_EMBD, N_FF)       # ffn_down's ne[0] is n_ff, so clip.cpp
        vec(f"{blk}.ffn_up.bias", N_FF)                 # does not swap the pair (legacy names)
        mat(f"{blk}.ffn_down.weight", N_FF, N_EMBD)
        vec(f"{blk}.ffn_down.bias", N_EMBD)
    mat("mm.0.weight", N_EMBD, n_embd_text, scale=0.3)
    vec("mm.0.bias", n_embd_text)
    mat("mm.2.weight", n_embd_text, n_embd_text, scale=0.3)
    vec("mm.2.bias", n_embd_text)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_bmp(*, seed: int = 0) -> bytes:
    """An ``IMAGE_SIZE`` square 24-bit BMP of seeded random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    row = IMAGE_SIZE * 3
    pad = (-row) % 4
    body = b"".join(pixels[y].tobytes() + b"\0" * pad for y in range(IMAGE_SIZE))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(body), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, IMAGE_SIZE, IMAGE_SIZE, 1, 24, 0, len(body), 2835, 2835, 0, 0)
    return header + info + body
