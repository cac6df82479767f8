"""A model's shape as the benches price it: from a preset (each cites its published config),
a GGUF file's tensors, or a Hugging Face ``config.json`` (hidden size, FFN size, layers,
heads, KV heads, head dim, vocabulary, experts, short-conv, gated delta-net and sliding-window
layers).

Invariants: the weight matmuls of layer i are ``matmuls_at(i)`` (name -> (K, N, experts,
experts per token)); its host ops are ``host_layers()[i]`` (``cost.host_ops.LayerOps``);
``layer_matmuls()`` is a plain attention + FFN layer's, what the NPU decode forecast fuses.
Figures: docs/decode.md."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ggml_rknpu.cost.host_ops import DeltaNet, LayerOps
from ggml_rknpu.hw.alignment import align_up

if TYPE_CHECKING:
    from gguf import GGUFReader


@dataclass(frozen=True)
class ModelShape:
    """A llama/qwen-style model's shape (one row per output, [N, K]); the optional fields
    describe experts (MUL_MAT_ID FFNs after ``dense_layers`` dense ones), short-conv layers
    (LFM2: in_proj h -> 3h, out_proj h -> h instead of q/k/v/o), gated delta-net layers
    (Qwen3.5: qkv, z, beta, alpha and ssm_out projections around ``delta``'s recurrence),
    an output gate on attention (``attn_gate``: q's projection also yields a gate of q's width)
    and sliding-window layers."""

    name: str
    hidden: int
    ff: int
    layers: int
    q_dim: int          # heads x head_dim
    kv_dim: int         # kv heads x head_dim
    vocab: int
    source: str
    head_dim: int = 0   # 0: not known (a preset or config always gives it)
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    dense_layers: int = 0
    conv_layers: tuple[int, ...] = ()
    window: int = 0                    # the sliding window of the layers in ``window_layers``
    window_layers: tuple[int, ...] = ()
    delta_layers: tuple[int, ...] = ()
    delta: DeltaNet | None = None
    attn_gate: bool = False

    def __post_init__(self) -> None:
        if self.delta_layers and self.delta is None:
            raise ValueError(f"{self.name}: gated delta-net layers without their shape")

    def layer_matmuls(self) -> dict[str, tuple[int, int]]:
        """name -> (K, N) of a plain layer's weight matmuls."""
        h = self.hidden
        return {"q": (h, self.q_dim), "k": (h, self.kv_dim), "v": (h, self.kv_dim),
                "o": (self.q_dim, h), "gate": (h, self.ff), "up": (h, self.ff), "down": (self.ff, h)}

    def matmuls_at(self, i: int) -> dict[str, tuple[int, int, int, int]]:
        """name -> (K, N, experts, experts per token) of layer ``i``'s weight matmuls
        (1, 1: a MUL_MAT)."""
        h = self.hidden
        if i in self.conv_layers:
            out = {"in_proj": (h, 3 * h, 1, 1), "out_proj": (h, h, 1, 1)}
        elif self.delta is not None and i in self.delta_layers:
            d = self.delta
            out = {"qkv": (h, d.conv_channels, 1, 1), "z": (h, d.value_dim, 1, 1), "beta": (h, d.v_heads, 1, 1),
                   "alpha": (h, d.v_heads, 1, 1), "ssm_out": (d.value_dim, h, 1, 1)}
        else:
            out = {n: (*self.layer_matmuls()[n], 1, 1) for n in ("q", "k", "v", "o")}
            if self.attn_gate:
                out["q"] = (h, 2 * self.q_dim, 1, 1)
        if self.experts and i >= self.dense_layers:
            e, f, k = self.experts, self.expert_ff, self.experts_used
            out.update({"router": (h, e, 1, 1), "gate_exps": (h, f, e, k), "up_exps": (h, f, e, k),
                        "down_exps": (f, h, e, k)})
        else:
            out.update({n: (*self.layer_matmuls()[n], 1, 1) for n in ("gate", "up", "down")})
        return out

    def host_layers(self) -> tuple[LayerOps, ...]:
        """Each layer's host-op shape (``cost.host_ops``)."""
        if self.head_dim < 1:
            raise ValueError(f"{self.name}: no head dim, so its attention cannot be priced")
        heads, kv_heads = self.q_dim // self.head_dim, self.kv_dim // self.head_dim
        out = []
        for i in range(self.layers):
            ff = self.experts_used * self.expert_ff if self.experts and i >= self.dense_layers else self.ff
            if i in self.conv_layers:
                out.append(LayerOps(self.hidden, ff, 3 * self.hidden, 0, 0, 0, self.head_dim, None))
            elif self.delta is not None and i in self.delta_layers:
                d = self.delta
                out.append(LayerOps(self.hidden, ff, d.conv_channels + d.value_dim, 0, 0, 0, self.head_dim, None, d))
            else:
                window = self.window if i in self.window_layers else 0
                q_out = 2 * self.q_dim if self.attn_gate else self.q_dim
                out.append(LayerOps(self.hidden, ff, q_out, self.kv_dim, heads, kv_heads, self.head_dim, window))
        return tuple(out)


def _hf(repo: str) -> str:
    return f"huggingface.co/{repo} (its config)"


def _gemma3_windows(layers: int) -> tuple[int, ...]:
    """Gemma 3: five sliding-window layers, then a global one (sliding_window_pattern 6)."""
    return tuple(i for i in range(layers) if (i + 1) % 6)


def _lfm2_convs(layers: int, attention: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if i not in attention)


def _linear_but_every(layers: int, interval: int) -> tuple[int, ...]:
    """Qwen3.5 / Qwen3-Next: linear attention but for every ``interval``-th layer
    (full_attention_interval)."""
    return tuple(i for i in range(layers) if (i + 1) % interval)


_LFM2_ATTN = (2, 5, 8, 10, 12, 14)     # full_attn_idxs of LFM2-350M/700M/1.2B
# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads x head_dim,
# num_key_value_heads x head_dim, vocab_size, head_dim (and experts, conv and window
# layers), from each model's config.json; docs/anchors.md §6 for the calibration models.
PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("Qwen2.5-1.5B", 1536, 8960, 28, 12 * 128, 2 * 128, 151936, _hf("Qwen/Qwen2.5-1.5B-Instruct"), 128),
    ModelShape("Qwen3-0.6B", 1024, 3072, 28, 16 * 128, 8 * 128, 151936, _hf("Qwen/Qwen3-0.6B"), 128),
    ModelShape("Qwen3-1.7B", 2048, 6144, 28, 16 * 128, 8 * 128, 151936, _hf("Qwen/Qwen3-1.7B"), 128),
    ModelShape("Llama-3.2-1B", 2048, 8192, 16, 32 * 64, 8 * 64, 128256, _hf("meta-llama/Llama-3.2-1B"), 64),
    ModelShape("Gemma3-1B", 1152, 6912, 26, 4 * 256, 1 * 256, 262144, _hf("google/gemma-3-1b-it"), 256,
               window=512, window_layers=_gemma3_windows(26)),
    ModelShape("Granite-4.0-350M", 1024, 2048, 28, 16 * 64, 4 * 64, 100352,
               "ibm-granite/granite-4.0-350m (its GGUF metadata, docs/anchors.md §6.1)", 64),
    ModelShape("LFM2-350M", 1024, 4608, 16, 16 * 64, 8 * 64, 65536,
               "LiquidAI/LFM2-350M (its config and GGUF metadata, docs/anchors.md §6.2)", 64,
               conv_layers=_lfm2_convs(16, _LFM2_ATTN)),
    ModelShape("LFM2-700M", 1536, 6912, 16, 24 * 64, 8 * 64, 65536,
               "LiquidAI/LFM2-700M (its config and GGUF metadata, docs/anchors.md §6.2)", 64,
               conv_layers=_lfm2_convs(16, _LFM2_ATTN)),
    ModelShape("LFM2-8B-A1B", 2048, 7168, 24, 32 * 64, 8 * 64, 65536,
               "LiquidAI/LFM2-8B-A1B (its config, docs/anchors.md §6.1)", 64, experts=32, experts_used=4,
               expert_ff=1792, dense_layers=2, conv_layers=_lfm2_convs(24, (2, 6, 10, 14, 18, 21))),
    ModelShape("Qwen3.5-9B", 4096, 12288, 32, 16 * 256, 4 * 256, 248320,
               "Qwen/Qwen3.5-9B (its config's text_config, docs/anchors.md §6.1)", 256, attn_gate=True,
               delta_layers=_linear_but_every(32, 4), delta=DeltaNet(16, 32, 128, 4)),
)}


BENCH_MODELS = ("Qwen2.5-1.5B", "Qwen3-0.6B", "Qwen3-1.7B", "Llama-3.2-1B", "Gemma3-1B")
# what the benches price when no model is named; the other presets are the CPU calibration's


def _first(cfg: dict, *keys: str, default: int | None = None) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    if default is None:
        raise ValueError(f"config.json has none of {', '.join(keys)}")
    return default


def load_config_shape(path: Path) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (a file or a directory holding one):
    llama/qwen/gemma/granite-style decoders, their MoE forms and LFM2's short-conv layers
    (a multimodal config's ``text_config`` is the language model)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a readable config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a config.json object")
    cfg = cfg.get("text_config") or cfg
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = _first(cfg, "head_dim", default=hidden // heads)
    ff = _first(cfg, "intermediate_size", "block_ff_dim", "n_inner", "ffn_hidden_size")
    if cfg.get("block_auto_adjust_ff_dim") and "block_ff_dim" in cfg and cfg.get("intermediate_size") is None:
        multiple = int(cfg.get("block_multiple_of", 256))     # LFM2: 2/3 of block_ff_dim, rounded up
        ff = align_up(int(2 * ff / 3 * float(cfg.get("block_ffn_dim_multiplier", 1.0))), multiple)
    kinds = [str(t) for t in cfg.get("layer_types") or []]
    if not kinds and cfg.get("full_attn_idxs") is not None:
        kinds = ["full_attention" if i in cfg["full_attn_idxs"] else "conv" for i in range(layers)]
    if not kinds and cfg.get("linear_num_value_heads") and cfg.get("full_attention_interval"):
        kinds = ["linear_attention" if i in _linear_but_every(layers, int(cfg["full_attention_interval"]))
                 else "full_attention" for i in range(layers)]
    if not kinds and cfg.get("sliding_window_pattern"):
        kinds = ["full_attention" if (i + 1) % int(cfg["sliding_window_pattern"]) == 0 else "sliding_attention"
                 for i in range(layers)]
    if kinds and len(kinds) != layers:
        raise ValueError(f"{file}: {len(kinds)} layer_types for {layers} layers")
    known = {"conv", "full_attention", "sliding_attention", "attention", "linear_attention"}
    if set(kinds) - known:
        raise ValueError(f"{file}: layer types {sorted(set(kinds) - known)} have no price (known: {sorted(known)})")
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    delta = _delta_net(cfg, file) if "linear_attention" in kinds else None
    return ModelShape(
        cfg.get("_name_or_path") or file.parent.name or file.stem, hidden, ff, layers, heads * head_dim,
        kv_heads * head_dim, _first(cfg, "vocab_size"), f"config {file}", head_dim,
        experts=experts, experts_used=_first(cfg, "num_experts_per_tok", "num_experts_per_token",
                                             default=2 if experts else 0),
        expert_ff=_first(cfg, "moe_intermediate_size", "expert_intermediate_size", default=ff) if experts else 0,
        dense_layers=_first(cfg, "num_dense_layers", "first_k_dense_replace", default=0) if experts else 0,
        conv_layers=tuple(i for i, k in enumerate(kinds) if k == "conv"),
        window=_first(cfg, "sliding_window", default=0) if "sliding_attention" in kinds else 0,
        window_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
        delta_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"), delta=delta,
        attn_gate=bool(cfg.get("attn_output_gate")))


def _delta_net(cfg: dict, file: Path) -> DeltaNet:
    """A config's gated delta-net shape (Qwen3-Next / Qwen3.5 ``linear_*`` keys); ggml's
    GATED_DELTA_NET needs equal key and value head dims."""
    k_dim, v_dim = _first(cfg, "linear_key_head_dim"), _first(cfg, "linear_value_head_dim")
    if k_dim != v_dim:
        raise ValueError(f"{file}: linear key head dim {k_dim} != value head dim {v_dim} (ggml needs them equal)")
    return DeltaNet(_first(cfg, "linear_num_key_heads"), _first(cfg, "linear_num_value_heads"), k_dim,
                    _first(cfg, "linear_conv_kernel_dim"))


# llama.cpp's sliding-window pattern of an architecture whose GGUF names none (the default
# ``load_swa_pattern`` gets in the pinned src/models/<arch>.cpp): of every n layers the last
# is global, the others slide
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "exaone4": 4, "olmo2": 4}


def load_gguf_shape(path: Path) -> ModelShape:
    """The shape of a llama/qwen/gemma-style GGUF (and Qwen3.5's gated delta-net layers), from
    its tensors (ggml ne = [K, N]) and metadata: the head dim (``*.attention.key_length``, else
    ``*.rope.dimension_count``, else the q width over ``*.attention.head_count``), the sliding
    window (``_gguf_windows``), a delta-net layer's heads (``*.ssm.*``, as llama.cpp's
    qwen35 loader reads them)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    ne = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    layers = 1 + max((int(n.split(".")[1]) for n in ne if n.startswith("blk.")), default=-1)
    attention = [i for i in range(layers) if f"blk.{i}.attn_q.weight" in ne]
    delta_layers = tuple(i for i in range(layers) if f"blk.{i}.attn_qkv.weight" in ne and f"blk.{i}.ssm_conv1d.weight" in ne)
    first = attention[0] if attention else 0
    need = [f"blk.{first}.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
    need += [f"blk.0.{n}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")]
    missing = [n for n in need if n not in ne]
    if layers < 1 or missing:
        raise ValueError(f"{path}: not a llama/qwen-style GGUF (missing {missing or 'blk.* tensors'})")
    unknown = sorted(set(range(layers)) - set(attention) - set(delta_layers))
    if unknown:
        raise ValueError(f"{path}: layers {unknown} are neither attention nor gated delta-net ones (no price)")
    head = ne.get("output.weight", ne.get("token_embd.weight"))
    if head is None:
        raise ValueError(f"{path}: no output.weight or token_embd.weight")
    hidden, q_out = ne[f"blk.{first}.attn_q.weight"]
    arch_field = reader.fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else ""

    def meta(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        value = field.contents() if field is not None and field.data else 0
        return int(value[0] if isinstance(value, list) else value)    # a per-layer array: its first

    heads = meta("attention.head_count")
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or (q_out // heads if heads else 0)
    gated = q_out == 2 * heads * head_dim    # q's projection also yields the output gate (Qwen3.5)
    delta = None
    if delta_layers:
        delta = DeltaNet(meta("ssm.group_count"), meta("ssm.time_step_rank"), meta("ssm.state_size"),
                         meta("ssm.conv_kernel"))
        if ne[f"blk.{delta_layers[0]}.attn_qkv.weight"] != (hidden, delta.conv_channels):
            raise ValueError(f"{path}: attn_qkv is not [{hidden}, {delta.conv_channels}] as its ssm.* heads say")
    window, sliding = _gguf_windows(path, reader, arch, layers, meta("attention.sliding_window"))
    return ModelShape(path.stem, hidden, ne["blk.0.ffn_gate.weight"][1], layers, q_out // 2 if gated else q_out,
                      ne[f"blk.{first}.attn_k.weight"][1], head[1], f"GGUF {path.name}", head_dim,
                      window=window, window_layers=sliding, delta_layers=delta_layers, delta=delta, attn_gate=gated)


def _gguf_windows(path: Path, reader: GGUFReader, arch: str, layers: int, window: int) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that slide) of a GGUF with ``*.attention.sliding_window`` =
    ``window``: its ``*.attention.sliding_window_pattern`` (one flag per layer, or every n-th
    layer global), else the architecture's ``SWA_PATTERN``; a window with neither stays
    unpriced, as llama.cpp's graph for that architecture leaves it."""
    from gguf import GGUFValueType

    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if not window or (pattern is None and arch not in SWA_PATTERN):
        return 0, ()
    if pattern is not None and pattern.types[0] == GGUFValueType.ARRAY:
        flags = list(pattern.contents())
        if len(flags) < layers:
            raise ValueError(f"{path}: {len(flags)} sliding-window flags for {layers} layers")
        return window, tuple(i for i in range(layers) if flags[i])
    n = int(pattern.contents()) if pattern is not None else SWA_PATTERN[arch]
    return window, tuple(i for i in range(layers) if n == 0 or i % n < n - 1)   # llama_hparams::set_swa_pattern


def is_config(arg: str) -> bool:
    """Whether a model argument names a Hugging Face config (a .json file or a directory with one)."""
    p = Path(arg)
    return (p.is_file() and p.suffix == ".json") or (p.is_dir() and (p / "config.json").is_file())


def resolve(name: str) -> ModelShape:
    """A preset (case-insensitive), a Hugging Face config or a GGUF file."""
    preset = {k.lower(): v for k, v in PRESETS.items()}.get(name.lower())
    if preset is not None:
        return preset
    if is_config(name):
        return load_config_shape(Path(name))
    if Path(name).is_file():
        return load_gguf_shape(Path(name))
    raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}), a config.json nor a GGUF file")
