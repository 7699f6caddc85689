"""`build_model`: the model of a config, freshly initialised with random weights (the training
heads where it trains, partitioned under ZeRO-3), a skeleton's optimizer-group names, and the
count of a built model's parameters.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PretrainedConfig,
    PreTrainedModel,
)

from app.flex import FLEX, FLEX_CAUSAL
from app.models.attention import CAUSAL_SDPA
from app.models.heads import SPARSE_HEADS, CausalLossGPT2LMHeadModel, LossHead
from app.models.presets import config_from_dict, objective_of
from app.runtime.param_groups import group_names
from app.runtime.zero3_init import partitioned
from data_tools.errors import UserError


def build_model(config: PretrainedConfig, *, gradient_checkpointing: bool = False,
                seed: int | None = None, for_training: bool = False,
                zero3_config: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """A freshly initialised model for the config's objective (same seed, same weights).

    `for_training`: the MLM head takes the loader's masked positions (SparseHeadBertForMaskedLM);
    GPT-2 computes its loss in chunks, without a cache or a host read
    (CausalLossGPT2LMHeadModel); and the model skips transformers' per-forward look for padding
    in inputs given without an attention mask (a host sync each step; the loader hands over a
    mask whenever it pads).
    `zero3_config`: a ZeRO-3 DeepSpeed config; the model is then built partitioned
    (`deepspeed.zero.Init`, in a process group): no rank ever holds all of it, and its weights
    are the same as an unpartitioned build's (app.runtime.zero3_init). A warm start
    (`--init-from`) loads its weights into the built model: app.init_from.
    """
    if seed is not None:
        torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if objective_of(config) == "mlm" else AutoModelForCausalLM
    with partitioned(zero3_config):
        model = _instantiate(config, auto, for_training)
    if for_training:
        for part in model.modules():  # the base model (GPT2Model, ...) is the one that looks
            if isinstance(part, PreTrainedModel):
                part.warn_if_padding_and_no_attention_mask = _no_padding_check
    if gradient_checkpointing:
        # use_reentrant=False: works with ZeRO-3's partitioned parameters and frozen inputs
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _instantiate(config: PretrainedConfig, auto, for_training: bool) -> torch.nn.Module:
    gpt2 = for_training and config.model_type == "gpt2"
    if gpt2:  # its own attention name below: the caller's config (an export's) stays as it is
        config = copy.deepcopy(config)
    try:
        model = auto.from_config(config, attn_implementation=config._attn_implementation)
        if for_training and config.model_type in SPARSE_HEADS:
            # the same module with the sparse forward: built as the plain class, so the same
            # seed gives the same weights (ModernBERT's init skips a subclass's head)
            model.__class__ = SPARSE_HEADS[config.model_type]
        if gpt2:  # the chunked loss, no cache, no mask where SDPA needs none; same weights
            model.__class__, model.lm_head.__class__ = CausalLossGPT2LMHeadModel, LossHead
            if config._attn_implementation == "sdpa":
                model.config._attn_implementation = CAUSAL_SDPA
            elif config._attn_implementation == FLEX:
                model.config._attn_implementation = FLEX_CAUSAL
    except (ImportError, ValueError) as e:  # e.g. flash_attention_2 without its package
        raise UserError(f"--attn {config._attn_implementation}: {e}".splitlines()[0]) from None
    return model


def _no_padding_check(input_ids, attention_mask) -> None:
    """See build_model: the loader never pads without handing over an attention mask."""


def skeleton_group_names(model_config: Mapping[str, Any]) -> list[list[str]]:
    """`group_names` (app.runtime.param_groups) of the training model of `model_config` (the
    dict a train state saves), in two groups, from a skeleton on the meta device (no memory, no
    init): the names of a checkpoint written before train states recorded them (universal.read's
    `names_for`)."""
    with torch.device("meta"):
        model = build_model(config_from_dict(model_config), for_training=True)
    return group_names(model)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights once)."""
    return sum(getattr(p, "ds_numel", p.numel())  # ZeRO-3: the whole, not this rank's shard
               for p in {id(p): p for p in model.parameters()}.values())
