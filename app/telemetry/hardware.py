"""The accelerator table: memory and dense peak TFLOP/s per precision, looked up by name.

Shared by the planner (`app plan --gpu NAME`) and MFU telemetry: MFU is model FLOP/s over the
*dense* peak of the precision the run computes in (sparsity figures, which NVIDIA quotes first,
are halved back here). Figures are per device, from the vendors' datasheets cited beside each
entry; `None` means the precision has no matrix-unit path on that device.
"""
from __future__ import annotations

from dataclasses import dataclass

from data_tools.errors import UserError

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model (per device, not per board or node)."""

    name: str
    """Canonical name, e.g. "H100-SXM"; lookups ignore case, spaces, '-' and '_'."""
    memory_gb: float
    """Device memory in GB (10^9 bytes), as the datasheet states it."""
    bf16: float | None
    """Dense peak TFLOP/s with bf16 inputs (fp32 accumulate)."""
    fp16: float | None
    """Dense peak TFLOP/s with fp16 inputs."""
    tf32: float | None
    """Dense peak TFLOP/s of fp32 matmuls run as TF32 (NVIDIA Ampere and later, AMD CDNA3)."""
    fp32: float
    """Peak TFLOP/s of plain fp32 (vector units; AMD's matrix fp32 where it has one)."""
    aliases: tuple[str, ...] = ()
    """Other names users type for it."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_tflops(self, precision: str, allow_tf32: bool = True) -> float:
        """Dense peak TFLOP/s for a run in `precision` (bf16, fp16, tf32 or fp32).

        fp32 runs use TF32 matmuls when `allow_tf32` (PyTorch's
        `torch.backends.cuda.matmul.allow_tf32`) and the device has them.
        """
        if precision not in PRECISIONS:
            raise UserError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        if precision == "fp32" and allow_tf32 and self.tf32:
            return self.tf32
        value = getattr(self, precision)
        if value is None:
            raise UserError(f"--gpu {self.name}: has no {precision} matrix units "
                            f"(has {', '.join(p for p in PRECISIONS if getattr(self, p))})")
        return value


ACCELERATORS: tuple[Accelerator, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 (624 sparse), TF32 156, FP32 19.5
    Accelerator("A100-40GB", 40, 312, 312, 156, 19.5, ("a100-sxm4-40gb", "a100-pcie-40gb")),
    Accelerator("A100-80GB", 80, 312, 312, 156, 19.5, ("a100-sxm4-80gb", "a100-pcie-80gb")),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), dense = half the "with sparsity" figures:
    # SXM: BF16/FP16 1,979* -> 989.5, TF32 989* -> 494.5, FP32 67; 80 GB
    Accelerator("H100-SXM", 80, 989.5, 989.5, 494.5, 67, ("h100", "h100-sxm5", "h100-80gb")),
    # PCIe: BF16/FP16 1,513* -> 756.5, TF32 756* -> 378, FP32 51; 80 GB
    Accelerator("H100-PCIe", 80, 756.5, 756.5, 378, 51),
    # NVL: BF16/FP16 1,671* -> 835.5, TF32 835* -> 417.5, FP32 60; 94 GB
    Accelerator("H100-NVL", 94, 835.5, 835.5, 417.5, 60),
    # NVIDIA H200 datasheet (2024): SXM has H100 SXM's compute with 141 GB HBM3e
    Accelerator("H200", 141, 989.5, 989.5, 494.5, 67, ("h200-sxm",)),
    # NVIDIA HGX B200 specifications (per GPU): FP16/BF16 4.5 PF* -> 2,250, TF32 2.2 PF* -> 1,100,
    # FP32 75; 180 GB HBM3e (HGX "up to 1.4 TB" over 8 GPUs)
    Accelerator("B200", 180, 2250, 2250, 1100, 75, ("hgx-b200",)),
    # AMD Instinct MI300X datasheet: FP16/BF16 1,307.4 (2,614.9 sparse), TF32 653.7,
    # FP32 (matrix) 163.4; 192 GB HBM3
    Accelerator("MI300X", 192, 1307.4, 1307.4, 653.7, 163.4),
    # AMD Instinct MI250X datasheet: FP16/BF16 383, FP32 matrix 95.7 (no TF32); 128 GB HBM2e
    Accelerator("MI250X", 128, 383, 383, None, 95.7),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 (733* sparse), TF32 183 (366*), FP32 91.6; 48 GB
    Accelerator("L40S", 48, 362.05, 362.05, 183, 91.6),
    # NVIDIA L4 datasheet: BF16/FP16 121 (242*), TF32 60 (120*), FP32 30.3; 24 GB
    Accelerator("L4", 24, 121, 121, 60, 30.3),
    # NVIDIA A10 datasheet: BF16/FP16 125 (250*), TF32 62.5 (125*), FP32 31.2; 24 GB
    Accelerator("A10", 24, 125, 125, 62.5, 31.2),
    # AWS's A10G (g5 instances) has no NVIDIA datasheet; AWS and third-party comparisons
    # (e.g. Baseten, "NVIDIA A10 vs A10G") give ~70 BF16/FP16, ~35 TF32, 31.5 FP32; 24 GB
    Accelerator("A10G", 24, 70, 70, 35, 31.5),
    # NVIDIA V100 datasheet: SXM2 tensor (FP16) 125, FP32 15.7; PCIe 112 / 14. No BF16/TF32.
    Accelerator("V100-16GB", 16, None, 125, None, 15.7, ("v100-sxm2-16gb",)),
    Accelerator("V100-32GB", 32, None, 125, None, 15.7, ("v100-sxm2-32gb",)),
    Accelerator("V100-PCIe", 32, None, 112, None, 14),
    # NVIDIA T4 datasheet: FP16 tensor 65, FP32 8.1; 16 GB
    Accelerator("T4", 16, None, 65, None, 8.1),
)


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _index() -> dict[str, Accelerator]:
    out: dict[str, Accelerator] = {}
    for acc in ACCELERATORS:
        for name in (acc.name, *acc.aliases):
            out[_key(name)] = acc
    return out


_BY_KEY = _index()


def names() -> list[str]:
    return [acc.name for acc in ACCELERATORS]


def lookup(name: str) -> Accelerator:
    """The accelerator called `name` (case, spaces, '-' and '_' ignored); UserError if unknown."""
    acc = _BY_KEY.get(_key(name))
    if acc is None:
        raise UserError(f"--gpu {name!r}: unknown accelerator (known: {', '.join(names())}; "
                        f"or give --gpu-mem-gb)")
    return acc
