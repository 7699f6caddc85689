"""`--init-from DIR`: a new run that starts from another model's weights (a warm start;
docs/recipes.md). DIR is a Hugging Face model directory (an `app export`, a downloaded model) or a
run directory of `app train` (its latest checkpoint, read as `app export` reads it:
app.checkpoint.weights).

app/settle.py checks the source against the run before any process group (`read_init_config`,
`check_init_config`); app/build.py copies its weights into the freshly built model
(`load_init_weights`). A module of its own, above the model and the checkpoints: the model module
builds models and knows no run directory, and reading a run's weights is the checkpoints' job.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, PretrainedConfig

from app.checkpoint.weights import (
    check_export,
    check_tag,
    config_from_run,
    latest_of,
    run_weights,
)
from app.models.presets import objective_of
from app.rundir import is_run_dir
from data_tools.errors import UserError

# Config fields that fix the shapes of the weights: an --init-from source must agree on them
_GEOMETRY = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "type_vocab_size", "head_dim",
             "layer_types", "global_attn_every_n_layers")


def read_init_config(directory: Path) -> PretrainedConfig:
    """The config of an --init-from directory (a Hugging Face model directory: an `app export`,
    a downloaded model; or a run directory of `app train`); UserError when there is none."""
    if is_run_dir(directory):
        return config_from_run(directory)
    if not (directory / "config.json").is_file():
        raise UserError(f"--init-from {directory}: no config.json (expected a Hugging Face model "
                        f"directory, e.g. one written by `app export`)")
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - transformers' many ways to reject a config
        raise UserError(f"--init-from {directory}: config.json is not a usable model config "
                        f"({(str(e).strip().splitlines() or [type(e).__name__])[-1]})") from None


def check_init_config(config: PretrainedConfig, source: PretrainedConfig, vocab_size: int,
                      directory: Path, preset_name: str) -> None:
    """UserError unless `source` has this run's architecture, geometry and vocabulary (the
    dataset tokenizer's size; the run's tensor-core padding rows are not in an export)."""
    where = f"--init-from {directory}"
    if type(source) is not type(config):
        raise UserError(f"{where}: a {source.model_type} model; --model {preset_name} is "
                        f"{config.model_type} (choose a preset of the source's architecture)")
    for name in _GEOMETRY:
        want, got = getattr(config, name, None), getattr(source, name, None)
        if want is not None and got is not None and want != got:
            raise UserError(f"{where}: its {name} is {got!r}, --model {preset_name}'s {want!r} "
                            f"(set it with --model-arg {name}=..., or choose another preset)")
    if int(source.vocab_size) not in (vocab_size, int(config.vocab_size)):
        raise UserError(f"{where}: a vocabulary of {source.vocab_size} tokens; the dataset's "
                        f"tokenizer has {vocab_size} (the model must come with the dataset's "
                        f"tokenizer)")


def check_source(directory: Path) -> None:
    """The --init-from source verified as every reader of a checkpoint or an export verifies it
    (app/checkpoint/weights.py): a run directory's latest tag against its manifest, a model
    directory's files against its manifest and their structure; before any process group."""
    if is_run_dir(directory):
        check_tag(Path.joinpath(*latest_of(directory)))
    else:
        check_export(directory, "--init-from")


def _init_weights(directory: Path, objective: str) -> dict[str, torch.Tensor]:
    """The weights of an --init-from directory: a run directory's latest checkpoint (as
    `app export` takes it), or a Hugging Face model directory loaded as the objective's model."""
    if is_run_dir(directory):
        return run_weights(*latest_of(directory))  # verified (weights.check_tag)
    check_source(directory)
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    try:
        return auto.from_pretrained(directory, dtype=torch.float32).state_dict()
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, safetensors' own error
        raise UserError(f"--init-from {directory}: weights not loadable "
                        f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]})") \
            from None


# The LM head's bias on vocabulary rows an --init-from source lacks: exp(-1e4) is 0 in every
# precision, so the warm start's loss is the source's over its own vocabulary.
PADDING_ROW_BIAS = -1e4


def load_init_weights(model: torch.nn.Module, directory: Path) -> None:
    """Copy the weights of the model in `directory` into `model` (fp32, in place; checked
    compatible by check_init_config). The source's vocabulary may lack the run's tensor-core
    padding rows (never a target): they get no probability (PADDING_ROW_BIAS)."""
    source = _init_weights(directory, objective_of(model.config))
    own = model.state_dict()
    missing = [k for k in own if k not in source]
    if missing:
        raise UserError(f"--init-from {directory}: weights do not fit the model (missing "
                        f"{missing[:3]})")
    with torch.no_grad():
        for name, tensor in own.items():
            got = source[name]
            rows = min(got.shape[0], tensor.shape[0]) if got.dim() else 0
            if got.shape == tensor.shape:
                tensor.copy_(got)
            elif got.shape[1:] == tensor.shape[1:]:  # the vocabulary's padding rows
                tensor[:rows].copy_(got[:rows])
                # no probability on them, as in the source (which has no such rows): zero
                # vectors, and a head's bias far below every real token's
                tensor[rows:] = 0.0 if tensor.dim() > 1 else PADDING_ROW_BIAS
            else:
                raise UserError(f"--init-from {directory}: {name} is {tuple(got.shape)}, the "
                                f"model's {tuple(tensor.shape)}")
