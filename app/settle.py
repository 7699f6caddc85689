"""The plan of a run: everything `app train` settles and checks before any process group
starts (the datasets, the model config, the DeepSpeed config with every "auto" filled, the LR
schedule, the checkpoint to resume and its layout), so bad input fails fast, on every rank, with
one line. Nothing here writes: app/build.py acts on the plan.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from app import rundir
from app.checkpoint import store as checkpoint
from app.checkpoint import tags
from app.checkpoint.train_state import ONE_DOCUMENT_A_SAMPLE, phase_position
from app.checkpoint.universal import (
    Layout,
    convertible_into,
    is_universal,
    layout_of,
    optimizer_switch,
    saved_layout,
)
from app.config import TrainConfig
from app.data.sources import Source, Sources, read_sources
from app.init_from import check_init_config, check_source, read_init_config
from app.models.attention import check_packed_attention
from app.models.presets import (
    attention_dropout,
    build_config,
    max_positions,
    parse_overrides,
    preset,
)
from app.runtime.device import Device, attention_implementation, choose_attention
from app.runtime.dist import World
from app.runtime.ds_config import (
    fill_auto,
    load_ds_config,
    settle_precision,
    validate_ds_config,
    zero_config_path,
    zero_stage,
)
from app.schedule import schedule_fn
from app.telemetry.sinks import check_wandb, wandb_settings
from data_tools.errors import Stopped, UserError
from data_tools.manifest import MANIFEST, TOKENIZER_DIR, tokenizer_fingerprint
from data_tools.schema import read_regular


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything settled before the process group starts (so bad input fails fast everywhere).
    The batch sizes are in `ds_config`: the engine reads them from there and owns them."""

    cfg: TrainConfig
    device: Device
    world: World
    sources: Sources
    """The dataset, or the datasets of a mixture, checked (app/data/sources.py)."""
    manifest: dict[str, Any]
    """The (first) dataset's manifest: vocabulary and special ids, shared by a mixture."""
    model_config: Any
    objective: str
    ds_config: dict[str, Any]
    """The DeepSpeed config with every "auto" filled."""
    ds_path: Path
    precision: str
    total_steps: int
    warmup_steps: int
    lr_lambda: Callable[[int], float]
    """The LR schedule, a multiplier of the peak LR per optimizer step."""
    train_samples: tuple[int, ...]
    """Each dataset's train samples (an epoch)."""
    eval_sources: tuple[int, ...]
    """The datasets with a val split to evaluate on."""
    resume: tuple[Path, str] | None
    """(checkpoint dir, tag) to resume from."""
    switch: Switch
    """The checkpoint's layout against this run's, and the run's layout history."""
    init_from: Path | None = None
    """A new run's starting weights (--init-from; None when resuming: the checkpoint has them)."""
    attention: tuple[str, str] = ("sdpa", "")
    """(the attention implementation, why it was chosen): the start-up line and config.json."""
    attention_span: float | None = None
    """The tokens a real token attends to, over the mixture's shares (the loader's
    `attention_span`): MFU's attention FLOPs (app.telemetry.flops)."""
    island_ranks: int = 0
    """--dp-mode diloco: ranks an island (DeepSpeed's data-parallel world); 0: synchronous."""


def plan_run(cfg: TrainConfig, device: Device, world: World) -> Plan:
    """Settle and check the run (prints the start-up data lines on the main rank)."""
    if world.is_main:  # only rank 0 logs to wandb: refused here, before the run dir exists
        check_wandb(wandb_settings(cfg))
    sources = read_sources(cfg.data)
    for source in sources.items:
        check_tokenizer_copy(source.path, source.manifest)
    manifest = sources.manifest
    ds_path, raw_ds, precision = settle_deepspeed(cfg, device, world.is_main)
    objective, model_config = settle_model(cfg, manifest, device, precision)
    attention = choose_attention(cfg.attn, device, precision, cfg.packing,  # probed once
                                 attention_dropout(model_config))
    stats, eval_sources = settle_data(cfg, sources, objective, world.is_main)
    micro, accum, gbs = batch_geometry(cfg, world.world_size)
    island_ranks = settle_islands(cfg, world, raw_ds, precision)
    resume = settle_resume(cfg, sources, model_config, objective, world.is_main)
    phase = settle_phase(cfg, resume, gbs, stats, world.is_main)
    total_steps, warmup, lr_lambda = settle_schedule(cfg, gbs, phase,
                                                     real_per_sample(sources, stats))
    # DeepSpeed's batch is an island's in a low-communication run (its data-parallel world)
    ds = fill_auto(raw_ds, micro_batch=micro, grad_accum=accum,
                   world_size=island_ranks or world.world_size,
                   precision=precision, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                   weight_decay=cfg.weight_decay, pin_memory=device.pin_memory, where=ds_path,
                   torch_adam=device.torch_adam, hidden_size=model_config.hidden_size,
                   grad_comm_dtype=cfg.grad_comm_dtype, torch_adam_fused=device.torch_adam_fused)
    for warning in validate_ds_config(ds, ds_path):
        if world.is_main:
            print(f"warning: {warning}", file=sys.stderr)
    check_steps_left(resume, total_steps, cfg)
    switch = settle_switch(resume, ds, world, gbs, phase, island_ranks)
    settle_dp_resume(cfg, resume, island_ranks, world, switch)
    init_from = settle_init(cfg, model_config, sources, resume, ds, world.is_main)
    if world.is_main:  # the start-up lines, once every check has passed
        print(f"attention: {attention[0]} ({attention[1]})", file=sys.stderr)
        print_data(sources, stats, cfg.seq_len, gbs, total_steps)
    return Plan(cfg=cfg, device=device, world=world, sources=sources, manifest=manifest,
                model_config=model_config, objective=objective, ds_config=ds, ds_path=ds_path,
                precision=precision, total_steps=total_steps, warmup_steps=warmup,
                lr_lambda=lr_lambda,
                train_samples=tuple(st["num_samples"] for st in stats),
                eval_sources=eval_sources, resume=resume, switch=switch, init_from=init_from,
                attention=attention, attention_span=attention_span(sources, stats),
                island_ranks=island_ranks)


def settle_islands(cfg: TrainConfig, world: World, ds: dict[str, Any], precision: str) -> int:
    """--dp-mode diloco: the ranks an island (--island-ranks, default a node's), checked
    against the world and the DeepSpeed config; 0 for synchronous data parallelism. The
    resolved size is written back into the config (config.json records what ran)."""
    if cfg.dp_mode != "diloco":
        return 0
    size = cfg.island_ranks or world.local_world_size
    where = "--island-ranks" if cfg.island_ranks else "--dp-mode diloco (an island a node)"
    if world.world_size % size:
        raise UserError(f"{where}: {size} rank(s) an island do not divide the "
                        f"{world.world_size} ranks of this job")
    if world.world_size // size < 2:
        raise UserError(f"{where}: {world.world_size} rank(s) make one island of {size}; "
                        f"--dp-mode diloco needs two islands or more (--island-ranks N with N a "
                        f"divisor of the world below it)")
    zero = ds.get("zero_optimization") or {}
    offloaded = any((zero.get(k) or {}).get("device") in ("cpu", "nvme")
                    for k in ("offload_optimizer", "offload_param"))
    if zero_stage(ds) == 3 or offloaded or precision == "fp16":
        raise UserError(f"--dp-mode diloco runs at ZeRO 0-2 in fp32 or bf16 without offload "
                        f"(this run: ZeRO-{zero_stage(ds)}, {precision}"
                        f"{', offloaded' if offloaded else ''})")
    cfg.island_ranks = size
    return size


def settle_dp_resume(cfg: TrainConfig, resume: tuple[Path, str] | None, island_ranks: int,
                     world: World, switch: Switch) -> None:
    """A resume that changes the data-parallel mode or the islands: converted (synchronous ->
    diloco: the islands start a round from the checkpoint's weights) or refused in one line."""
    if resume is None:
        return
    state = tags.read_state(*resume)
    saved = (state.get("run_config") or {})
    saved_mode = saved.get("dp_mode", "sync")
    tag_dir = resume[0] / resume[1]
    if saved_mode == "diloco" and cfg.dp_mode != "diloco":
        raise UserError(f"{tag_dir}: written by a --dp-mode diloco run (each island's state "
                        f"kept apart); a synchronous run cannot resume it: export it "
                        f"(app export) and start from the export (--init-from)")
    if saved_mode != "diloco" and cfg.dp_mode == "diloco":
        if world.is_main:
            print(f"resume: {tag_dir} is a synchronous run's; the islands start a round from "
                  f"its weights (outer momentum zero)", file=sys.stderr)
        return
    if saved_mode == "diloco":
        was = (int(saved.get("island_ranks") or 0), int(state.get("islands") or 0))
        now = (island_ranks, world.world_size // max(island_ranks, 1))
        if was != now:
            raise UserError(f"{tag_dir}: written by {was[1]} islands of {was[0]} rank(s); this "
                            f"run has {now[1]} of {now[0]} (each island's optimizer state is its "
                            f"own: the same islands resume it)")
        if switch.convert:
            raise UserError(f"{tag_dir}: written by islands at {switch.saved}; this run is "
                            f"{switch.now}: a low-communication checkpoint resumes in the layout "
                            f"it was written in")
        if world.is_main and int(saved.get("outer_every") or 0) != cfg.outer_every:
            print(f"resume: --outer-every {cfg.outer_every} (the checkpoint's run synced every "
                  f"{saved.get('outer_every')}): the next sync is at the next multiple of "
                  f"{cfg.outer_every}", file=sys.stderr)


def print_data(sources: Sources, stats: list[dict[str, Any]], seq_len: int, gbs: int,
               total_steps: int) -> None:
    """The start-up data lines: samples, tokens, epochs over the run (per source of a mix)."""
    samples = total_steps * gbs
    if sources.is_mixture:
        for source, share, st in zip(sources.items, sources.mixture.fractions, stats):
            print(f"data: {source.name} ({source.path}), weight {share:.3f}: "
                  f"{st['num_samples']:,} train samples ({st['tokens']:,} tokens); "
                  f"{samples * share / st['num_samples']:.2f} epochs over the run",
                  file=sys.stderr)
        print(f"data: a mixture of {len(stats)} datasets; {gbs} samples = {gbs * seq_len:,} "
              f"tokens per step", file=sys.stderr)
        return
    st = stats[0]
    print(f"data: {st['num_samples']:,} train samples of {seq_len} tokens "
          f"({st['tokens']:,} tokens); {gbs} samples = {gbs * seq_len:,} tokens per "
          f"step; {total_steps} steps = {samples / st['num_samples']:.2f} epochs",
          file=sys.stderr)


def settle_deepspeed(cfg: TrainConfig, device: Device,
                     is_main: bool) -> tuple[Path, dict[str, Any], str]:
    """(ds_config path, its contents, precision). Without --zero or --ds-config: ZeRO-0, or
    ZeRO-1 for bf16, where DeepSpeed accumulates and all-reduces gradients in fp32 (at ZeRO-0 it
    refuses fp32 accumulation with bf16 weights: gradients would be summed in bf16)."""
    ds_path = cfg.ds_config or zero_config_path(cfg.zero or 0)
    raw_ds = load_ds_config(ds_path)
    precision = settle_precision(raw_ds, cfg.precision, device, ds_path)
    if precision == "bf16" and zero_stage(raw_ds) == 0:
        if cfg.zero is None and cfg.ds_config is None:
            ds_path = zero_config_path(1)
            raw_ds = load_ds_config(ds_path)
        elif is_main:
            print("warning: bf16 at ZeRO-0 accumulates gradients in bf16; DeepSpeed allows "
                  "fp32 accumulation from ZeRO-1 on (--zero 1: optimizer states sharded, the "
                  "parameters all-gathered after each step)", file=sys.stderr)
    return ds_path, raw_ds, precision


def settle_model(cfg: TrainConfig, manifest: dict[str, Any], device: Device,
                 precision: str) -> tuple[str, Any]:
    """(objective, model config): the preset with the dataset's vocabulary and special ids."""
    p = preset(cfg.model_name)
    objective = cfg.objective or p.objective
    if objective != p.objective:
        raise UserError(f"--objective {objective}: preset {cfg.model_name} is "
                        f"{'an encoder (mlm)' if p.objective == 'mlm' else 'a decoder (clm)'}")
    eod = manifest["eod_token_id"]
    special = {"pad_token_id": manifest.get("pad_token_id")}
    # the encoder families' [CLS]/[SEP] fields (app.models.presets.Preset.ids)
    if objective == "mlm":
        special.update(cls_token_id=manifest.get("cls_token_id"), sep_token_id=eod)
    if objective == "clm":
        special.update(bos_token_id=manifest.get("bos_token_id", eod), eos_token_id=eod)
    attn = attention_implementation(cfg.attn, device, precision, cfg.packing)
    model_config = build_config(cfg.model_name, vocab_size=int(manifest["vocab_size"]),
                                special_ids=special, overrides=parse_overrides(cfg.model_arg),
                                dropout=cfg.dropout, attn_implementation=attn,
                                pad_vocab_to=cfg.pad_vocab_to)
    if cfg.packing == "doc-packed":
        check_packed_attention(model_config)
    if cfg.seq_len > max_positions(model_config):
        raise UserError(f"--seq-len {cfg.seq_len}: above the {max_positions(model_config)} "
                        f"positions of {cfg.model_name} (raise it with --model-arg)")
    return objective, model_config


def settle_data(cfg: TrainConfig, sources: Sources, objective: str,
                is_main: bool) -> tuple[list[dict[str, Any]], tuple[int, ...]]:
    """(each dataset's train split figures, the datasets with a val split to evaluate on), from
    dataset.json."""
    from app.data.loader import DataSpec, dataset_stats  # the data side (loaders) of the app

    def stats(source: Source, split: str) -> dict[str, Any]:
        return dataset_stats(DataSpec(source.path, split, cfg.seq_len, objective, cfg.packing,
                                      cfg.seed, cfg.mask_prob), source.manifest)

    train, with_eval = [], []
    for i, source in enumerate(sources.items):
        check_learnable(cfg, objective, source.manifest, source.path)
        train.append(stats(source, "train"))
        splits = source.manifest["splits"]
        if "val" not in splits or not splits["val"]["shards"]:
            continue
        try:
            stats(source, "val")
            with_eval.append(i)
        except UserError as e:
            if is_main:
                print(f"no evaluation{f' of {source.name}' if sources.is_mixture else ''}: {e}",
                      file=sys.stderr)
    return train, tuple(with_eval)


@dataclass(frozen=True)
class Phase:
    """A resume that changed --seq-len: where the run was (docs/recipes.md)."""

    step: int
    tokens_seen: int
    real_tokens_seen: int | None
    """The checkpoint's (TrainState.real_tokens_seen): what --max-tokens has used up (None in
    a checkpoint from before the counter)."""
    old_seq_len: int
    consumed_samples: int
    """The checkpoint's stream position, in samples of `old_seq_len` tokens."""
    position: int
    """Where the run continues in the stream of this run's samples (phase_position)."""


def settle_phase(cfg: TrainConfig, resume: tuple[Path, str] | None, global_batch: int,
                 stats: list[dict[str, Any]], is_main: bool) -> Phase | None:
    """The sequence-length phase a resume starts (None when --seq-len is the checkpoint's), and
    the start-up line saying which samples it starts from."""
    if resume is None:
        return None
    state = tags.read_state(*resume)
    old = int((state.get("run_config") or {}).get("seq_len") or cfg.seq_len)
    if old == cfg.seq_len:
        return None
    consumed = int(state["consumed_samples"])
    position = phase_position(consumed, old_seq_len=old, new_seq_len=cfg.seq_len,
                              packing=cfg.packing, global_batch=global_batch)
    real = state.get("real_tokens_seen")
    phase = Phase(int(state["step"]), int(state["tokens_seen"]),
                  None if real is None else int(real), old, consumed, position)
    if is_main:
        print(phase_line(phase, cfg, global_batch, stats), file=sys.stderr)
    return phase


def phase_line(phase: Phase, cfg: TrainConfig, global_batch: int,
               stats: list[dict[str, Any]]) -> str:
    """The start-up line of a sequence-length phase: where the run was, which samples it takes
    next, and what carries over."""
    how = ("one document a sample: the same position" if cfg.packing in ONE_DOCUMENT_A_SAMPLE
           else f"the same {phase.consumed_samples * phase.old_seq_len:,} window tokens into "
                f"the stream, to a whole global batch")
    where = ""
    if len(stats) == 1:
        n = int(stats[0]["num_samples"])
        where = (f", epoch {phase.position // n}, entries {phase.position % n:,}.. of its "
                 f"permutation of {n:,} samples")
    return (f"phase: --seq-len {phase.old_seq_len} -> {cfg.seq_len} at step {phase.step}: "
            f"sample {phase.consumed_samples:,} of the {phase.old_seq_len}-token stream maps to "
            f"sample {phase.position:,} of the {cfg.seq_len}-token stream ({how}); step "
            f"{phase.step + 1} trains global batch {phase.position // global_batch:,} (samples "
            f"{phase.position:,}-{phase.position + global_batch - 1:,}{where}); the step count, "
            f"LR schedule and tokens seen ({phase.tokens_seen:,}) continue")


def real_per_sample(sources: Sources, stats: list[dict[str, Any]]) -> float:
    """The mean real (not padding) tokens of a train sample, over the mixture's shares."""
    shares = sources.mixture.fractions if sources.is_mixture else [1.0]
    return sum(w * st["real_tokens_per_sample"] for w, st in zip(shares, stats))


def attention_span(sources: Sources, stats: list[dict[str, Any]]) -> float:
    """The tokens a real token attends to (dataset_stats' `attention_span`), over the real
    tokens the mixture's shares draw from each source."""
    shares = sources.mixture.fractions if sources.is_mixture else [1.0]
    real = [w * st["real_tokens_per_sample"] for w, st in zip(shares, stats)]
    return sum(r * st["attention_span"] for r, st in zip(real, stats)) / max(sum(real), 1e-9)


def real_seen(phase: Phase, per_sample: float, seq_len: int) -> float:
    """The real tokens a phase's checkpoint had trained on; from a checkpoint without the count,
    its window tokens at this phase's real share."""
    if phase.real_tokens_seen is not None:
        return phase.real_tokens_seen
    return phase.tokens_seen * per_sample / seq_len


def settle_schedule(cfg: TrainConfig, global_batch: int, phase: Phase | None = None,
                    real_tokens_per_sample: float | None = None) -> tuple[int, int, Callable]:
    """(total steps, warmup steps, LR schedule): --max-steps, capped by --max-tokens, in real
    tokens (a sample holds `real_tokens_per_sample` on average, seq_len without padding); after
    a sequence-length phase: the steps done, then the tokens left (the budget minus the real
    tokens seen) at this phase's real tokens a step."""
    total_steps = cfg.max_steps
    per_sample = real_tokens_per_sample or cfg.seq_len
    if cfg.max_tokens is not None:
        per_step = global_batch * per_sample
        total_steps = min(total_steps, math.ceil(cfg.max_tokens / per_step) if phase is None
                          else phase.step + math.ceil(
                              max(cfg.max_tokens - real_seen(phase, per_sample, cfg.seq_len), 0)
                              / per_step))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, total_steps // 20)
    return total_steps, warmup, schedule_fn(warmup_steps=warmup, total_steps=total_steps,
                                            decay=cfg.lr_decay, min_lr_ratio=cfg.min_lr_ratio,
                                            decay_fraction=cfg.decay_fraction,
                                            decay_shape=cfg.decay_shape)


def settle_resume(cfg: TrainConfig, sources: Sources, model_config, objective: str,
                  is_main: bool = True) -> tuple[Path, str] | None:
    """The checkpoint to resume from, checked against this run (or None); its files are
    verified against its manifest (each rank reads them: the same decision everywhere)."""
    notes: list[str] = []
    resume = check_run_dir(cfg, sources, notes, is_main)
    for note in notes if is_main else ():
        print(note, file=sys.stderr)
    if resume is None:
        return None
    where = resume[0] / resume[1]
    state = tags.read_state(*resume)
    sources.check_resume(state.get("mixture"), where)
    checkpoint.check_resumable(state, fingerprint=sources.fingerprint,
                               model_config=model_config.to_dict(),
                               sample_layout=sample_layout(cfg, objective), where=where)
    if not tags.check_files(where) and is_main and not is_universal(where):
        print(tags.unverified_note(where), file=sys.stderr)
    for note in settle_changes(cfg, state, where) if is_main else ():
        print(note, file=sys.stderr)
    return resume


# The resume contract (docs/design.md, "Faults"): what a resume may change, and how.
# The LR schedule is a pure function of the step: this run's, from its first step (the engine's
# base LRs are this run's --lr, app.checkpoint.store.load; the groups' LRs are set from the
# schedule once the train state is loaded, app/build.py).
SCHEDULE_SETTINGS = ("lr", "warmup_steps", "lr_decay", "min_lr_ratio", "decay_fraction",
                     "decay_shape")
# The optimizer's own settings: the checkpoint's optimizer state carries them (torch's
# load_state_dict puts them back), so a new value would be recorded and not run: refused.
OPTIMIZER_SETTINGS = ("weight_decay", "beta1", "beta2", "eps")


def settle_changes(cfg: TrainConfig, state: dict[str, Any], where: Path) -> list[str]:
    """A resume's settings against its checkpoint's run: a changed LR schedule setting is
    applied from the first step and said (the lines returned); a changed optimizer setting is
    refused in one line, so config.json never records a value that did not run."""
    saved, now = state.get("run_config") or {}, cfg.to_dict()
    for key in OPTIMIZER_SETTINGS:
        if key in saved and saved[key] != now[key]:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{where}: {flag} was {saved[key]!r} and is {now[key]!r} now: the "
                            f"optimizer's state resumes with its own {key}; resume with {flag} "
                            f"{saved[key]}, or start a new run from these weights (--init-from)")
    return [f"resume: --{key.replace('_', '-')} {now[key]} (the checkpoint's run: {saved[key]}): "
            f"applied from step {int(state['step']) + 1}"
            for key in SCHEDULE_SETTINGS if key in saved and saved[key] != now[key]]


def settle_init(cfg: TrainConfig, model_config, sources: Sources, resume: tuple[Path, str] | None,
                ds: dict[str, Any], is_main: bool) -> Path | None:
    """--init-from checked against this run (architecture, geometry, vocabulary and tokenizer):
    the directory to take the starting weights from, or None (no --init-from, or a resume)."""
    if cfg.init_from is None:
        return None
    where = cfg.init_from
    if resume is not None:
        if is_main:
            print(f"--init-from {where}: not used, the run continues from its checkpoint "
                  f"{resume[0] / resume[1]}", file=sys.stderr)
        return None
    if not where.is_dir():
        raise UserError(f"--init-from {where}: no such directory")
    if zero_stage(ds) == 3:
        raise UserError(f"--init-from {where}: not at ZeRO-3 (its model is built partitioned); "
                        f"start at --zero 2 or lower, a resume may then switch to ZeRO-3")
    vocab = int(sources.manifest["vocab_size"])
    source = read_init_config(where)
    check_source(where)  # its files verified, as `app export` verifies a tag
    check_init_config(model_config, source, vocab, where, cfg.model_name)
    same = check_init_tokenizer(where, sources.items[0])
    if is_main:
        tag = (f" checkpoint {tags.latest_tag(where / rundir.CHECKPOINTS)}"
               if rundir.is_run_dir(where) else "")
        print(f"init: weights from {where}{tag} ({source.model_type}, {source.vocab_size} tokens; "
              f"{'the same tokenizer' if same else 'no tokenizer there: vocabulary size checked'}"
              f"); a new run: step 1, fresh optimizer, LR schedule and data order",
              file=sys.stderr)
    return where


def check_init_tokenizer(where: Path, source: Source) -> bool:
    """The --init-from directory's tokenizer must map tokens to the ids the dataset holds (the
    same vocabulary, token by token). False when it has none to compare (only config.json and
    weights): the vocabulary size was checked."""
    from tokenizers import Tokenizer

    mine = source.path / source.manifest["tokenizer"].get("dir", TOKENIZER_DIR) / "tokenizer.json"
    theirs = (where / rundir.TOKENIZER_DIR if rundir.is_run_dir(where) else where) \
        / "tokenizer.json"
    if not theirs.is_file():
        return False
    try:
        vocab = Tokenizer.from_file(str(theirs)).get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the Rust parser's errors: a corrupt file
        raise UserError(f"{theirs}: not a tokenizer ({str(e).splitlines()[0][:80]})") from None
    ours = Tokenizer.from_file(str(mine)).get_vocab(with_added_tokens=True)
    if vocab != ours:
        other = sorted(set(vocab.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:1]
        raise UserError(f"--init-from {where}: its tokenizer is not the dataset's ({mine}): "
                        f"token ids differ (e.g. {other[0][0]!r} -> {other[0][1]}); a warm start "
                        f"needs the data tokenized with the model's tokenizer")
    return True


def check_steps_left(resume: tuple[Path, str] | None, total_steps: int, cfg: TrainConfig) -> None:
    """Refuse a resume whose checkpoint is past the run's last step: training would do nothing
    and summary.json would be rewritten with 0 tokens/s."""
    if resume is None:
        return
    step = int(tags.read_state(*resume)["step"])
    limit = (f"--max-steps {cfg.max_steps}" if total_steps == cfg.max_steps
             else f"--max-tokens {cfg.max_tokens} ({total_steps} steps)")
    if step == total_steps and finished(cfg.out, resume, step):
        # a finished run's command again: its record stays as it is (no summary of 0 tokens/s)
        raise Stopped(f"{cfg.out}: the run finished at step {step} ({limit}): nothing left to "
                      f"train, nothing was changed (raise {limit.split()[0]} to train on)", 0)
    if step <= total_steps:
        return
    raise UserError(f"{resume[0] / resume[1]}: the checkpoint is at step {step}, past {limit}")


def finished(out: Path, resume: tuple[Path, str], step: int) -> bool:
    """Whether RUN_DIR `out` is a run that ended at `step`, the step of its own checkpoint it
    would resume: its summary.json says so (a run that saved its last step and died before the
    summary is not finished: resuming it writes the summary)."""
    if resume[0].resolve() != (out / rundir.CHECKPOINTS).resolve():
        return False
    summary = rundir.read_summary(out)
    return summary is not None and int(summary["steps"]) >= step


@dataclass(frozen=True)
class Switch:
    """How this run's layout relates to the checkpoint it resumes (app/checkpoint/universal.py)."""

    saved: Layout | None
    now: Layout
    history: tuple[dict[str, Any], ...]
    """Every layout the run has had: {"step", "zero_stage", "world_size", "precision",
    "offload"}, one entry per change (checkpoints and config.json record it)."""
    convert: bool
    """The checkpoint is not loadable as it is: load its universal form."""


def settle_switch(resume: tuple[Path, str] | None, ds: dict[str, Any], world: World,
                  global_batch: int, phase: Phase | None = None,
                  island_ranks: int = 0) -> Switch:
    """Compare the checkpoint's layout with this run's; say what changes. The layout's world is
    DeepSpeed's data-parallel world (an island's ranks in a low-communication run)."""
    now = layout_of(ds, island_ranks or world.world_size)
    entry = {"step": 0, **asdict(now)}
    if resume is None:
        return Switch(None, now, (entry,), False)
    state = tags.read_state(*resume)
    saved = saved_layout(state)
    history = tuple(state.get("history") or ({"step": 0, **asdict(saved)},))
    tag_dir = resume[0] / resume[1]
    adam = optimizer_switch(state, ds)  # (the checkpoint's optimizer, this run's) or None
    convert = not is_universal(tag_dir) and (not saved.loads_natively(now) or adam is not None)
    why_not = convertible_into(now) if convert or is_universal(tag_dir) else None
    if why_not and adam:
        raise UserError(f"{tag_dir}: holds {adam[0]}'s optimizer state and this run steps "
                        f"{adam[1]}: a conversion is needed, and {why_not}")
    if why_not:
        raise UserError(f"{tag_dir}: written with {saved}; {why_not}")
    if world.is_main and adam and not is_universal(tag_dir):
        print(f"resume: {tag_dir} holds {adam[0]}'s optimizer state and this run steps "
              f"{adam[1]} (converting it)", file=sys.stderr)
    if saved != now:
        history += ({**entry, "step": int(state["step"])},)
    if world.is_main and saved != now:
        how = ("converting it" if convert else "DeepSpeed loads it as it is") \
            if not is_universal(tag_dir) else "a converted checkpoint"
        print(f"resume: {tag_dir} was written with {saved}; this run is {now} ({how})",
              file=sys.stderr)
    if world.is_main and state["global_batch"] != global_batch:
        position = state["consumed_samples"] if phase is None else phase.position
        print(f"resume: the global batch was {state['global_batch']} samples and is "
              f"{global_batch} now: continuing from sample {position:,} "
              f"(step {state['step']}); the step count and LR schedule continue from there",
              file=sys.stderr)
    return Switch(saved, now, history, convert)


# Sample-layout settings a resume may change: --seq-len starts a phase (settle_phase), the
# stream position mapped into the new samples (app.checkpoint.train_state.phase_position).
PHASE_SETTINGS = ("seq_len",)


def sample_layout(cfg: TrainConfig, objective: str) -> dict[str, Any]:
    """The settings that decide which sample a stream position is (checkpoint.SAMPLE_LAYOUT),
    less those a phase may change."""
    values = {**cfg.to_dict(), "objective": objective}
    return {k: values[k] for k in checkpoint.SAMPLE_LAYOUT if k not in PHASE_SETTINGS}


def check_tokenizer_copy(data: Path, manifest: dict[str, Any]) -> None:
    """The dataset's tokenizer copy must be the one it was made with (one hash of one file)."""
    tok_dir = data / manifest["tokenizer"].get("dir", TOKENIZER_DIR)
    found = tokenizer_fingerprint(tok_dir)
    if found != manifest["tokenizer"]["fingerprint"]:
        raise UserError(f"{tok_dir / 'tokenizer.json'}: fingerprint {found} does not match "
                        f"{data / 'dataset.json'}'s {manifest['tokenizer']['fingerprint']} "
                        f"(replaced or corrupt; run `python -m data_tools inspect --verify`)")
    check_vocabulary(data, manifest, tok_dir / "tokenizer.json")


# The largest token id each shard dtype of dataset.json holds
DTYPE_MAX_ID = {"uint16": (1 << 16) - 1, "int32": (1 << 31) - 1}
_ID_KEYS = ("eod_token_id", "pad_token_id", "mask_token_id", "cls_token_id", "bos_token_id",
            "unk_token_id")


def check_vocabulary(data: Path, manifest: dict[str, Any], tok_json: Path) -> None:
    """dataset.json's vocab_size sizes the model's embedding: it must be the tokenizer's, within
    what the shards' dtype holds, and above every special id (an edited 70000 on a 4,000-token
    tokenizer trained a model 17 times too wide, silently)."""
    from tokenizers import Tokenizer

    where, vocab = data / MANIFEST, manifest["vocab_size"]
    if vocab - 1 > DTYPE_MAX_ID[manifest["dtype"]]:
        raise UserError(f"{where}: key 'vocab_size' is {vocab} but key 'dtype' "
                        f"{manifest['dtype']} holds ids up to {DTYPE_MAX_ID[manifest['dtype']]}")
    try:
        tok = Tokenizer.from_str(read_regular(tok_json).decode("utf-8"))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the Rust parser's errors: a corrupt file
        raise UserError(f"{tok_json}: not a tokenizer ({str(e).splitlines()[0][:80]})") from None
    ids = tok.get_vocab(with_added_tokens=True).values()
    words = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    if vocab != words:  # the formula prepare and adopt record (TokenizerInfo.vocab_size)
        raise UserError(f"{where}: key 'vocab_size' is {vocab} but its tokenizer {tok_json} has "
                        f"{words} tokens (dataset.json edited? prepare the dataset again)")
    for key in _ID_KEYS:
        if manifest.get(key) is not None and manifest[key] >= vocab:
            raise UserError(f"{where}: key '{key}' is {manifest[key]}, not below key "
                            f"'vocab_size' {vocab}")


def check_learnable(cfg: TrainConfig, objective: str, manifest: dict[str, Any],
                    where: Path) -> None:
    """Refuse a sample layout with no token to predict: a run would report loss 0 and
    perplexity 1, a perfect model. MLM with one document a sample (--packing doc) spends
    [CLS] and the closing [SEP] of a truncated document: it needs a third token to mask."""
    need = 2
    if objective == "mlm" and cfg.packing in ("doc", "doc-packed"):
        need = 3 if manifest.get("cls_token_id") is not None else 2
    if cfg.seq_len < need:
        raise UserError(f"--seq-len {cfg.seq_len}: a sample of {where} holds no token to "
                        f"predict with --packing {cfg.packing} and objective {objective}; use "
                        f"--seq-len {need} or more")


def batch_geometry(cfg: TrainConfig, world_size: int) -> tuple[int, int, int]:
    """(micro batch, gradient accumulation, global batch) from the flags and the world size."""
    micro = cfg.micro_batch
    per_step = micro * world_size
    if cfg.global_batch is not None:
        if cfg.global_batch % per_step:
            raise UserError(f"--global-batch {cfg.global_batch}: not a multiple of --micro-batch "
                            f"{micro} x {world_size} ranks")
        accum = cfg.global_batch // per_step
        if cfg.grad_accum is not None and cfg.grad_accum != accum:
            raise UserError(f"--grad-accum {cfg.grad_accum} disagrees with --global-batch "
                            f"{cfg.global_batch} (= {accum} x {micro} x {world_size} ranks)")
    else:
        accum = cfg.grad_accum or 1
    return micro, accum, micro * accum * world_size


def check_run_dir(cfg: TrainConfig, sources: Sources, notes: list[str] | None = None,
                  is_main: bool = True) -> tuple[Path, str] | None:
    """The checkpoint to resume from (or None), refusing to clobber a previous run silently:
    a run directory with checkpoints (even with `latest` gone) is never started over without
    --overwrite, nor continued from another run's checkpoint."""
    rundir.check_out(cfg.out, sources.paths, is_main, cfg.init_from)
    ckpt_dir = cfg.out / rundir.CHECKPOINTS
    resume = tags.find_resume(cfg.resume, cfg.out, notes)
    previous = [n for n in (rundir.CHECKPOINTS, rundir.METRICS, rundir.SUMMARY)
                if (cfg.out / n).exists()]
    if resume is None and not cfg.overwrite:
        has_ckpt = bool(tags.all_tags(ckpt_dir)) or (ckpt_dir / tags.LATEST).exists()
        if previous and (cfg.resume == "never" or has_ckpt):
            raise UserError(f"--out {cfg.out}: holds a previous run ({', '.join(previous)}); "
                            f"continue it with --resume auto, or replace it with --overwrite")
    if resume is None or cfg.resume == "auto":
        return resume  # with --resume auto, what follows the tag is cleared (prepare_run_dir)
    held = [n for n in (rundir.RUN_CONFIG, *previous) if (cfg.out / n).exists()]
    if held and resume[0].resolve() != ckpt_dir.resolve():
        raise UserError(f"--out {cfg.out}: holds another run ({', '.join(held)}); resuming "
                        f"{resume[0] / resume[1]} there would mix two runs: resume into a new "
                        f"--out, or continue that run with --resume auto (nothing was changed)")
    newer = tags.tags_after(ckpt_dir, resume[1])
    if newer:  # saving here would interleave two histories and prune the wrong one
        raise UserError(f"--resume {resume[0] / resume[1]}: {ckpt_dir} holds later "
                        f"checkpoints ({', '.join(newer)}); resume into another --out, or "
                        f"move those away")
    return resume
