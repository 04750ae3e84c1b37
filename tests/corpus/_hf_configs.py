"""The transformers half of the clean corpus: which architectures, and each one's tiny config.

The architectures are read from the installed package's auto mappings (never a list by
hand): every model type with a text head (seq2seq LM, causal LM, masked LM, sequence
classification) or only a base model. A config is shrunk generically: every size attribute
the config has (hidden sizes, layers, heads, head dims, feed-forward sizes, vocabulary,
positions, experts, low ranks) is set to a small value that keeps the usual divisibility
(hidden 32 = 2 heads x 16), and the config is built again from those values so that its
derived fields (layer types, head dims) follow. Nothing is downloaded.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Optional

from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto as auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

#: The heads, in the order one is chosen as an architecture's main program: the mapping of
#: model types to classes, and the auto class that builds it.
TASKS: dict[str, dict[str, str]] = {
    "seq2seq_lm": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "masked_lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "sequence_classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "base": auto.MODEL_MAPPING_NAMES,
}

V = 128  # the vocabulary of every tiny config
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16

_LAYERS = r"(^|_)(layers?|n_layers?|num_blocks)$"
# (pattern over an int attribute's name, its tiny value); the first match wins, and a value
# is never raised above the default (a config whose default is smaller keeps it).
_SIZES: tuple[tuple[str, int], ...] = (
    (r"^(first_k_dense_replace|n_group|topk_group|num_nextn_predict_layers)$", 1),
    (r"max_window_layers$", 2),
    (_LAYERS, 2),
    (r"(^|_)(num_)?(experts_per_tok|topk|top_k|selected_experts)$", 2),
    (r"(^|_)(num|n)_(local_|routed_|shared_)?experts$|^moe_num_experts$", 4),
    (r"qk_head_dim$", 2 * HEAD_DIM),
    (r"qk_(rope|nope)_head_dim$|^rotary_dim$", HEAD_DIM),
    (r"(head_dim|head_size|d_kv|d_head|kv_channels|headdim|d_rel)$", HEAD_DIM),
    (r"(^|_)(n_)?heads$|^n_head$|attention_heads$|^num_query_groups$", HEADS),
    (r"(intermediate_size|ffn_dim|(^|_)d_ff|n_inner|d_inner|ffn_hidden_size)$", 64),
    (r"(feed_forward_size|intermediate_dim|bottleneck_size)$", 64),
    (r"(^|_)(hidden_size|d_model|n_embd|emb_dim|embedding_size|embed_dim|dim|hidden_dim)$", 32),
    (r"^(word_embed_proj_dim|d_latents|lru_width|embedding_dim)$", HIDDEN),
    (r"(^|_)lora_rank$|^(time_step_rank|mamba_dt_rank|adapter_rank)$", 16),
    (r"(max_position_embeddings|^n_positions|^n_ctx|max_seq_len|_max_positions)$", 64),
    (r"^(max_target_positions|max_source_positions|context_length)$", 64),
    (r"(^|_)vocab_size(_per_layer_input)?$", V),
)
_SPECIAL = re.compile(r"_token_(id|index)$")
# Configs with these are multimodal or speech models: not text-only.
_OTHER_MODALITIES = (
    "vision_config",
    "audio_config",
    "speech_config",
    "audio_encoder",
    "vq_config",
    "audio_encoder_config",
    "vision_model",
)


class CannotBuild(Exception):
    """An architecture the tiny corpus cannot build, with the reason (a pytest skip)."""


def architectures() -> list[tuple[str, str]]:
    """Every (model type, task) the corpus runs: each text model type's main head.

    A model type with several heads runs its first in :data:`TASKS`' order; one with only a
    base model runs it with a regression loss on its hidden states.
    """
    heads = [t for t in TASKS if t != "base"]
    texty = set().union(*(TASKS[t] for t in heads))
    out = [(mt, next(t for t in heads if mt in TASKS[t])) for mt in sorted(texty)]
    base_only = sorted(set(TASKS["base"]) - texty - _non_text_types())
    return out + [(mt, "base") for mt in base_only]


def classifier_architectures() -> list[str]:
    """The model types with a sequence classification head whose main program is another."""
    main = dict(architectures())
    seq = TASKS["sequence_classification"]
    return sorted(mt for mt in seq if main.get(mt) != "sequence_classification")


def _non_text_types() -> set[str]:
    """Model types whose base model another modality's mapping lists (images, audio...)."""
    text = {"MODEL_MAPPING_NAMES", "CONFIG_MAPPING_NAMES", "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES"}
    out: set[str] = set()
    for name in dir(auto):
        if name.endswith("_MAPPING_NAMES") and name not in text:
            if not any(t is getattr(auto, name) for t in TASKS.values()):
                out |= set(getattr(auto, name))
    return out


def _tiny_value(name: str, default: Any) -> Optional[int]:
    if isinstance(default, bool) or not isinstance(default, int):
        return None
    for pattern, value in _SIZES:
        if re.search(pattern, name):
            return min(default, value) if default > 0 else None
    return None


def _specials(defaults: dict[str, Any]) -> dict[str, Any]:
    """Special token ids moved inside the tiny vocabulary, each kept apart from the others."""
    out: dict[str, Any] = {}
    free = iter(range(V - 1, V // 2, -1))
    for name, value in defaults.items():
        if not _SPECIAL.search(name):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= V:
            out[name] = next(free)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= V for v in value):
            out[name] = [v if v < V else next(free) for v in value]
    pad = out.get("pad_token_id", defaults.get("pad_token_id"))
    if pad is None:
        out["pad_token_id"] = 0
    return out


def _shrunk(defaults: dict[str, Any]) -> dict[str, Any]:
    """The overrides that make ``defaults`` tiny; a nested config dict is shrunk whole."""
    kwargs: dict[str, Any] = {}
    for name, default in defaults.items():
        if isinstance(default, dict) and "model_type" in default:
            kwargs[name] = {**default, **_shrunk(default)}
            continue
        value = _tiny_value(name, default)
        if value is not None and value != default:
            kwargs[name] = value
    kwargs.update(_specials(defaults))
    for name, default in defaults.items():  # per-layer lists (layer types) follow the layers
        if isinstance(default, list) and name not in kwargs:
            for layers, old in defaults.items():
                new = kwargs.get(layers)
                if re.search(_LAYERS, layers) and isinstance(new, int) and len(default) == old:
                    kwargs[name] = default[:new]
                    break
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        kwargs["decoder_start_token_id"] = kwargs.get("pad_token_id", defaults.get("pad_token_id"))
    return kwargs


def tiny_config(model_type: str) -> PretrainedConfig:
    """The model type's config with every size attribute it has shrunk (see the module doc)."""
    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = cls().to_dict()
        except Exception as exc:  # a config that needs arguments
            raise CannotBuild(f"default config: {type(exc).__name__}: {exc}") from exc
    other = [k for k in _OTHER_MODALITIES if k in defaults]
    if other:
        raise CannotBuild(f"multimodal config ({other[0]}): the corpus is text-only")
    if not any(re.search(r"vocab_size$", k) for k in defaults):
        raise CannotBuild("no vocabulary in its config: not a text model")
    kwargs = _shrunk(defaults)
    for flag in ("output_router_logits",):  # MoE: train with the router's auxiliary loss
        if flag in defaults:
            kwargs[flag] = True
    if "use_cache" in defaults:
        kwargs["use_cache"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = cls(**kwargs)
        except Exception as exc:
            raise CannotBuild(f"tiny config: {type(exc).__name__}: {exc}") from exc
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    return config


def special_ids(config: PretrainedConfig) -> set[int]:
    """Every special token id the config names (kept out of the batches' text)."""
    out: set[int] = {0}
    for name, value in config.to_dict().items():
        if _SPECIAL.search(name):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    out.add(v)
    return out
