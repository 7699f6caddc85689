"""Benchmark: torch.compile against eager on the app's model alone, and which attention the
compiled graph runs.

On one H200 (docs/benchmarks.md, "GPU: second runs on one H200") the app with `--compile` ran
bert-120m at 1.9 x the eager step: its compiled graph held SDPA's math path (the scores
materialised, fp32 matrix products), where eager ran cuDNN's fused attention. The same model
compiled alone, with a padding mask, kept cuDNN's kernel and was 12 % faster than eager. This
script runs that model alone in each configuration that differs between the two, so one short
GPU call says which one sends the compiled graph to the math path:

    python bench/bench_compile_attn.py          # GPU: bert-120m, seq 512 x micro 64, bf16
    python bench/bench_compile_attn.py --cpu    # bert-tiny on CPU (what CI runs)
    python bench/bench_compile_attn.py --dropout 0.1 --mask none padding

For each attention dropout x mask ("none": no attention mask, as the loader's concat packing
hands over; "padding": the last eighth of each sample padded) it prints eager and compiled
ms per forward + backward, peak device memory, and the attention ops in the compiled graph's
post-grad form (`GraphOps`: an inductor custom pass that records them; "math" when the graph
holds matrix products of the scores and no fused attention op). `--out FILE` writes it all as
JSON. bench/gpu_mfu.py --compile reports the same for the app's own compiled step.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402

VOCAB = 32768


class GraphOps(CustomGraphPass):
    """An inductor post-grad pass that only records: the attention ops of every graph compiled
    while installed (`install`), and its matrix products of batched scores (`bmm`). uuid None:
    inductor's graph cache is bypassed, so a cached graph is seen too."""

    def __init__(self):
        self.ops: collections.Counter = collections.Counter()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            if "attention" in name or name.startswith("aten.bmm"):
                self.ops[name.split(".default")[0]] += 1

    def uuid(self) -> Any:
        return None

    def install(self) -> "GraphOps":
        import torch._inductor.config as inductor

        inductor.post_grad_custom_post_pass = self
        return self

    def summary(self) -> str:
        """"cudnn" / "flash" / "efficient" / "flash_for_cpu" ... (the fused op's), "math" (only
        matrix products), or "none compiled"."""
        fused = sorted({n.rsplit("_scaled_dot_product_", 1)[-1].replace("_backward", "")
                        for n in self.ops if "_scaled_dot_product_" in n})
        if fused:
            return "+".join(fused)
        return "math" if self.ops else "none compiled"


def batch(micro: int, seq: int, mask: str, device: str) -> dict[str, torch.Tensor]:
    """The loader's MLM batch form: ids, masked positions (15 %) and their labels, and with
    mask "padding" an attention mask whose last eighth is padding."""
    g = torch.Generator().manual_seed(0)
    real = seq - seq // 8 if mask == "padding" else seq
    k = max(1, seq * 15 // 100)
    out = {"input_ids": torch.randint(5, VOCAB, (micro, seq), generator=g),
           "mlm_positions": torch.stack([torch.randperm(real, generator=g)[:k]
                                         for _ in range(micro)]),
           "mlm_labels": torch.randint(5, VOCAB, (micro, k), generator=g)}
    if mask == "padding":
        out["attention_mask"] = torch.ones(micro, seq, dtype=torch.long)
        out["attention_mask"][:, real:] = 0
    return {k: v.to(device) for k, v in out.items()}


def run(model_name: str, dropout: float, mask: str, compiled: bool, args) -> dict[str, Any]:
    """ms per forward + backward (median of `--repeats` timings of `--steps`), peak memory, and
    the compiled graph's attention."""
    from app.models.build import build_model
    from app.models.presets import build_config, parse_overrides

    gpu = not args.cpu
    device = "cuda" if gpu else "cpu"
    torch._dynamo.reset()
    ops = GraphOps().install()
    cfg = build_config(model_name, vocab_size=VOCAB, dropout=dropout,
                       special_ids={"pad": 0, "mask": 1, "cls": 2, "sep": 3, "unk": 4},
                       overrides=parse_overrides(args.model_arg))
    model = build_model(cfg, seed=0, for_training=True).to(device)
    if gpu:
        model = model.to(torch.bfloat16)  # as DeepSpeed's bf16 runs it
    model.train()
    forward = torch.compile(model) if compiled else model
    inputs = batch(args.micro_batch, args.seq_len, mask, device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def steps(n: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(n):
            forward(**inputs).loss.backward()
        sync()
        return 1000 * (time.perf_counter() - start) / n

    start = time.perf_counter()
    steps(2)  # compilation, cuDNN's plans, the allocator's pools
    warm_s = time.perf_counter() - start
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(steps(args.steps) for _ in range(args.repeats))
    return {"model": model_name, "dropout": dropout, "mask": mask,
            "mode": "compiled" if compiled else "eager", "ms": ms, "warm_s": warm_s,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            "attention": ops.summary() if compiled else "eager",
            "ops": dict(ops.ops)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="bert-tiny on CPU, fp32 (CI)")
    p.add_argument("--model", help="a preset (default bert-120m; bert-tiny with --cpu)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field over the preset's, as `app train --model-arg` "
                   "(num_hidden_layers=1: half the graph to compile)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--dropout", type=float, nargs="+", default=[0.1, 0.0])
    p.add_argument("--mask", nargs="+", choices=("none", "padding"), default=["none", "padding"])
    p.add_argument("--steps", type=int, help="timed steps a repeat (default 10; 2 with --cpu)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="the results as JSON")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        p.error("no GPU here; --cpu runs bert-tiny on the CPU")
    model = args.model or ("bert-tiny" if args.cpu else "bert-120m")
    args.seq_len = args.seq_len or (64 if args.cpu else 512)
    args.micro_batch = args.micro_batch or (4 if args.cpu else 64)
    args.steps = args.steps or (2 if args.cpu else 10)
    print(f"{model}: seq {args.seq_len} x micro {args.micro_batch}, "
          f"{'cpu fp32' if args.cpu else torch.cuda.get_device_name() + ' bf16'}, "
          f"torch {torch.__version__}")
    rows = []
    for dropout in args.dropout:
        for mask in args.mask:
            eager, comp = (run(model, dropout, mask, c, args) for c in (False, True))
            rows += [eager, comp]
            mem = ("" if comp["peak_gb"] is None else
                   f"; peak {eager['peak_gb']:.1f} / {comp['peak_gb']:.1f} GiB")
            print(f"  dropout {dropout:<4g} mask {mask:<8} eager {eager['ms']:8.2f} ms, "
                  f"compiled {comp['ms']:8.2f} ms = {comp['ms'] / eager['ms']:.2f} x "
                  f"(compiled attention: {comp['attention']}; compile {comp['warm_s']:.0f} s"
                  f"{mem})")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
