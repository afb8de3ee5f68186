"""Tiny models of every family in :data:`~hotweights.testing.Arch`, built from transformers' own configs (needs
``transformers``), and the tensor-parallel chunks a Megatron-style trainer holds of them. Public through
:mod:`hotweights.testing`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, get_args

import torch

from hotweights.testing._families import ALWAYS_TIED, DTYPES, Arch

__all__ = ["build_tiny_model", "save_tiny_model", "tiny_config", "tp_chunk"]

_STD_SCALE = {"gemma2": 0.1, "gemma3": 0.1}

#: The families :func:`tiny_config` builds from a table (the first thirteen are spelled out in it): transformers
#: config class, and whether the family takes ``head_dim`` (set to ``hidden / heads``).
_FAMILIES: dict[str, tuple[str, bool]] = {
    "granite": ("GraniteConfig", False),
    "glm4": ("Glm4Config", True),
    "cohere": ("CohereConfig", False),
    "cohere2": ("Cohere2Config", True),
    "stablelm": ("StableLmConfig", False),
    "exaone4": ("Exaone4Config", False),
    "ernie4_5": ("Ernie4_5Config", True),
    "gemma": ("GemmaConfig", True),
    "apertus": ("ApertusConfig", False),
    "nemotron": ("NemotronConfig", True),
    "seed_oss": ("SeedOssConfig", True),
    "starcoder2": ("Starcoder2Config", False),
    "olmo3": ("Olmo3Config", False),
    "smollm3": ("SmolLM3Config", False),
    "phi": ("PhiConfig", False),
    "glm4_moe": ("Glm4MoeConfig", True),
    "olmoe": ("OlmoeConfig", False),
    "granitemoe": ("GraniteMoeConfig", False),
    "granitemoeshared": ("GraniteMoeSharedConfig", False),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", False),
    "exaone_moe": ("ExaoneMoeConfig", False),
    "afmoe": ("AfmoeConfig", True),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", True),
    "deepseek_v2": ("DeepseekV2Config", False),
    "deepseek_v3": ("DeepseekV3Config", False),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", False),
    "minicpm3": ("MiniCPM3Config", False),
    "qwen3_next": ("Qwen3NextConfig", True),
}
#: Families whose transformers configs name the decoder's sizes their own way.
_OWN_NAMES = ("falcon", "bloom", "opt", "gptj")
#: vLLM's CPU MLA kernel compiles for one latent size, kv_lora_rank + qk_rope_head_dim = 512 + 64 (DeepSeek's).
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
#: One attention head: vLLM 0.32's CPU rotary kernel (``ops.rotary_embedding``) takes a 3-D query ``[tokens, heads,
#: dim]`` as ``tokens * heads`` rows, rotating row i by ``positions[i]`` (read past its end for i >= tokens), and
#: vLLM's MLA hands it the queries' rotary part in that shape. One head keeps clear of that defect (not of the
#: others that keep these families in :data:`NOT_SERVED`).
_MLA_HEADS = dict(num_attention_heads=1, num_key_value_heads=1)
#: Granite's scalings (embeddings, residual branches, attention logits, output logits), set off 1.0.
_GRANITE = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=1 / 32, logits_scaling=2.0)


def _alternating(layers: int, first: str = "sliding_attention", then: str = "full_attention") -> list[str]:
    return [first if i % 2 == 0 else then for i in range(layers)]


def _family_options(
    arch: str, decoder: dict[str, Any], head_dim: int, experts: int, top_k: int, moe_intermediate: int
) -> dict[str, Any]:
    """What ``arch`` (one of :data:`_FAMILIES`) adds to the common decoder options: its experts, sliding windows,
    latent attention and scalings. Layer 0 is dense and layer 1 sparse where the family has both."""
    layers, intermediate = decoder["num_hidden_layers"], decoder["intermediate_size"]
    out: dict[str, Any] = {"head_dim": head_dim} if _FAMILIES[arch][1] else {}
    window = dict(sliding_window=16, layer_types=_alternating(layers))  # 16 < the longest of PROMPTS
    if arch == "granite":
        out.update(_GRANITE)
    elif arch == "cohere2":
        out.update(window)
    elif arch == "exaone4":
        out.update(window, sliding_window_pattern=2)
    elif arch == "apertus":  # Llama 3's rope scaling as Apertus ships it, scaled to max_position_embeddings
        out.update(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=12000000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
            )
        )
    elif arch == "seed_oss":
        out.update(attention_dropout=0.0, residual_dropout=0.0)
    elif arch == "olmo3":
        out.update(window)
    elif arch == "smollm3":
        out.update(no_rope_layers=[int(i % 2 == 0) for i in range(layers)])  # layer 1 has no rotary embedding
    elif arch == "glm4_moe":
        out.update(
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            n_shared_experts=1,
            first_k_dense_replace=1,
            use_qk_norm=True,
        )
    elif arch == "olmoe":
        out.update(num_experts=experts, num_experts_per_tok=top_k, intermediate_size=moe_intermediate)
    elif arch in ("granitemoe", "granitemoeshared"):
        out.update(_GRANITE, num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=moe_intermediate)
        if arch == "granitemoeshared":
            out.update(shared_intermediate_size=intermediate)
    elif arch == "ernie4_5_moe":  # layer 1 is MoE, with two shared experts
        out.update(moe_num_experts=experts, moe_k=top_k, moe_intermediate_size=moe_intermediate)
    elif arch == "exaone_moe":
        out.update(
            window,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            num_shared_experts=1,
            first_k_dense_replace=1,
            mlp_layer_types=_alternating(layers, "dense", "sparse"),
        )
    elif arch == "afmoe":
        out.update(
            window,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            num_shared_experts=1,
            num_dense_layers=1,
            global_attn_every_n_layers=2,
            # read by vLLM, not by transformers' class (whose router is this one): as Trinity ships them
            score_func="sigmoid",
            route_norm=True,
            n_group=1,
            topk_group=1,
        )
    elif arch == "hunyuan_v1_moe":  # the experts and the shared MLP are intermediate_size wide
        out.update(num_experts=experts, moe_topk=top_k, intermediate_size=moe_intermediate)
    elif arch in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        out.update(
            _MLA,
            q_lora_rank=64 if arch != "deepseek_v2" else None,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            n_shared_experts=1,
            first_k_dense_replace=1,
            **_MLA_HEADS,
            n_group=1,  # one expert group: vLLM's CPU router groups experts always
            topk_group=1,
        )
        if arch == "deepseek_v3":  # vLLM reads the router's kind here (transformers' class has one kind)
            out.update(topk_method="noaux_tc")
        if arch == "glm4_moe_lite":
            out.update(mlp_layer_types=_alternating(layers, "dense", "sparse"))
    elif arch == "minicpm3":
        out.update(_MLA, q_lora_rank=64, num_key_value_heads=decoder["num_attention_heads"])
    elif arch == "qwen3_next":
        out.update(
            layer_types=_alternating(layers, "linear_attention", "full_attention"),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,  # the CPU GDN kernel's one head size (Qwen3-Next's)
            linear_value_head_dim=128,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            shared_expert_intermediate_size=intermediate,
        )
    return out


def _own_names_config(
    transformers: Any,
    arch: str,
    common: dict[str, Any],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
) -> Any:
    if arch == "falcon":  # Falcon-40B/180B's layout: grouped K/V, one LayerNorm per branch, parallel attention
        return transformers.FalconConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            new_decoder_architecture=True,
            ffn_hidden_size=4 * hidden,  # vLLM's Falcon MLP is 4 * hidden wide, whatever the config says
            max_position_embeddings=512,
            **common,
        )
    if arch == "bloom":
        return transformers.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, **common)
    if arch == "opt":
        return transformers.OPTConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_dim=intermediate,
            word_embed_proj_dim=hidden,
            max_position_embeddings=512,
            dropout=0.0,
            **common,
        )
    # gptj
    return transformers.GPTJConfig(
        n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, rotary_dim=16, n_positions=512, **common
    )


def tiny_config(
    arch: Arch = "qwen2",
    *,
    tie: bool | None = None,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 1000,
    experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate: int = 64,
) -> Any:
    """A transformers config for a tiny decoder of ``arch`` (one of :data:`ARCHS`, or of :data:`NOT_SERVED`).

    head_dim = hidden / heads must be >= 32 for CPU attention. ``experts``, ``experts_per_token`` and
    ``moe_intermediate`` apply to the MoE architectures (:data:`MOE_ARCHS`; ``qwen2_moe`` also gets a shared
    expert of ``intermediate`` width). ``gpt_oss`` alternates sliding-window (16 tokens, shorter than the longest of
    :data:`PROMPTS`) and full attention layers, with attention sinks and biased experts; so do the other families
    with sliding windows. Where a family has dense and sparse layers, layer 0 is dense and layer 1 sparse. The MLA
    families (:data:`MLA_ARCHS` and the MLA ones of :data:`NOT_SERVED`) get the latent sizes vLLM's CPU MLA kernel
    takes (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64); DeepSeek-V2/V3 and GLM-4.7-Flash get one attention head
    whatever ``heads`` says (vLLM 0.32's CPU rotary kernel rotates a multi-head MLA query wrong). ``tie`` (None:
    tied for :data:`ALWAYS_TIED`, else untied) ties the output head to the embedding.
    """
    import transformers

    if arch not in get_args(Arch):
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(get_args(Arch))}")
    if tie is None:
        tie = arch in ALWAYS_TIED
    elif not tie and arch in ALWAYS_TIED:
        raise ValueError(f"vLLM serves {arch} with the embedding as its output head: it cannot be untied")
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=512, **common
        )
    if arch in _OWN_NAMES:
        return _own_names_config(transformers, arch, common, hidden, layers, heads, kv_heads, intermediate)
    decoder: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
        **common,
    )
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss"):
        decoder["head_dim"] = hidden // heads
    if arch == "qwen3_moe":
        decoder.update(
            num_experts=experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=moe_intermediate
        )
    elif arch == "qwen2_moe":
        decoder.update(
            num_experts=experts,
            num_experts_per_tok=experts_per_token,
            moe_intermediate_size=moe_intermediate,
            shared_expert_intermediate_size=intermediate,
        )
    elif arch == "mixtral":
        decoder.update(
            num_local_experts=experts, num_experts_per_tok=experts_per_token, intermediate_size=moe_intermediate
        )
    elif arch == "gpt_oss":
        decoder.update(
            num_local_experts=experts,
            num_experts_per_tok=experts_per_token,
            intermediate_size=moe_intermediate,
            sliding_window=16,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            # YaRN as GPT-OSS ships it, scaled to max_position_embeddings (factor = 512 / 128)
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        )
    elif arch in _FAMILIES:
        decoder.update(_family_options(arch, decoder, hidden // heads, experts, experts_per_token, moe_intermediate))
    classes = {
        **{a: cls for a, (cls, _) in _FAMILIES.items()},
        "qwen2": "Qwen2Config",
        "llama": "LlamaConfig",
        "qwen3": "Qwen3Config",
        "mistral": "MistralConfig",
        "phi3": "Phi3Config",
        "olmo2": "Olmo2Config",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "gpt_oss": "GptOssConfig",
    }
    return getattr(transformers, classes[arch])(**decoder)


def build_tiny_model(
    arch: Arch = "qwen2",
    seed: int = 0,
    *,
    tie: bool | None = None,
    std: float | None = None,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> Any:
    """A randomly initialised ``*ForCausalLM`` of ``arch`` (see :data:`ARCHS`) in ``dtype`` (None: the family's
    :data:`DTYPES` entry, else float32); ``std`` (default 0.3, smaller for Gemma) is large enough that different
    seeds give different greedy outputs."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES.get(arch, torch.float32) if dtype is None else dtype

    cfg = tiny_config(arch, tie=tie, **config)
    scale = (0.3 * _STD_SCALE.get(arch, 1.0)) if std is None else std
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # what transformers' own init draws (Qwen3-Next's A_log) is seeded too
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("sinks"):  # GPT-OSS attention sinks: one logit per head
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()


#: How a Megatron-style trainer cuts a checkpoint's tensors (Hugging Face names): column-parallel on dim 0,
#: row-parallel on dim 1, the others (norms, routers) whole on every rank.
_COLUMN = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.", "embed_tokens.", "lm_head.")
_ROW = ("o_proj.weight", "down_proj.weight")


def tp_chunk(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s tensor-parallel chunk of checkpoint tensor ``name``, as a Megatron-style trainer
    holds it: equal chunks along dim 0 (column-parallel) or dim 1 (row-parallel), the last one padded with zeros;
    a copy of the whole tensor for the others."""
    dim = 0 if any(k in name for k in _COLUMN) else 1 if any(k in name for k in _ROW) else None
    if dim is None:
        return tensor.clone()
    rows = -(-tensor.shape[dim] // size)
    pad = list(tensor.shape)
    pad[dim] = rows * size - tensor.shape[dim]
    padded = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    return padded.narrow(dim, rank * rows, rows).clone()


def save_tiny_model(model: Any, path: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` as safetensors; returns the directory."""
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    return out
