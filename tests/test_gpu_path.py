"""Right on the first GPU run, shown on CPU: bf16 runs export their fp32 masters and the check
still catches a wrong weight, bf16 gradients accumulate in fp32 where DeepSpeed allows it, a
training step syncs the host nowhere, a skipped step keeps the LR schedule on the step counter,
staging happens before the process group, and the knobs that only matter on GPUs are set."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.models.build import build_model
from app.models.presets import build_config
from app.runtime.device import Device, attention_implementation, set_cpu_threads
from app.runtime.overlap import block_starts
from app.runtime.param_groups import layer_blocks, optimizer_groups
from app.trainer import token_sums
from tests.helpers import REPO, TINY, check, clean_env, python, remanifest, run_app

# Every test that trains is marked slow; the bf16 fixture's three runs are the first to need
# DeepSpeed's fused Adam, which a fresh machine builds (minutes) inside that fixture.
SLOW = pytest.mark.slow
# The bf16 runs' steps: what the tests read is there after one update (masters off the bf16 grid,
# the engines' dtypes, the export and its check); a bf16 step is ~0.35 CPU-s here, 10 were 3 s a run
STEPS = 2


@pytest.fixture(scope="module")
def bf16_runs(mlm_dataset, tmp_path_factory):
    """STEPS bf16 steps of bert-tiny at ZeRO-0, 1 and 3 (one rank each), each exported: ZeRO-0
    keeps its masters flat, ZeRO-1 in BF16_Optimizer partitions, ZeRO-3 in ZeRO's own."""
    root = tmp_path_factory.mktemp("bf16")
    runs = {}
    for zero in (0, 1, 3):
        run = root / f"zero{zero}"
        # DeepSpeed's fused Adam, as on an accelerator (on CPU the app picks torch's AdamW)
        ds = json.loads((REPO / "ds_configs" / f"zero{zero}.json").read_text())
        ds["optimizer"]["params"]["torch_adam"] = False
        (root / f"zero{zero}.json").write_text(json.dumps(ds))
        proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY,
                             "--micro-batch", "8", "--max-steps", str(STEPS), "--precision", "bf16",
                             "--ds-config", root / f"zero{zero}.json"))
        check(run_app("export", run, "--out", root / f"hf{zero}"))
        runs[zero] = (run, root / f"hf{zero}", proc.stderr)
    return runs


def _exported(hf: Path) -> dict[str, torch.Tensor]:
    return load_file(hf / "model.safetensors")


@SLOW
@pytest.mark.timeout(1200)
def test_bf16_zero0_exports_the_fp32_masters(bf16_runs):
    run, hf, _ = bf16_runs[0]
    tag = run / "checkpoints" / f"global_step{STEPS}"
    saved = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    flat = saved["optimizer"]["fp32_groups_flat"]  # DeepSpeed keeps the masters flattened
    groups = json.loads((tag / "train_state.json").read_text())["flat_master_groups"]
    exported = _exported(hf)
    name = groups[0][0]
    master = flat[0][:exported[name].numel()].view_as(exported[name])
    assert torch.equal(exported[name], master)
    assert not torch.equal(exported[name], saved["module"][name].float())  # not the bf16 copy
    assert not torch.equal(master, master.to(torch.bfloat16).float())


@SLOW
@pytest.mark.timeout(1200)
def test_bf16_zero1_exports_the_fp32_masters(bf16_runs):
    run, hf, _ = bf16_runs[1]
    tag = run / "checkpoints" / f"global_step{STEPS}"
    part = torch.load(next(tag.glob("bf16_zero_pp_rank_0_*optim_states.pt")),
                      map_location="cpu", weights_only=False)["optimizer_state_dict"]
    groups = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["param_shapes"]
    exported = _exported(hf)
    # the first parameter of the first group that the export keeps whole (one rank: the
    # partition is the group; not the word embedding, whose padded rows the export drops)
    g, name, shape = next((g, n, s) for g, shapes in enumerate(groups) for n, s in shapes.items()
                          if n in exported and exported[n].shape == s)
    offset = 0
    for n, s in groups[g].items():
        if n == name:
            break
        offset += s.numel()
    master = part["single_partition_of_fp32_groups"][g][offset:offset + shape.numel()].view(shape)
    assert torch.equal(exported[name], master)
    assert not torch.equal(master, master.to(torch.bfloat16).float())


@SLOW
@pytest.mark.timeout(1200)
def test_exports_keep_the_tokenizers_vocabulary(bf16_runs, mlm_dataset):
    from transformers import AutoModelForMaskedLM

    vocab = json.loads((mlm_dataset / "dataset.json").read_text())["vocab_size"]
    run, hf, _ = bf16_runs[0]
    trained = json.loads((run / "config.json").read_text())["model"]["config"]["vocab_size"]
    assert (vocab, trained) == (2000, 2048)  # padded for the tensor cores while training
    model = AutoModelForMaskedLM.from_pretrained(hf)
    assert model.config.vocab_size == vocab
    assert model(input_ids=torch.tensor([[2, 50, 3]])).logits.shape[-1] == vocab


@SLOW
@pytest.mark.timeout(1200)
def test_the_export_check_still_catches_a_wrong_weight(bf16_runs, tmp_path):
    import shutil

    run = Path(shutil.copytree(bf16_runs[0][0], tmp_path / "run"))
    path = run / "checkpoints" / f"global_step{STEPS}" / "mp_rank_00_model_states.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    with torch.no_grad():  # the masters read at a wrong offset, as an unflattening bug would
        flat = saved["optimizer"]["fp32_groups_flat"][0]
        flat.copy_(flat.roll(128))
    torch.save(saved, path)
    remanifest(path.parent)  # the bug is the save's: its manifest hashes the wrong masters
    proc = run_app("export", run, "--out", tmp_path / "hf")
    assert proc.returncode == 2 and "differ from the run's" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


@SLOW
@pytest.mark.timeout(1200)
def test_bf16_gradients_accumulate_in_fp32_where_deepspeed_allows(bf16_runs):
    engines = {z: json.loads((run / "config.json").read_text()) for z, (run, _, _) in
               bf16_runs.items()}
    assert engines[3]["ds_config"]["data_types"] == {"grad_accum_dtype": "fp32"}
    one = engines[1]
    assert one["ds_config"]["data_types"] == {"grad_accum_dtype": "fp32"}
    assert one["engine"]["optimizer"] == "BF16_Optimizer"
    assert one["engine"]["grad_accum_dtype"] == "torch.float32"
    assert one["engine"]["model_dtype"] == "torch.bfloat16"
    zero = engines[0]  # DeepSpeed refuses the mix at ZeRO-0: said at start-up
    assert zero["engine"]["grad_accum_dtype"] == "torch.bfloat16"
    assert "bf16 at ZeRO-0 accumulates gradients in bf16" in bf16_runs[0][2]
    # summed across ranks in fp32 (--grad-comm-dtype's default), not DeepSpeed's bf16 (gpu-path
    # C4); BF16_Optimizer fills its fp32 buffer during backward, where the reducer reads it
    assert {e["engine"]["communication_data_type"] for e in engines.values()} == {"torch.float32"}
    assert one["ds_config"]["bf16"]["immediate_grad_update"] is True


@SLOW
def test_bf16_without_a_stage_defaults_to_zero1(mlm_dataset, tmp_path):
    from app.config import TrainConfig
    from app.runtime.dist import World
    from app.settle import plan_run

    cpu_bf16 = Device("cpu", "gloo", False, True, False)
    cfg = TrainConfig(data=mlm_dataset, out=tmp_path / "r", precision="bf16")
    plan = plan_run(cfg, cpu_bf16, World(0, 1, 0, 1))
    assert plan.ds_path.name == "zero1.json" and plan.ds_config["data_types"]["grad_accum_dtype"]
    plan = plan_run(TrainConfig(data=mlm_dataset, out=tmp_path / "r"), cpu_bf16,
                    World(0, 1, 0, 1))
    assert plan.ds_path.name == "zero0.json" and plan.precision == "fp32"


def _probe(*args) -> dict:
    # a process of its own, forked from the warm process (tests/helpers.py `python`): the probe
    # builds its trainer and counts what its steps dispatch after the start, not the start
    proc = python(REPO / "tests" / "step_probe.py", *args, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE "):])


@SLOW
@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_a_training_step_never_syncs_the_host(mlm_dataset, clm_dataset, tmp_path, objective):
    """Forward, backward and DeepSpeed's step (ZeRO-0, concat packing): no nonzero, no item, no
    _local_scalar_dense. (ZeRO 1-3 add one of DeepSpeed's own: its inf/NaN check of the norm.)"""
    data = mlm_dataset if objective == "mlm" else clm_dataset
    (tmp_path / "run").mkdir()
    assert _probe("syncs", data, tmp_path / "run", objective, 0) == {}


@SLOW
def test_a_skipped_step_keeps_the_schedule_on_the_step_counter(mlm_dataset, tmp_path):
    (tmp_path / "run").mkdir()
    result = _probe("skip", mlm_dataset, tmp_path / "run", "mlm", 0)
    assert result["skipped_steps"] == 1
    assert result["lrs"] == pytest.approx(result["schedule"])


@SLOW
def test_staging_happens_before_the_process_group(mlm_dataset, tmp_path):
    """A copy may take longer than any collective's timeout: it runs before the group exists."""
    # the spy wraps stage() in the run's own process, a fork of the warm process (a
    # sitecustomize on PYTHONPATH needed a fresh interpreter: ~8 CPU-s of imports); app.build
    # imports stage() when it stages, so it finds the spy's
    spy = ("import json, os, sys\n"
           "import torch.distributed as dist\n"
           "import data_tools.stage as staging\n"
           "real = staging.stage\n"
           "def stage(*a, **k):  # notes whether the group exists at stage()\n"
           "    with open(os.environ['STAGE_LOG'], 'a') as f:\n"
           "        f.write(json.dumps(dist.is_initialized()) + '\\n')\n"
           "    return real(*a, **k)\n"
           "staging.stage = stage\n"
           "from app.faults import preemption\n"
           "preemption.catch()  # the stop handlers `python -m app train` installs first\n"
           "from app.__main__ import main\n"
           "sys.exit(main())  # as `python -m app ARGS`: its argv from sys.argv\n")
    log = tmp_path / "stage.log"
    check(python("-c", spy, "train", "--data", mlm_dataset, "--out", tmp_path / "run", *TINY,
                 "--max-steps", "2", "--stage-to", tmp_path / "local", "--dist-timeout", "5",
                 env=clean_env(STAGE_LOG=str(log))))
    assert log.read_text().split() == ["false"]
    assert (tmp_path / "local" / "dataset.json").is_file()


def test_gpu_knobs():
    gpu = Device("cuda", "nccl", True, True, True)
    # auto: PyTorch's SDPA everywhere (tests/test_startup_gpu.py: why, and flash-attention 2)
    assert attention_implementation("auto", gpu, "bf16", "doc") == "sdpa"
    assert attention_implementation("auto", gpu, "fp32", "concat") == "sdpa"
    # threads: the cores shared by the node's ranks on every kind of device
    env = {"LOCAL_WORLD_SIZE": "8"}
    threads = set_cpu_threads(env)
    assert threads == max(1, len(os.sched_getaffinity(0)) // 8)
    assert set_cpu_threads({"OMP_NUM_THREADS": "3"}) is None


def test_no_weight_decay_on_biases_norms_and_embeddings():
    for name in ("bert-tiny", "gpt-tiny", "llama-tiny"):
        model = build_model(build_config(name, vocab_size=300, special_ids={}))
        decay, other = optimizer_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        assert decay["weight_decay"] == 0.1 and other["weight_decay"] == 0.0
        decayed = {names[id(p)] for p in decay["params"]}
        assert decayed and all(p.ndim == 2 for p in decay["params"])
        assert not any("embed" in n or "wte" in n or "wpe" in n or "norm" in n.lower()
                       or "bias" in n for n in decayed), decayed
        assert len(decay["params"]) + len(other["params"]) == len(set(names))


def test_layer_blocks_keep_order_decay_and_every_parameter_once():
    """ZeRO-1/2's groups (app.runtime.param_groups.optimizer_groups with blocks): runs of
    consecutive parameters in registration order, each split by weight decay as the two groups
    are; the embedding, about a quarter of the model, a block of its own; the rest in about equal
    runs."""
    model = build_model(build_config("bert-tiny", vocab_size=8000, special_ids={},
                                     overrides={"hidden_size": 256, "num_attention_heads": 4}))
    two = optimizer_groups(model, 0.1)
    blocks = optimizer_groups(model, 0.1, blocks=8)
    decayed = {id(p) for p in two[0]["params"]}
    order = [id(p) for p in {id(p): p for p in model.parameters()}.values()]
    assert [id(p) for g in blocks for p in g["params"]] != order  # split by decay in each block
    assert sorted(id(p) for g in blocks for p in g["params"]) == sorted(order)
    for g in blocks:
        assert g["params"] and all((id(p) in decayed) == (g["weight_decay"] == 0.1)
                                   for p in g["params"])
    runs = layer_blocks(list({id(p): p for p in model.parameters()}.values()), 8)
    assert len(runs) == 8 and [id(p) for r in runs for p in r] == order
    sizes = [sum(p.numel() for p in r) for r in runs]
    embedding = model.get_input_embeddings().weight
    assert runs[0] == [embedding] and sizes[0] > 0.2 * sum(sizes)
    rest = sizes[1:-1]  # the last run takes what is left
    assert max(rest) < 2.5 * min(rest), sizes
    assert block_starts([5, 5], 8) == [0, 1] and block_starts([], 8) == [0]
    assert block_starts([1] * 16, 4) == [0, 4, 8, 12]


def test_eval_sums_in_chunks_equal_the_whole():
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 50)
    labels = torch.randint(0, 50, (3, 10))
    labels[0, :4] = -100
    for objective in ("mlm", "clm"):
        whole = token_sums(logits, labels, objective, chunk_rows=10_000)
        # float32 sums in another order: equal to a few ulps
        torch.testing.assert_close(token_sums(logits, labels, objective, chunk_rows=7), whole,
                                   rtol=1e-6, atol=1e-5)
