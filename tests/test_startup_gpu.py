"""A cluster never stops at start-up (docs/gpu.md; the GPU review's C1, C2, M5, m5 and m6), shown
on CPU: an explicit flash-attention 2 whose package does not import or run is one line, and
"auto" never depends on it; CUDA runs take torch's fused AdamW unless DeepSpeed's op is prebuilt,
and DeepSpeed's JIT ops build per node; a rank's CPU share is counted once and a GPU rank short of
cores is said; a checkpoint of the other optimizer family resumes through its universal form (or
is refused in one line), and torch's AdamW keeps this run's fused setting across a load."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from app.runtime.device import (
    _FLASH_PROBE,
    AUTO_ATTENTION,
    CpuShare,
    Device,
    choose_attention,
    cpu_share_warning,
    device_ordinal,
    flash_attention_broken,
)
from data_tools.errors import UserError
from tests.helpers import REPO, TINY, check, clean_env, python, remanifest, run_app

CPU = Device("cpu", "gloo", False, True, False)
GPU = Device("cuda", "nccl", True, True, True, model="NVIDIA H100 80GB HBM3")


def fake_flash_attn(root: Path, body: str) -> Path:
    """A real, importable `flash_attn` package under `root` whose __init__ is `body`, installed
    as a wheel would be (its dist-info: what transformers' is_flash_attn_2_available reads)."""
    (root / "flash_attn").mkdir(parents=True)
    (root / "flash_attn" / "__init__.py").write_text(body)
    info = root / "flash_attn-2.8.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n")
    (info / "top_level.txt").write_text("flash_attn\n")
    return root


BROKEN_IMPORT = ('import os\n'
                 'open(os.environ["FLASH_MARK"], "a").write("imported\\n")\n'
                 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: '
                 '_ZN3c104cuda9SetDevice")\n')
BROKEN_KERNEL = ('__version__ = "2.8.3"\n'
                 'def flash_attn_func(q, k, v, causal=False):\n'
                 '    raise RuntimeError("CUDA error: no kernel image is available for execution '
                 'on the device")\n')


@pytest.fixture
def probe_path(tmp_path, monkeypatch):
    """sys.path with a fake flash_attn first, the probe's cache and the module emptied after."""
    def use(body: str) -> None:
        fake_flash_attn(tmp_path / "site", body)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        monkeypatch.setenv("FLASH_MARK", str(tmp_path / "mark"))
    yield use
    _FLASH_PROBE.clear()
    sys.modules.pop("flash_attn", None)


def test_auto_attention_is_sdpa_and_never_imports_flash_attn(probe_path, tmp_path):
    probe_path(BROKEN_IMPORT)
    for device, precision, packing in ((GPU, "bf16", "concat"), (GPU, "fp32", "concat"),
                                       (GPU, "bf16", "doc"), (CPU, "fp32", "concat")):
        impl, why = choose_attention("auto", device, precision, packing)
        assert impl == AUTO_ATTENTION == "sdpa" and why.startswith("auto: PyTorch's SDPA")
    assert "FlashAttention-2" in choose_attention("auto", GPU, "bf16", "concat")[1]
    assert not (tmp_path / "mark").exists()  # auto asked nothing of the package
    assert choose_attention("eager", GPU) == ("eager", "as asked")


def test_a_flash_attn_that_does_not_import_is_one_line(probe_path, tmp_path):
    probe_path(BROKEN_IMPORT)
    with pytest.raises(UserError) as e:
        choose_attention("flash_attention_2", GPU, "bf16", "concat")
    line = str(e.value)
    assert line.startswith("--attn flash_attention_2: the flash-attn package does not import")
    assert "undefined symbol" in line and "--attn sdpa" in line and "\n" not in line
    assert flash_attention_broken(GPU) == flash_attention_broken(CPU)  # once per process
    assert (tmp_path / "mark").read_text() == "imported\n"


def test_a_flash_attn_whose_kernel_fails_is_one_line(probe_path):
    probe_path(BROKEN_KERNEL)
    why = flash_attention_broken(CPU)
    assert why.startswith("flash-attn 2.8.3 does not run on cpu (RuntimeError: CUDA error: no "
                          "kernel image"), why


@pytest.mark.slow
def test_train_with_a_broken_flash_attn_exits_2_in_one_line(mlm_dataset, tmp_path):
    site = fake_flash_attn(tmp_path / "site", BROKEN_IMPORT)
    env = clean_env(PYTHONPATH=f"{site}{os.pathsep}{REPO}", FLASH_MARK=str(tmp_path / "mark"))
    proc = run_app("train", "--data", mlm_dataset, "--out", tmp_path / "run", *TINY,
                   "--max-steps", "2", "--attn", "flash_attention_2", env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ": error: " in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "--attn flash_attention_2: the flash-attn package does not import" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cpu_and_cuda_take_torchs_fused_adamw_even_where_deepspeeds_is_prebuilt():
    """torch's fused AdamW skips a step with non-finite gradients on the device
    (app.runtime.step_guard); DeepSpeed's fused Adam cannot, so it is not taken even where its
    wheel carries it (a ds_config asking `"torch_adam": false` still gets it)."""
    import dataclasses

    assert (CPU.torch_adam, CPU.torch_adam_fused) == (True, True)
    assert (GPU.torch_adam, GPU.torch_adam_fused) == (True, True)
    built = dataclasses.replace(GPU, fused_adam_prebuilt=True)
    assert (built.torch_adam, built.torch_adam_fused) == (True, True)
    other = Device("xpu", "ccl", True, True, True)  # other accelerators bring their own ops
    assert (other.torch_adam, other.torch_adam_fused) == (False, False)


def test_deepspeed_hands_fused_to_torchs_adamw():
    """What DeepSpeed builds from the params fill_auto writes on CUDA: torch.optim.AdamW with
    fused=True (CPU here: torch has a fused CPU kernel too, so the class and flag are real)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = {"lr": 1e-3, "torch_adam": True, "fused": True}
    cls, extra = DeepSpeedEngine.get_optimizer_configuration(object.__new__(DeepSpeedEngine),
                                                             dict(params), True)
    rest = {k: v for k, v in params.items() if k != "torch_adam"}
    opt = cls([torch.nn.Parameter(torch.ones(3))], **rest, **extra)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] is True


def test_jit_ops_build_in_a_directory_of_the_nodes_own(tmp_path):
    env = clean_env()
    env.pop("TORCH_EXTENSIONS_DIR", None)
    code = ("import os; from app.runtime.ops import _own_extensions_dir; _own_extensions_dir(); "
            "print(os.environ['TORCH_EXTENSIONS_DIR'])")
    out = check(python("-c", code, env=env, timeout=300)).stdout.strip()
    assert Path(out).name == platform.node() and Path(out).parent.name.startswith("py3")
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)  # the user's choice stands
    out = check(python("-c", code, env=env, timeout=300)).stdout.strip()
    assert out == str(tmp_path)


def test_a_gpu_rank_short_of_cores_is_said_in_one_line():
    line = cpu_share_warning(GPU, CpuShare(affinity=1, local_ranks=8, shared=True), 1, 0)
    assert line.startswith("warning: 1 CPU core(s) in this rank's affinity mask, shared by 8 "
                           "local rank(s): 1 thread(s) and 0 loader worker(s) per rank")
    assert "srun --cpus-per-task" in line and "--cpu-bind=none" in line
    assert "docs/launch.md" in line and "\n" not in line
    assert cpu_share_warning(CPU, CpuShare(1, 8, True), 1, 0) is None  # CPU ranks use their cores
    assert cpu_share_warning(GPU, CpuShare(16, 8, True), 2, 1) is None
    assert CpuShare(12, 8, shared=False).cores == 12  # srun bound the rank: not divided again
    assert CpuShare(12, 8, shared=True).cores == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind to one")
def test_a_rank_bound_to_its_own_cores_is_not_divided_again():
    code = ("import os, sys; from app.runtime.device import cpu_share; from app.data.loader import "
            "default_num_workers\n"
            "if sys.argv[1] == 'bind': os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "s = cpu_share({'LOCAL_WORLD_SIZE': '8'}); print(s.shared, s.cores)")
    seen = {}
    for how in ("bind", "inherit"):
        proc = check(python("-c", code, how, timeout=300))
        seen[how] = proc.stdout.split()
    assert seen["bind"] == ["False", "1"]  # its own one core (srun --cpu-bind), kept whole
    assert seen["inherit"] == ["True", str(len(os.sched_getaffinity(0)) // 8)]


def test_the_device_ordinal_wraps_at_the_devices_a_rank_sees():
    from app.runtime.device import accelerator

    count = int(accelerator().device_count() or 0)
    assert device_ordinal(0) == 0
    assert device_ordinal(count) == (0 if count else count)  # one device per task: ordinal 0


def test_torchs_adamw_keeps_its_own_fused_setting_across_a_load():
    """A CPU checkpoint (single-tensor AdamW, step on the host) into a fused AdamW, and back:
    torch's load_state_dict takes `fused` from the checkpoint; keep_own_settings puts this run's
    back and moves each step to where that implementation keeps it."""
    from app.checkpoint.store import _own_settings, keep_own_settings

    def adamw(fused: bool | None) -> torch.optim.AdamW:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64))
        return torch.optim.AdamW([p], lr=1e-2, fused=fused)

    class Engine:  # what _own_settings reads: DeepSpeed's optimizer at ZeRO-0 in fp32
        def __init__(self, optimizer):
            self.optimizer = optimizer

    for saved_fused, own_fused in ((None, True), (True, None)):
        source = adamw(saved_fused)
        for _ in range(3):
            source.param_groups[0]["params"][0].grad = torch.ones(64)
            source.step()
        target = adamw(own_fused)
        own = _own_settings(Engine(target))
        target.load_state_dict(source.state_dict())
        assert target.param_groups[0]["fused"] == saved_fused  # what torch alone leaves
        keep_own_settings(target, own)
        assert target.param_groups[0]["fused"] == own_fused
        (p,) = target.param_groups[0]["params"]
        step = target.state[p]["step"]
        assert step.dtype == torch.float32 and float(step) == 3
        p.grad = torch.ones(64)
        target.step()  # steps with this run's implementation
        assert float(target.state[p]["step"]) == 4


def _edit_state(tag: Path, edit) -> None:
    path = tag / "train_state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    remanifest(tag)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_of_deepspeeds_adam_converts_or_is_refused_in_one_line(mlm_dataset,
                                                                           tmp_path):
    """As if written on a GPU with DeepSpeed's prebuilt FusedAdam: its recorded ds_config says
    so. On CPU (torch's AdamW) the resume goes through the universal form; into ZeRO-0 in bf16,
    which that form does not reach, it is refused naming both optimizers."""
    run = tmp_path / "run"
    proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY, "--max-steps", "2",
                         "--save-every", "2"))
    assert "attention: sdpa (auto: PyTorch's SDPA (CPU))" in proc.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["attention"] == "sdpa"
    assert config["model"]["attention_why"] == "auto: PyTorch's SDPA (CPU)"
    cpu = config["environment"]["cpu"]
    assert cpu["loader_workers"] == 0 and cpu["affinity_cores"] == len(os.sched_getaffinity(0))
    tag = run / "checkpoints" / "global_step2"

    def as_fused_adam(state):
        state["ds_config"]["optimizer"]["params"]["torch_adam"] = False
    _edit_state(tag, as_fused_adam)
    refused = run_app("train", "--data", mlm_dataset, "--out", run, *TINY, "--max-steps", "4",
                      "--resume", "auto", "--precision", "bf16", "--zero", "0")
    lines = [ln for ln in refused.stderr.splitlines() if ": error: " in ln]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert ("holds DeepSpeed FusedAdam's optimizer state and this run steps torch AdamW"
            in lines[0]) and "ZeRO-0 with bf16 is not supported" in lines[0]
    resumed = check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY,
                            "--max-steps", "4", "--resume", "auto"))
    assert (f"resume: {tag} holds DeepSpeed FusedAdam's optimizer state and this run steps "
            f"torch AdamW (fused) (converting it)") in resumed.stderr
    assert (run / "checkpoints" / "global_step2.universal").is_dir()
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_a_torch_below_transformers_floor_is_one_line():
    from app.runtime.device import check_torch_version

    for fine in ("2.6.0", "2.13.0+cpu", "2.10.1+cu128", "3.0.0a0"):
        check_torch_version(fine)
    with pytest.raises(UserError, match=r"^torch 2\.5\.1\+cu121: this app needs torch >= 2\.6 "):
        check_torch_version("2.5.1+cu121")
