"""Weighted mixtures: the stream math (app/data/mixture.py, tested as math), the sources and their
checks (app/data/sources.py), the mixed loader, and `app train --data W:DIR ...` on one rank and on
two (the real deepspeed launcher) with a resume between."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from app.__main__ import main as app_main
from app.data.loader import (
    DataSpec,
    MixedWindows,
    MixtureSpec,
    TokenWindows,
    batch_samples,
    build_train_loader,
    dataset_stats,
)
from app.data.mixture import Mixture, quantise, source_seed
from tests.conftest import run_data_tools
from tests.helpers import TINY, check, launch, metrics, run_app, snapshot, train_losses

# -- the math --------------------------------------------------------------------------------

def prefix_counts(mixture: Mixture, n: int) -> np.ndarray:
    """[n, sources]: how many of positions [0, i] each source supplied, by brute force."""
    sources, _ = mixture.locate_many(np.arange(n))
    return np.eye(mixture.num_sources, dtype=np.int64)[sources].cumsum(0)


def test_drawn_proportions_track_the_weights():
    sources, _ = Mixture([0.7, 0.3]).locate_many(np.arange(10_000))
    share = np.bincount(sources) / 10_000
    assert share == pytest.approx([0.7, 0.3], abs=0.01)  # the target; in fact:
    assert share == pytest.approx([0.7, 0.3], abs=1e-4)
    for weights in ([0.7, 0.3], [1, 2, 3, 4, 5], [0.001, 0.999], [1] * 50):
        m = Mixture(weights, block=4096)
        n = 2 * m.block + 123
        ideal = np.arange(1, n + 1)[:, None] * m.shares / m.block
        assert np.abs(prefix_counts(m, n) - ideal).max() < 1.5, weights  # every prefix


def test_each_source_reads_its_own_positions_once_in_order():
    for weights in ([0.7, 0.3], [3, 1, 1, 2]):
        m = Mixture(weights, block=64)  # a small block: many blocks in few positions
        n = 10 * m.block + 17
        sources, local = m.locate_many(np.arange(n))
        for s in range(m.num_sources):
            assert local[sources == s].tolist() == list(range(int((sources == s).sum())))
        assert [m.locate(p) for p in range(n)] == list(zip(sources.tolist(), local.tolist()))
        for stop in (0, 1, 63, 64, 65, n):
            assert m.drawn(stop).tolist() == np.bincount(sources[:stop],
                                                         minlength=m.num_sources).tolist()


def test_weights_are_quantised_to_shares_of_a_block():
    assert quantise([0.7, 0.3], 1000).tolist() == [700, 300]
    assert quantise([7, 3], 1000).tolist() == quantise([0.7, 0.3], 1000).tolist()
    assert quantise([1e-9, 1, 1], 10).tolist() == [1, 5, 4]  # at least one each; ties: lower
    assert quantise([1] * 10, 10).tolist() == [1] * 10
    for bad in ([0, 1], [-1, 1], [float("nan"), 1], [float("inf"), 1], []):
        with pytest.raises(ValueError):
            quantise(bad)
    seeds = {source_seed(0, i) for i in range(100)} | {source_seed(1, 0)}
    assert len(seeds) == 101 and source_seed(0, 0) == source_seed(0, 0) and 0 not in seeds


# -- the data --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def json_dataset(stdlib_dir, wordpiece_tokenizer, tmp_path_factory):
    """A small second source (the json package: 5 documents, one of them val), same tokenizer
    as mlm_dataset."""
    out = tmp_path_factory.mktemp("mix") / "small"
    run_data_tools("prepare", "--input", stdlib_dir / "json", "--include", "*.py",
                   "--tokenizer", wordpiece_tokenizer, "--out", out, "--val-fraction", "0.1")
    return out


def mixture_spec(big, small, seed=3, seq_len=32):
    return MixtureSpec((DataSpec(big, "train", seq_len, "mlm", seed=source_seed(seed, 0)),
                        DataSpec(small, "train", seq_len, "mlm", seed=source_seed(seed, 1))),
                       ("big", "small"), (0.7, 0.3))


def test_mixed_windows_read_each_source_with_its_own_order_and_masks(mlm_dataset, json_dataset):
    spec = mixture_spec(mlm_dataset, json_dataset)
    mixed = MixedWindows(spec)
    alone = [TokenWindows(s) for s in spec.sources]
    for p in range(0, 4000, 97):
        s, k = mixed.mixture.locate(p)
        got, want = mixed[p], alone[s][k]
        assert all(torch.equal(got[key], want[key]) for key in want)
    record = batch_samples(spec, 5, 8)
    where = [mixed.mixture.locate(p) for p in range(40, 48)]
    assert record["sources"] == [spec.names[s] for s, _ in where]
    assert record["samples"] == [alone[s].sample_index(k) for s, k in where]
    assert batch_samples(spec.sources[0], 5, 8).keys() == {"samples"}  # one dataset: as ever


def test_mixed_loader_gives_the_same_stream_to_any_world_size(mlm_dataset, json_dataset):
    spec = mixture_spec(mlm_dataset, json_dataset)

    def batches(rank, world, n):
        loader = build_train_loader(spec, micro_batch=2, global_batch=8, dp_rank=rank,
                                    dp_size=world, consumed_samples=16, num_workers=0)
        it = iter(loader)
        return [next(it)["input_ids"] for _ in range(n)]

    one, ranks = batches(0, 1, 8), [batches(r, 2, 4) for r in range(2)]
    for g in range(2):  # global batch g: rank 0's 2 micro batches, then rank 1's
        expected = torch.cat(one[4 * g:4 * g + 4])
        got = torch.cat(ranks[0][2 * g:2 * g + 2] + ranks[1][2 * g:2 * g + 2])
        assert torch.equal(expected, got)


# -- bad input: one line, exit 2, nothing written ---------------------------------------------

def mixture_file(tmp_path, sources) -> str:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": sources}))
    return str(path)


BAD = {
    "not a number": (lambda d, t: [f"x:{d['big']}", f"0.3:{d['small']}"],
                     ["--data x:", "weight 'x' is not a number"]),
    "zero": (lambda d, t: [f"0:{d['big']}", f"0.3:{d['small']}"],
             ["weight '0' must be a finite number above 0"]),
    "nan": (lambda d, t: [f"0.7:{d['big']}", f"nan:{d['small']}"], ["weight 'nan'"]),
    "inf": (lambda d, t: [f"inf:{d['big']}", f"0.3:{d['small']}"], ["weight 'inf'"]),
    "no weights": (lambda d, t: [str(d["big"]), str(d["small"])], ["WEIGHT:DIR"]),
    "missing": (lambda d, t: [f"0.7:{d['big']}", f"0.3:{t / 'nope'}"],
                ["nope: no such dataset directory"]),
    "twice": (lambda d, t: [f"0.7:{d['big']}", f"0.3:{d['big']}/."], ["listed twice"]),
    "a copy": (lambda d, t: [f"0.7:{d['small']}", f"0.3:{d['copy']}"],
               ["hold the same dataset"]),
    "tokenizer": (lambda d, t: [f"0.7:{d['big']}", f"0.3:{d['clm']}"],
                  ["made with another tokenizer", "dataset.json"]),
    "file weight": (lambda d, t: [mixture_file(t, [{"path": str(d["big"]), "weight": 1},
                                                   {"path": str(d["small"]), "weight": -2}])],
                    ["mix.json: sources[1]", "weight -2 must be a finite number above 0"]),
    "file quoted weight": (lambda d, t: [mixture_file(t, [{"path": str(d["big"]), "weight": "1"},
                                                          {"path": "x", "weight": 1}])],
                           ["mix.json: sources[0]", "is not a number"]),
    "file missing dataset": (lambda d, t: [mixture_file(t, [{"path": str(d["big"]), "weight": 1},
                                                            {"path": "nope", "weight": 1}])],
                             ["mix.json: sources[1]", "no such dataset directory"]),
    "file name": (lambda d, t: [mixture_file(t, [{"path": str(d["big"]), "weight": 1,
                                                  "name": "a/b"},
                                                 {"path": str(d["small"]), "weight": 1}])],
                  ["mix.json: sources[0]: name 'a/b'"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_mixtures_are_one_line_and_write_nothing(case, mlm_dataset, json_dataset,
                                                     clm_dataset, tmp_path, one_line_error):
    copy = tmp_path / "copy"
    if case == "a copy":
        shutil.copytree(json_dataset, copy)
    data, needles = BAD[case]
    argv = data({"big": mlm_dataset, "small": json_dataset, "clm": clm_dataset, "copy": copy},
                tmp_path)
    out = tmp_path / "run"
    assert app_main(["train", "--data", *argv, "--out", str(out), *TINY]) == 2
    one_line_error(*needles)
    assert not out.exists()


# -- app train: one rank and two, a resume between --------------------------------------------

STEPS = 4
COMMON = [*TINY, "--max-steps", str(STEPS), "--log-every", "1", "--eval-every", "2",
          "--save-every", "2", "--dropout", "0", "--seed", "5"]


@pytest.fixture(scope="module")
def mixture_runs(mlm_dataset, json_dataset, tmp_path_factory):
    """0.7:mlm 0.3:small at a global batch of 8: one rank (grad-accum 2, staged to a node-local
    dir), and two ranks stopped at step 2 and resumed (the real launcher)."""
    root = tmp_path_factory.mktemp("mixture_runs")
    data = ["--data", f"0.7:{mlm_dataset}", f"0.3:{json_dataset}"]
    check(run_app("train", *data, "--out", root / "one", *COMMON, "--grad-accum", "2",
                  "--stage-to", root / "local"))
    check(launch("train", *data, "--out", root / "two", *COMMON, "--stop-at-step", "2"))
    assert max(train_losses(root / "two")) == 2
    check(launch("train", *data, "--out", root / "two", *COMMON))
    return root


@pytest.mark.slow
@pytest.mark.multirank
def test_one_rank_and_two_resumed_train_on_the_same_mixture(mixture_runs):
    one, two = train_losses(mixture_runs / "one"), train_losses(mixture_runs / "two")
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    epochs = {m["step"]: (m["data/mlm/epoch"], m["data/small/epoch"])
              for m in metrics(mixture_runs / "one") if "train/loss" in m}
    assert epochs == {m["step"]: (m["data/mlm/epoch"], m["data/small/epoch"])
                      for m in metrics(mixture_runs / "two") if "train/loss" in m}
    # each source's epochs: the samples it supplied over its train samples
    config = json.loads((mixture_runs / "one" / "config.json").read_text())
    sources = config["data"]["mixture"]
    assert [s["name"] for s in sources] == ["mlm", "small"]
    assert [s["weight"] for s in sources] == [0.7, 0.3]
    drawn = Mixture([0.7, 0.3]).drawn(STEPS * 8).tolist()
    for s, n, epoch in zip(sources, drawn, epochs[STEPS]):
        local = mixture_runs / "local" / s["name"]  # --stage-to: a copy per source
        assert s["read_from"] == str(local)
        assert s["fingerprint"] == json.loads((local / "dataset.json").read_text())["fingerprint"]
        per_epoch = dataset_stats(DataSpec(local, "train", 64, "mlm"))["num_samples"]
        assert epoch == pytest.approx(n / per_epoch, abs=1e-6)
    evals = [m for m in metrics(mixture_runs / "two") if "eval/loss" in m]
    assert [m["step"] for m in evals] == [2, 4]
    for m in evals:
        assert {"eval/mlm/loss", "eval/small/loss", "eval/accuracy", "eval/perplexity"} <= set(m)
        assert m["eval/loss"] == pytest.approx(0.7 * m["eval/mlm/loss"]
                                               + 0.3 * m["eval/small/loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.multirank
def test_resume_refuses_a_changed_mixture(mixture_runs, mlm_dataset, json_dataset,
                                          one_line_error):
    run = mixture_runs / "two"
    before = snapshot(run)
    for data in ([f"0.5:{mlm_dataset}", f"0.5:{json_dataset}"], [str(mlm_dataset)],
                 [f"0.3:{json_dataset}", f"0.7:{mlm_dataset}"]):
        assert app_main(["train", "--data", *data, "--out", str(run), *COMMON]) == 2
        one_line_error("refusing to resume on a changed mixture", "global_step4")
    assert snapshot(run) == before
