"""The experiment presets (conf/experiment/): each composes, has its benchmark script, and plans at
full size without a GPU (predict_only). Each runs scaled down on a CPU, its page rendered from that
run, in tests/test_scale.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from ablate import results
from tests.helpers import CONF, ROOT, compose_spec, results_under, run_cli, slow_except

# preset -> (model, rungs of its ladder (None: a plain grid), grid points it runs)
PRESETS = {
    "gpt2_large_ladder": ("gpt2-large", 7, 7),
    "gpt2_xl_fsdp_batch_scan": ("gpt2-xl", 3, 14),
    "single_gpu_techniques": ("gpt2", 11, 11),
    "layer_recompute": ("gpt-nano", 6, 6),
    "leanest": ("gpt2-large", 7, 7),
    "gpt2_throughput": ("gpt2", None, 4),
    "predict_check": ("gpt2", None, 16),
    "fit_llama_1b": ("llama3.2-1b", 6, 18),
    "fit_llama_8b": ("llama3.1-8b", 15, 45),
    "full_7b": ("llama3.1-8b", 26, 104),
    "optimizers": ("gpt-mini", 20, 20),
    "long_context": ("llama3.2-1b", 9, 18),
    "groups_check": ("llama3.2-1b", 24, 24),
}
def test_every_preset_is_listed_here():
    assert sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")) == sorted([*PRESETS, "demo", "batch_scan"])


def test_every_preset_here_has_its_benchmark_script():
    """A GPU host runs a preset through benchmarks/<preset>.py (benchmarks/gpu_host.sh names it)."""
    assert [p for p in PRESETS if f'run("{p}"' not in (ROOT / "benchmarks" / f"{p}.py").read_text()] == []


@pytest.mark.slow
def test_a_preset_measured_in_parts_gets_a_page_per_part(tmp_path):
    """--page names the page, so the parts of a long ladder (hydra.sweeper.only) do not overwrite each other."""
    out = subprocess.run([sys.executable, "benchmarks/fit_llama_8b.py", "gpu_memory_gib=8", "hydra.sweeper.only=[4,7]",
                          "predict_only=true", "device=cuda", "--page", "fit_llama_8b_8gib", "--results",
                          str(tmp_path / "results"), "--sweep-dir", str(tmp_path / "sweep")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(r["config"]["rung"] for r in results_under(tmp_path / "sweep")) == [4, 7]
    (page,) = (tmp_path / "results" / "cpu").glob("*.md")
    assert page.name == "fit_llama_8b_8gib.md" and "hydra.sweeper.only=[4,7]" in page.read_text()


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes(preset):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    model, rungs, _ = PRESETS[preset]
    assert cfg.model.name == model
    assert (len(cfg.hydra.sweeper.rungs) if "rungs" in cfg.hydra.sweeper else None) == rungs


def test_cfg_job_prints_a_preset():
    out = subprocess.run([sys.executable, "-m", "ablate", "experiment=gpt2_xl_fsdp_batch_scan", "--cfg", "job"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "name: gpt2-xl" in out.stdout and "backward_prefetch: post" in out.stdout


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """preset -> its grid at full size, predicted for one GPU and not run: results in rung order
    (each preset planned once for the module)."""
    planned: dict[str, list[dict]] = {}

    def get(preset: str) -> list[dict]:
        if preset not in planned:
            tmp = tmp_path_factory.mktemp(preset)
            out = run_cli(["-m", f"experiment={preset}", "predict_only=true", "device=cuda", "parallel.nproc=1",
                           f"hydra.sweep.dir={tmp}/s"], tmp, fast=False)
            assert out.returncode == 0, out.stderr
            runs = results_under(tmp / "s")
            # a point that fits no micro-batch of the card (find_batch) is an oom that never ran
            assert all(r["status"] == "predicted" or results.predicted_oom(r) for r in runs)
            planned[preset] = sorted(runs, key=lambda r: (r["config"]["rung"] or 0, r["config"]["batch_size"],
                                                          r["config"]["compile"]))
        return planned[preset]
    return get


def peaks(runs: list[dict]) -> list[float]:
    return [r["prediction"]["peak_mib"] for r in runs]


# The default suite plans the presets the tests below read; the rest plan under -m slow.
@pytest.mark.parametrize("preset", slow_except(PRESETS, "gpt2_large_ladder", "gpt2_xl_fsdp_batch_scan", "leanest"))
def test_preset_plans_its_full_size_grid_without_a_gpu(preset, plan):
    runs = plan(preset)
    assert len(runs) == PRESETS[preset][2]
    assert PRESETS[preset][0] in {r["choices"]["model"] for r in runs}


@pytest.mark.slow
def test_fit_llama_1b_plans_which_combination_fits_which_card(plan):
    """Every combination judged on each card by find_batch over predictions: more memory never
    fits a smaller micro-batch, and pure bf16 + block recompute fits a 24 GiB card."""
    fits = {}
    for r in plan("fit_llama_1b"):
        c = r["config"]
        fits[(c["rung"], c["gpu_memory_gib"])] = r["metrics"]["max_batch_size"] or 0
    for rung in range(6):
        assert fits[(rung, 8.0)] <= fits[(rung, 16.0)] <= fits[(rung, 24.0)]
    assert fits[(2, 24.0)] >= 1 and fits[(0, 24.0)] == 0  # bf16_pure + block fits; bf16 autocast alone does not


@pytest.mark.slow
def test_long_context_plans_the_published_lengths(plan):
    """Each technique lengthens the longest sequence a card fits (find_seq over predictions), and
    the leanest rungs plan past the published anchors: Llama 3.1 8B QLoRA past Unsloth's 342K
    tokens on 80 GiB, Llama 3.2 1B full-parameter past 128K on 24 GiB."""
    longest = {(r["config"]["rung"], r["config"]["gpu_memory_gib"]): r["metrics"]["max_seq_len"]
               for r in plan("long_context")}
    for card in (24.0, 80.0):
        plain, block, chunked, tiled, offloaded, math, qlora, qlora_tiled, qlora_offloaded = (
            longest[(rung, card)] for rung in range(9))
        assert plain < block < chunked <= tiled < offloaded and math < chunked
        assert qlora < qlora_tiled < qlora_offloaded
    assert longest[(8, 80.0)] >= 342 * 1024 and longest[(4, 24.0)] >= 128 * 1024


@pytest.mark.slow
def test_fit_llama_8b_plans_full_lora_and_qlora_per_card(plan):
    """Llama 3.1 8B at batch 2 x 2048 (rungs 0-7) and 1 x 8192 (8-14): the full fine-tunes need more
    than 24 GiB (16 GB of bf16 weights and as much again of states or gradients); LoRA fits 24 GiB
    and not 16; QLoRA fits 8 GiB at 2 x 2048 and needs less with the layer inputs on the host, less
    again with its MLP tiled, and in two micro-batches of one at most 6 GiB; the rank-64 adapters
    cost more than the rank-8 ones."""
    fits, peak = {}, {}
    for r in plan("fit_llama_8b"):
        c = r["config"]
        fits[(c["rung"], c["gpu_memory_gib"])] = r["metrics"]["max_batch_size"] or 0
        peak[(c["rung"], c["gpu_memory_gib"])] = r["prediction"]["peak_mib"]
    for rung in range(15):
        assert fits[(rung, 8.0)] <= fits[(rung, 16.0)] <= fits[(rung, 24.0)]
    assert fits[(0, 24.0)] == fits[(1, 24.0)] == fits[(8, 24.0)] == 0  # full fine-tunes
    assert fits[(2, 24.0)] == 2 and fits[(2, 16.0)] == 0  # LoRA r=8
    assert fits[(4, 8.0)] >= 1 and fits[(5, 8.0)] == fits[(6, 8.0)] == 2  # QLoRA; offloaded; tiled
    assert peak[(7, 8.0)] <= 6 * 1024 < peak[(6, 24.0)] < peak[(5, 24.0)] < peak[(4, 24.0)] < peak[(2, 24.0)] \
        < peak[(3, 24.0)]
    assert fits[(12, 8.0)] == 0 and fits[(14, 8.0)] == 1  # QLoRA at 1 x 8192 on 8 GiB: only tiled


def test_ladder_rungs_save_what_they_promise(plan):
    b32, b64, b128, accum, block, forloop, fsdp = peaks(plan("gpt2_large_ladder"))
    assert b32 < b64 < b128  # activations grow with the batch
    assert accum < b32 * 1.2  # 4 micro-batches of 32: about the batch-32 peak
    assert block < accum  # recompute keeps one block's activations
    assert forloop <= block


def test_batch_scan_grows_with_the_batch_and_recompute_shrinks_it(plan):
    runs = plan("gpt2_xl_fsdp_batch_scan")
    for rung in (0, 1, 2):
        scan = peaks([r for r in runs if r["config"]["rung"] == rung])
        assert scan == sorted(scan)
    at_8 = {r["config"]["rung"]: r["prediction"]["peak_mib"] for r in runs if r["config"]["batch_size"] == 8}
    assert at_8[1] < at_8[0]


def test_leanest_is_a_fraction_of_the_baseline(plan):
    baseline, lean8bit, chunked, lean4bit, adafactor, apollo_mini, host = peaks(plan("leanest"))
    assert lean8bit < baseline / 4 and chunked < lean8bit and lean4bit < lean8bit and apollo_mini < lean4bit
    # gpt2-large's quantised wte (64M elements) makes 4-bit's compiled step keep ~26 B/element of
    # temporaries at once (the predictor's figure, read from inductor's CPU code): more than the
    # 8-bit states it saves on this model, not on gpt2-xl (whose wte stays unquantised).
    assert host == min(baseline, lean8bit, chunked, lean4bit, adafactor, apollo_mini, host)


def test_leanest_trains_gpt2_xl_with_an_adamw_class_optimizer_in_6_gib_and_apollo_mini_in_4_5():
    """The leanest preset's goals, planned on a CPU: gpt2-xl at batch 8 x seq 1024 under 6 GiB with
    4-bit AdamW states (not Adafactor, whose loss was 30% worse: benchmarks/results/
    NVIDIA-H100-80GB-HBM3/leanest.md), and under 4.5 GiB with APOLLO-Mini's rank-1 states at
    AdamW's hyperparameters (gpt-mini's 500-step eval loss: 3% under AdamW's on the synthetic data,
    12% over on text: benchmarks/results/cpu/optimizers.md, optimizers_text.md)."""
    from omegaconf import OmegaConf

    from ablate.predict.analytic import analytic

    preset = OmegaConf.load(CONF / "experiment" / "leanest.yaml")
    under = {}
    for rung in preset.hydra.sweeper.rungs:
        keys = [f"{k}={v}".replace("True", "true") for k, v in rung.items()]
        spec = compose_spec(["model=gpt2-xl", "device=cuda", "batch_size=8", "seq_len=1024", *keys])
        under[rung.get("optimizer", "adamw")] = analytic(spec).peak_mib / 1024
    assert under["adamw4bit"] <= 6 < under["adamw8bit"] and under["apollo_mini"] <= 4.5


def test_full_7b_plans_a_7b_model_under_17_gib_on_the_card_and_under_8_gib_offloaded():
    """Full-parameter training at batch 2 x 2048, planned on a CPU. Mistral 7B with its bf16 weights
    on the card (13.5 GiB): LOMO, APOLLO-Mini and AdaLomo, stepped in backward, under 17 GiB,
    where torchtune's 8-bit AdamW recipe needs more than 24. Llama 3.1 8B's 128K-token embedding and head
    (0.5 B parameters each) hold every on-card plan above 17 GiB: a gradient of one of them, with
    LOMO's fp32 copies of it (4 GiB) or Adafactor's temporary, is alive as it is stepped. With
    parameters, gradients and states in host memory AdamW plans under 8 GiB for both."""
    from omegaconf import OmegaConf

    from ablate.predict.analytic import analytic

    preset = OmegaConf.load(CONF / "experiment" / "full_7b.yaml")
    peaks = {}
    for model in ("mistral-7b", "llama3.1-8b"):
        for rung in preset.hydra.sweeper.rungs:
            if rung.batch_size == 2:
                keys = [f"{k}={v}".replace("True", "true") for k, v in rung.items()]
                spec = compose_spec(["experiment=full_7b", f"model={model}", "device=cuda", *keys])
                peaks[(model, rung.optimizer, rung.get("offload", "none"))] = analytic(spec).peak_mib / 1024
    assert all(peaks[("mistral-7b", o, "none")] <= 17 for o in ("lomo", "apollo_mini", "adalomo"))
    assert peaks[("mistral-7b", "adamw8bit", "none")] > 24
    assert 17 < min(v for (m, _, offload), v in peaks.items() if m == "llama3.1-8b" and offload != "params") < 17.1
    assert all(peaks[(m, "adamw", "params")] <= 8 for m in ("mistral-7b", "llama3.1-8b"))


# groups_check on a CPU: the preset's rungs over a 2-layer Llama of width 64.
TINY_LLAMA = ["model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.intermediate_size=128",
              "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.head_dim=16",
              "model.config.vocab_size=512", "data.vocab_size=512", "batch_size=2", "seq_len=128", "steps=2",
              "device=cpu"]


@pytest.mark.slow
def test_groups_check_benchmark_on_a_cpu(tmp_path):
    """The page a GPU host records, made on a CPU from one rung of each kind (each option's own tests
    check the rest on a CPU): every rung a CPU can run is predicted within 2% of MemTracker's peak, and
    each GPU-only kernel is an invalid row that says it needs CUDA."""
    rungs = [0, 4, 5, 8, 12, 14, 21, 23]  # the base; QLoRA offloaded and tiled; flash; math; overlap; Muon; Liger
    out = subprocess.run([sys.executable, "benchmarks/groups_check.py", "--results", str(tmp_path / "results"),
                          "--sweep-dir", str(tmp_path / "sweep"), f"out_dir={tmp_path}", *TINY_LLAMA,
                          f"hydra.sweeper.only=[{','.join(map(str, rungs))}]"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = results_under(tmp_path / "sweep")
    assert sorted(r["config"]["rung"] for r in runs) == rungs
    invalid = {r["reason"].split(" ", 1)[0] for r in runs if r["status"] == "invalid"}
    assert invalid == {"attention=flash", "loss=liger", "kernels=liger"}
    assert all("CUDA" in r["reason"] for r in runs if r["status"] == "invalid")
    ok = [r for r in runs if r["status"] == "ok"]
    assert len(ok) == len(runs) - len(invalid)
    for r in ok:
        assert r["prediction"]["peak_mib"] == pytest.approx(r["metrics"]["peak_allocated_mib"], rel=0.02), \
            r["overrides"]
    md = (tmp_path / "results" / "cpu" / "groups_check.md").read_text()
    assert md.startswith("# groups_check on CPU") and "Prediction error" in md


def test_a_recorded_page_names_the_snapshots_left_with_the_sweep_instead_of_dead_links():
    """A CUDA sweep's report links each run's allocator snapshot as ../<run>/memory_snapshot.pickle
    (from the sweep's report/); copied to benchmarks/results/<device>/ those links led nowhere."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench  # benchmarks/ is no package

    body = ("| a / 32 | ok | [memory_snapshot.pickle](../batch_size=32/memory_snapshot.pickle) | |\n"
            "![pareto](gpt2_large_ladder/pareto.png) [memory_viz](https://pytorch.org/memory_viz)\n")
    out = bench.left_behind(body, "outputs/benchmarks/gpt2_large_ladder/t")
    assert out == ("| a / 32 | ok | `outputs/benchmarks/gpt2_large_ladder/t/batch_size=32/memory_snapshot.pickle` | |\n"
                   "![pareto](gpt2_large_ladder/pareto.png) [memory_viz](https://pytorch.org/memory_viz)\n")
