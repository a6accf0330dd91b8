"""Hugging Face ``config.json`` <-> :class:`zerojax.models.llama.LlamaConfig`'s fields, by
the family tables of :mod:`zerojax.models.hf.families`.

:func:`config_fields` reads a ``config.json`` by allow-list into the keyword arguments of
``LlamaConfig`` (what is not computed is refused, named, before any tensor is read);
:func:`config_to_hf` writes a config back as its family's ``config.json``.
``LlamaConfig.from_hf`` / ``to_hf`` are these two; this module imports nothing of the
model.
"""

from __future__ import annotations

import json
import os
import warnings

from zerojax.models.hf.families import (
    COMMON_KEYS,
    FAMILIES,
    IGNORED_KEYS,
    INERT_KEYS,
    NEEDED_KEYS,
)

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


class HFNotice(UserWarning):
    """What a checkpoint holds that ``transformers`` too ignores or drops, loaded
    anyway (a config key it never reads, a tied head's duplicate, old ``inv_freq``
    buffers): the loader's notices. ``zerojax finetune`` prints them as
    ``notice:`` lines."""


def notice(text: str, stacklevel: int = 3) -> None:
    warnings.warn(HFNotice(text), stacklevel=stacklevel)


def read_hf_config(hf) -> dict:
    """``hf`` itself if a dict, else the JSON of the file (or of ``config.json`` in the
    directory) it names."""
    if isinstance(hf, dict):
        return hf
    path = os.fspath(hf)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e.msg} at line {e.lineno} column "
                             f"{e.colno}; fix the file or download it again") from None


def ignored_keys(hf: dict) -> list[str]:
    """The keys of ``hf`` that transformers ignores (:data:`IGNORED_KEYS`), each with
    what it is: the notice :meth:`LlamaConfig.from_hf` gives."""
    return [f"{k}={hf[k]!r} ({IGNORED_KEYS[k]})" for k in hf if k in IGNORED_KEYS]


def rope(hf: dict, problems: list) -> tuple[float, tuple | None]:
    """``(rope_theta, llama3 scaling or None)`` of a config in either spelling:
    transformers 5's ``rope_parameters`` or 4.x's ``rope_theta`` + ``rope_scaling``;
    what is not computed goes to ``problems``, naming the key."""
    params, key = hf.get("rope_parameters"), "rope_parameters"
    if hf.get("rope_scaling") is not None:  # 4.x (5.x reads it first, as here)
        params, key = hf["rope_scaling"], "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        problems.append(f"{key}={params!r} (a dict of rope_type and its values)")
        return 10000.0, None
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        problems.append(f"{key}.rope_theta={theta!r} (a positive number)")
        theta = 10000.0
    factor = params.pop("partial_rotary_factor", 1.0)
    if factor != 1.0:
        problems.append(f"{key}.partial_rotary_factor={factor!r} (rotary embeddings on "
                        f"the whole head only)")
    if rope_type not in ROPE_TYPES:
        problems.append(f"{key}.rope_type={rope_type!r} (computed: "
                        f"{', '.join(ROPE_TYPES)})")
        return float(theta), None
    scaling = None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings",
                          hf.get("max_position_embeddings", 2048))
        lacking = [k for k in LLAMA3_KEYS if k not in params]
        if lacking:
            problems.append(f"{key} (rope_type 'llama3') lacks {', '.join(lacking)}")
        else:
            scaling = tuple(float(params.pop(k)) for k in LLAMA3_KEYS[:3]) + (
                int(params.pop("original_max_position_embeddings")),)
    for extra, value in params.items():
        problems.append(f"{key}.{extra}={value!r} (rope_type {rope_type!r} uses no such "
                        f"value)")
    return float(theta), scaling


def window(hf: dict, family: str, layers: int, problems: list) -> int | None:
    """The sliding attention window every layer uses (``None``: full causal), computed
    as transformers does, by the family's ``window`` rule: Mistral's ``sliding_window``
    (4096 when the key is absent), Qwen's only with ``use_sliding_window`` and for the
    layers ``layer_types`` (or ``max_window_layers``) marks ``sliding_attention``;
    Llama has none."""
    fam = FAMILIES[family]
    window = hf.get("sliding_window", fam.defaults["sliding_window"])
    if fam.window == "none":
        return None
    if fam.window == "qwen":
        if not hf.get("use_sliding_window", False):
            window = None
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(layers)]
        kinds = set(types)
        if not kinds <= {"full_attention", "sliding_attention"} or len(types) != layers:
            problems.append(f"layer_types={types!r} (one of 'full_attention', "
                            f"'sliding_attention' per layer)")
            return None
        if len(kinds) > 1:
            problems.append(f"layer_types / max_window_layers={hf.get('max_window_layers')} "
                            f"with use_sliding_window=True: sliding attention in some "
                            f"layers only (zerojax's decoder uses one window in every "
                            f"layer)")
            return None
        if kinds == {"full_attention"}:
            return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        problems.append(f"sliding_window={window!r} (null or an int >= 1)")
        return None
    return window


def _checks(hf: dict, family: str, problems: list) -> int | None:
    """The value checks of every family's keys; returns the head_dim (or None)."""
    fam = FAMILIES[family]
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"hidden_act={hf['hidden_act']!r} (SwiGLU with silu)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        problems.append(f"attention_dropout={hf['attention_dropout']!r} (zerojax's "
                        f"decoder has no dropout)")
    if hf.get("use_mrope", False):
        problems.append(f"use_mrope={hf['use_mrope']!r} (multimodal rotary "
                        f"embeddings)")
    head_dim = hf.get("head_dim", fam.defaults.get("head_dim"))
    for key, value in (("tie_word_embeddings", hf.get("tie_word_embeddings", False)),
                       ("attention_bias", hf.get("attention_bias", False)),
                       ("mlp_bias", hf.get("mlp_bias", False)),
                       ("use_sliding_window", hf.get("use_sliding_window", False))):
        if not isinstance(value, bool):
            problems.append(f"{key}={value!r} (true or false)")
    if head_dim is not None and (isinstance(head_dim, bool)
                                 or not isinstance(head_dim, int) or head_dim < 1):
        problems.append(f"head_dim={head_dim!r} (an int >= 1)")
        head_dim = None
    return head_dim


def _flag(hf: dict, key: str, default: bool, problems: list) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        problems.append(f"{key}={value!r} (true or false)")
        return default
    return value


def _count(hf: dict, key: str, default, problems: list, minimum: int = 1):
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{key}={value!r} (an int >= {minimum})")
        return None
    return value


def moe_fields(hf: dict, family: str, problems: list) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
    ``config.json`` (defaults: transformers' config classes'); every layer must be
    sparse (Qwen's ``decoder_sparse_step`` 1, no ``mlp_only_layers``); what is not
    computed goes to ``problems``, naming the key."""
    spelling = FAMILIES[family].moe
    if spelling is None:
        return {}
    if spelling == "mixtral":
        experts = _count(hf, "num_local_experts", 8, problems)
    else:
        keys = [k for k in ("num_experts", "num_local_experts") if k in hf]
        if len(keys) == 2 and hf["num_experts"] != hf["num_local_experts"]:
            problems.append(f"num_experts={hf['num_experts']!r} and num_local_experts="
                            f"{hf['num_local_experts']!r} (one count of experts)")
        default = {"qwen": 60 if family == "qwen2_moe" else 128, "olmoe": 64}[spelling]
        experts = _count(hf, keys[0] if keys else "num_experts", default, problems)
    default_k = {"mixtral": 2, "olmoe": 8}.get(spelling, 4 if family == "qwen2_moe" else 8)
    k = _count(hf, "num_experts_per_tok", default_k, problems)
    if experts is not None and k is not None and k > experts:
        problems.append(f"num_experts_per_tok={k} (more than the {experts} experts)")
    coef = hf.get("router_aux_loss_coef", 0.01 if spelling == "olmoe" else 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        problems.append(f"router_aux_loss_coef={coef!r} (a number >= 0)")
        coef = 0.0
    kw = dict(experts=experts or 1, experts_per_token=k or 1,
              router_aux_loss_coef=float(coef),
              router_aux_loss=_flag(hf, "output_router_logits", False, problems),
              norm_topk_prob=spelling == "mixtral" or _flag(hf, "norm_topk_prob", False,
                                                             problems),
              moe_hidden=hf["intermediate_size"])
    if hf.get("router_jitter_noise", 0.0) not in (0, 0.0):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r} (noise on the "
                        f"router's input while training; zerojax computes none)")
    if hf.get("clip_qkv") is not None:
        problems.append(f"clip_qkv={hf['clip_qkv']!r} (zerojax's decoder clamps no "
                        f"q/k/v)")
    if spelling == "qwen":
        kw["moe_hidden"] = _count(hf, "moe_intermediate_size", 1408 if family ==
                                  "qwen2_moe" else 768, problems) or 1
        if hf.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']!r} (dense "
                            f"layers between sparse ones; zerojax's scanned layers are "
                            f"all sparse: 1)")
        if hf.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={hf['mlp_only_layers']!r} (dense layers "
                            f"among sparse ones; zerojax's scanned layers are all "
                            f"sparse: [])")
    if family == "qwen2_moe":
        kw["shared_expert_hidden"] = _count(hf, "shared_expert_intermediate_size", 5632,
                                            problems) or 1
        kw["qkv_bias"] = _flag(hf, "qkv_bias", True, problems)
    return kw


def config_fields(hf, *, ignore_keys=(), owner: str = "LlamaConfig.from_hf") -> dict:
    """The ``LlamaConfig`` keyword arguments of a Hugging Face ``config.json`` (a dict,
    or the path of the file or of its directory), read by the family's table (see
    :meth:`zerojax.models.llama.LlamaConfig.from_hf`); ``ValueError`` naming each key
    that is not computed."""
    hf = read_hf_config(hf)
    if not isinstance(hf, dict):
        raise ValueError(f"{owner}: config.json holds {type(hf).__name__}, not an object")
    family = hf.get("model_type", "llama")
    if family not in FAMILIES:
        raise ValueError(f"{owner}: model_type={family!r} is not a family "
                         f"zerojax's decoder computes ({', '.join(FAMILIES)}); a model "
                         f"of another family needs its own module")
    fam = FAMILIES[family]
    lacking = [k for k in NEEDED_KEYS if k not in hf]
    if lacking:
        raise ValueError(f"{owner}: the config lacks {', '.join(lacking)}; "
                         f"pass a {fam.architecture} config.json (it has {sorted(hf)})")
    problems = []
    known = INERT_KEYS | COMMON_KEYS | fam.keys | set(IGNORED_KEYS) | set(ignore_keys)
    for key in hf:
        if key not in known:
            problems.append(f"{key}={hf[key]!r} (a key zerojax's {family} decoder does "
                            f"not compute; if it does not change the function, pass "
                            f"ignore_keys=({key!r},))")
    theta, llama3 = rope(hf, problems)
    head_dim = _checks(hf, family, problems)
    sliding = window(hf, family, hf["num_hidden_layers"], problems)
    moe = moe_fields(hf, family, problems)
    if problems:
        raise ValueError(f"{owner}: this {family} config has "
                         + "; ".join(problems) + ". zerojax's decoder does not compute "
                         "it; nothing was read")
    kw = dict(vocab=hf["vocab_size"], seq=hf.get("max_position_embeddings", 2048),
              layers=hf["num_hidden_layers"], hidden=hf["hidden_size"],
              heads=hf["num_attention_heads"],
              kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
              mlp_hidden=hf["intermediate_size"], rope_theta=theta,
              norm_eps=float(hf.get("rms_norm_eps", 1e-6)), family=family,
              head_dim=head_dim, rope_llama3=llama3, sliding_window=sliding,
              qkv_bias=False, attention_bias=False, mlp_bias=False, qk_norm=False,
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    for key, option in fam.read:
        kw[option] = bool(hf.get(key, False))
    kw.update(fam.options)
    kw.update(moe)
    return kw


def config_to_hf(config, torch_dtype: str = "float32") -> dict:
    """``config`` (a ``LlamaConfig``) as a ``config.json`` of its family (see
    :meth:`zerojax.models.llama.LlamaConfig.to_hf`)."""
    c = config
    fam = FAMILIES[c.family]
    out = {"architectures": [fam.architecture], "model_type": c.family,
           "vocab_size": c.vocab, "max_position_embeddings": c.seq,
           "num_hidden_layers": c.layers, "hidden_size": c.hidden,
           "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
           "head_dim": c.head_dim, "intermediate_size": c.mlp_hidden,
           "rope_theta": c.rope_theta, "rms_norm_eps": c.norm_eps,
           "hidden_act": "silu", "tie_word_embeddings": c.tie_embeddings,
           "rope_scaling": None if c.rope_llama3 is None else dict(
               zip(("rope_type",) + LLAMA3_KEYS, ("llama3",) + c.rope_llama3)),
           "initializer_range": INIT_STD, "torch_dtype": torch_dtype}
    if bool(fam.moe) != bool(c.experts) or (fam.moe is None and c.qk_norm_whole):
        raise ValueError(f"LlamaConfig.to_hf: family={c.family!r} ({fam.architecture}) "
                         f"{'has' if fam.moe else 'has no'} experts, the config experts="
                         f"{c.experts}; pick a family whose config.json says the "
                         f"config's MLP (mixtral, qwen2_moe, qwen3_moe, olmoe for "
                         f"experts)")
    if not fam.fits(c):
        raise ValueError(f"LlamaConfig.to_hf: family={c.family!r} ({fam.architecture}) "
                         f"cannot say qkv_bias={c.qkv_bias}, attention_bias="
                         f"{c.attention_bias}, mlp_bias={c.mlp_bias}, qk_norm="
                         f"{c.qk_norm}, sliding_window={c.sliding_window}; pick "
                         f"the family whose config.json has them")
    out.update(fam.writes(c))
    return out
