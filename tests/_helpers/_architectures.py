"""Tiny real architectures from transformers configs (no downloads) and a batch for each.

Each entry builds a model with hidden size 32, 2 layers, 4 heads and a small vocabulary,
and a batch with labels so that ``model(**batch).loss`` is its training loss.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

Build = Callable[[], tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]]

# The marks of a slow sweep over these models (transformers warns on tiny configs).
SWEEP_MARKS = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

V = 99  # vocabulary
B, T = 2, 8  # batch, sequence length
TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": V}


def _ids(g: torch.Generator, n: int = T) -> torch.Tensor:
    return torch.randint(3, V, (B, n), generator=g)


def _classify(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(g), "labels": torch.randint(0, 2, (B,), generator=g)}


def _lm(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


def _seq2seq(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(g), "labels": _ids(g, 6)}


def _image(
    size: int = 32, channels: int = 3
) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.randn(B, channels, size, size, generator=g),
            "labels": torch.randint(0, 3, (B,), generator=g),
        }

    return batch


def _decoder(cls_name: str, config_name: str, **extra: Any) -> Build:
    def build() -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
        import transformers

        cfg = getattr(transformers, config_name)(**{**TEXT, **extra})
        return getattr(transformers, cls_name)(cfg), _lm

    return build


def _with(cls_name: str, config_name: str, batch: Callable[..., Any], **kw: Any) -> Build:
    def build() -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
        import transformers

        cfg = getattr(transformers, config_name)(**kw)
        return getattr(transformers, cls_name)(cfg), batch

    return build


LLAMA_LIKE = {"intermediate_size": 64, "num_key_value_heads": 2, "max_position_embeddings": 64}
VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 3,
}


def _wav2vec2() -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    import transformers

    cfg = transformers.Wav2Vec2Config(
        **TEXT,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        layerdrop=0.5,  # LayerDrop: a dropped layer is an intermittent ghost
        mask_time_prob=0.0,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )
    model = transformers.Wav2Vec2ForCTC(cfg)

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "input_values": torch.randn(B, 800, generator=g),
            "labels": torch.randint(1, V, (B, 5), generator=g),
        }

    return model, batch


def _whisper() -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=V,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
    )
    model = transformers.WhisperForConditionalGeneration(cfg)

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_features": torch.randn(B, 8, 32, generator=g), "labels": _ids(g, 6)}

    return model, batch


def _clip() -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    import transformers

    # Pooled at the end-of-text token, as a tokenizer puts it (without one, CLIP pools the
    # first token, which attends to itself only: its keys really get no gradient).
    text = {**TEXT, "intermediate_size": 64, "max_position_embeddings": 16, "eos_token_id": V - 1}
    vision = {k: v for k, v in VISION.items() if k != "num_labels"}
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = transformers.CLIPModel(cfg)

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(3, V - 1, (B, T), generator=g)
        ids[:, -1] = V - 1
        return {
            "input_ids": ids,
            "pixel_values": torch.randn(B, 3, 32, 32, generator=g),
            "return_loss": True,  # type: ignore[dict-item]
        }

    return model, batch


# Top-2 (Mixtral's own setting): with top-1 and renormalised weights the router's gradient
# is zero up to rounding, and vanishing_grad rightly says so.
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

ARCHITECTURES: dict[str, Build] = {
    "bert": _with(
        "BertForSequenceClassification", "BertConfig", _classify, **TEXT, intermediate_size=64
    ),
    "roberta": _with(
        "RobertaForMaskedLM", "RobertaConfig", _lm, **TEXT, intermediate_size=64, pad_token_id=1
    ),
    "distilbert": _with(
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        _classify,
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
    ),
    "albert": _with(
        "AlbertForMaskedLM", "AlbertConfig", _lm, **TEXT, intermediate_size=64, embedding_size=16
    ),
    "electra": _with(
        "ElectraForSequenceClassification",
        "ElectraConfig",
        _classify,
        **TEXT,
        intermediate_size=64,
        embedding_size=16,
    ),
    "gpt2": _with(
        "GPT2LMHeadModel",
        "GPT2Config",
        _lm,
        vocab_size=V,
        bos_token_id=1,
        eos_token_id=2,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
    ),
    "gpt_neo": _with(
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        _lm,
        vocab_size=V,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=32,
    ),
    "opt": _with(
        "OPTForCausalLM",
        "OPTConfig",
        _lm,
        **TEXT,
        ffn_dim=64,
        word_embed_proj_dim=32,
        max_position_embeddings=32,
    ),
    "llama": _decoder("LlamaForCausalLM", "LlamaConfig", **LLAMA_LIKE),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE),
    "qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE),
    "gemma": _decoder("GemmaForCausalLM", "GemmaConfig", **LLAMA_LIKE, head_dim=8),
    "phi": _decoder(
        "PhiForCausalLM", "PhiConfig", intermediate_size=64, max_position_embeddings=64
    ),
    "falcon": _decoder("FalconForCausalLM", "FalconConfig"),
    "bloom": _with(
        "BloomForCausalLM", "BloomConfig", _lm, vocab_size=V, hidden_size=32, n_layer=2, n_head=4
    ),
    "t5": _with(
        "T5ForConditionalGeneration",
        "T5Config",
        _seq2seq,
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    ),
    "bart": _with(
        "BartForConditionalGeneration",
        "BartConfig",
        _seq2seq,
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
    ),
    "vit": _with("ViTForImageClassification", "ViTConfig", _image(), **VISION),
    "deit": _with("DeiTForImageClassification", "DeiTConfig", _image(), **VISION),
    "swin": _with(
        "SwinForImageClassification",
        "SwinConfig",
        _image(),
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
        num_labels=3,
    ),
    "convnext": _with(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        _image(),
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_labels=3,
    ),
    "resnet": _with(
        "ResNetForImageClassification",
        "ResNetConfig",
        _image(),
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_labels=3,
    ),
    "wav2vec2": _wav2vec2,
    "whisper": _whisper,
    "clip": _clip,
    "switch_transformers": _with(
        "SwitchTransformersForConditionalGeneration",
        "SwitchTransformersConfig",
        _seq2seq,
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        decoder_start_token_id=0,
    ),
    "mixtral": _decoder("MixtralForCausalLM", "MixtralConfig", **LLAMA_LIKE, **MOE),
}
