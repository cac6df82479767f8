"""Tiny random multimodal projectors (mmproj GGUFs) that the pinned mtmd (``libmtmd``) loads, and
a tiny image for them, for the multimodal end-to-end check (tests/e2e/test_e2e_mmproj.py).

Three projector types, each paired with the text architecture it serves (``PROJECTORS``):

* ``mlp`` (LLaVA-1.5; ``clip_graph_llava::build``, ``tools/mtmd/models/llava.cpp``): a CLIP ViT
  (conv patch embedding, class embedding, learned positions, pre-norm, layer-norm blocks) and a
  two-layer GELU MLP into the text model's width. Ops no text model sends: IM2COL (the patch
  convolution), CONCAT (the class embedding), NORM.
* ``gemma3`` (``clip_graph_siglip::build``, ``tools/mtmd/models/siglip.cpp``): a SigLIP ViT
  (no class embedding, post-norm), an average POOL_2D of the patch grid by
  ``projector.scale_factor``, RMS norm, and a projection whose weight the graph transposes and
  copies (CONT) before the MUL_MAT; the gemma3 text model then attends over the image tokens
  without the causal mask. Its text model is not the architectures check's gemma3: that one's
  sliding window of 4 tokens cannot see the image past the ``<end_of_image>`` text mtmd puts
  after it (a dozen byte tokens in the tiny vocabulary), and its tied output head repeats the
  last token whatever came before, so the image would not change the answer.
* ``qwen2vl_merger`` (Qwen2-VL; ``clip_graph_qwen2vl::build``, ``tools/mtmd/models/qwen2vl.cpp``):
  two patch convolutions added (the still image as both frames of the temporal patch), a
  permute-and-copy that groups each 2 x 2 block of patches, M-RoPE in vision mode over the
  patches' (row, column) positions instead of learned ones, layer-norm blocks, a post norm, and a
  GELU MLP over each merged 2 x 2 block (4 x the width in) into the text width; the architectures
  check's qwen2vl answers, with M-RoPE positions over the image's grid.

Keys and tensor names are those of ``clip-impl.h`` (``KEY_*``, ``TN_*``); shapes are ggml ``ne``.
Weights are random but seeded. The image is a BMP (stb_image in mtmd decodes it; no image
library is needed to write one), ``IMAGE_SIZE`` square so the preprocessing neither pads nor
tiles it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from support.arch_models import Tiny, _gemma3, write_arch_gguf

IMAGE_SIZE, PATCH_SIZE = 32, 4            # 8 x 8 = 64 patches
N_EMBD, N_HEAD, N_FF, N_LAYER = 32, 2, 64, 2
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
GEMMA3_POOL = 2                           # pooled 2 x 2: 16 image tokens
QWEN2VL_MERGE = 2                         # merged 2 x 2 (clip.cpp's default n_merge): 16 image tokens



@dataclass(frozen=True)
class Projector:
    """One projector type of the check: the text architecture it is paired with, and the ops of
    its encoder graph that no text graph sends (the proof that the encoder ran on a server)."""

    name: str
    text_arch: str
    ops: tuple[str, ...]
    class_token: bool = False

    @property
    def vit_rows(self) -> int:
        """Rows M of the ViT's matmuls (the patches, and the class token if there is one)."""
        return N_PATCHES + self.class_token


PROJECTORS = {p.name: p for p in (
    Projector("mlp", "llama", ("IM2COL", "CONCAT", "NORM"), class_token=True),
    Projector("gemma3", "gemma3", ("IM2COL", "POOL_2D", "NORM")),
    Projector("qwen2vl_merger", "qwen2vl", ("IM2COL", "NORM")),
)}


def write_text_gguf(path: Path, projector: str, *, seed: int = 0) -> Path:
    """The tiny text model that ``projector``'s images are answered by."""
    if projector != "gemma3":
        return write_arch_gguf(path, PROJECTORS[projector].text_arch, seed=seed)
    m = Tiny(Path(path), "gemma3", seed)
    _gemma3(m, sliding_window=512, tied_output=False)   # every layer sees the image; an own head
    m.close()
    return Path(path)


def write_mmproj_gguf(path: Path, projector: str, n_embd_text: int, *, seed: int = 0) -> Path:
    """A projector of type ``projector`` (``PROJECTORS``) whose output width is the text model's
    ``n_embd_text`` (mtmd refuses a projector whose width differs from the text model's,
    ``mtmd_context``)."""
    if projector not in PROJECTORS:
        raise ValueError(f"no tiny projector of type {projector!r}; have {sorted(PROJECTORS)}")
    llava, qwen2vl = projector == "mlp", projector == "qwen2vl_merger"
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")
    w.add_name("tiny random projector")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", projector)
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
    if projector == "gemma3":
        w.add_uint32("clip.vision.projector.scale_factor", GEMMA3_POOL)
    if qwen2vl:
        w.add_uint32("clip.vision.spatial_merge_size", QWEN2VL_MERGE)
    w.add_file_type(1)

    def mat(name: str, *ne: int, scale: float = 0.1) -> None:
        w.add_tensor(name, (rng.standard_normal(ne[::-1]) * scale).astype(np.float16))

    def vec(name: str, *ne: int, mean: float = 0.0, scale: float = 0.1) -> None:
        w.add_tensor(name, (mean + scale * rng.standard_normal(ne[::-1])).astype(np.float32))

    mat("v.patch_embd.weight", PATCH_SIZE, PATCH_SIZE, 3, N_EMBD)
    if llava:
        vec("v.class_embd", N_EMBD)
    elif qwen2vl:    # the second frame's kernel; no bias, no learned positions (qwen2vl.cpp asserts)
        mat("v.patch_embd.weight.1", PATCH_SIZE, PATCH_SIZE, 3, N_EMBD)
    else:
        vec("v.patch_embd.bias", N_EMBD)
    if not qwen2vl:
        vec("v.position_embd.weight", N_EMBD, N_PATCHES + llava)
    norm = "pre_ln" if llava else "post_ln"
    vec(f"v.{norm}.weight", N_EMBD, mean=1.0)
    vec(f"v.{norm}.bias", N_EMBD)
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
    if llava:
        mat("mm.0.weight", N_EMBD, n_embd_text, scale=0.3)
        vec("mm.0.bias", n_embd_text)
        mat("mm.2.weight", n_embd_text, n_embd_text, scale=0.3)
        vec("mm.2.bias", n_embd_text)
    elif qwen2vl:   # over each 2 x 2 block of patches, concatenated
        merged = N_EMBD * QWEN2VL_MERGE ** 2
        mat("mm.0.weight", merged, merged, scale=0.3)
        vec("mm.0.bias", merged)
        mat("mm.2.weight", merged, n_embd_text, scale=0.3)
        vec("mm.2.bias", n_embd_text)
    else:   # ne[0] is the text width (siglip.cpp transposes it); drawn large because gemma3
        # scales token embeddings by sqrt(n_embd) and image embeddings not (models/gemma3.cpp)
        mat("mm.input_projection.weight", n_embd_text, N_EMBD, scale=2.0)
        vec("mm.soft_emb_norm.weight", N_EMBD, mean=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_bmp(*, seed: int = 0) -> bytes:
    """An ``IMAGE_SIZE`` square 24-bit BMP: a seeded random colour gradient with noise (noise
    alone looks alike to a pooling encoder whatever the seed; colour and slope do not)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, IMAGE_SIZE)[None, :, None]
    low, high = rng.uniform(0, 255, (2, 1, 1, 3))
    noise = rng.normal(0.0, 16.0, (IMAGE_SIZE, IMAGE_SIZE, 3))
    pixels = np.clip(low + (high - low) * ramp + noise, 0, 255).astype(np.uint8)
    row = IMAGE_SIZE * 3
    pad = (-row) % 4
    body = b"".join(pixels[y].tobytes() + b"\0" * pad for y in range(IMAGE_SIZE))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(body), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, IMAGE_SIZE, IMAGE_SIZE, 1, 24, 0, len(body), 2835, 2835, 0, 0)
    return header + info + body
