"""The step-time model (ablate/predict/step_time.py) and its device table (ablate/hardware.py): what
a step does grows as it should (recompute, offload, batch), devices are found by the names a GPU
reports and gpu_model takes, an unknown card gives no time, a bad gpu_model is refused naming the
key and its choices, and a plan's result.json carries prediction.step_time_s."""
from __future__ import annotations

import dataclasses

import pytest

from ablate import hardware
from ablate.predict.step_time import Work, device_of, parts, seconds, step_time_s, work_of
from ablate.command_line import unknown_key
from helpers import compose_spec, results_under, run_cli

H100 = hardware.device("h100-sxm")
# gpt2 at a size a GPU's matmuls, not its host, bound: the compute the assertions below compare.
BIG = ["model=gpt2", "device=cuda", "batch_size=8", "seq_len=1024", "predict_only=true"]


def work(*overrides: str) -> Work:
    return work_of(compose_spec([*BIG, *overrides]))


def test_recompute_adds_the_forward_it_runs_again():
    plain, blocks, every2 = work(), work("checkpoint=block"), work("checkpoint=block", "checkpoint.every_n=2")
    # Block recompute runs every block's forward again: their share of the matmul weights (all but
    # the head's 38.6M of 124M), a third of the 6N count each.
    assert blocks.flops / plain.flops == pytest.approx(1 + (1 - 50257 * 768 / 124_475_904) / 3, rel=0.02)
    assert plain.flops < every2.flops < blocks.flops
    assert blocks.host_layers == pytest.approx(2 * plain.host_layers, rel=0.1)  # launched twice
    assert seconds(plain, H100) < seconds(every2, H100) < seconds(blocks, H100)


def test_a_tiled_mlp_runs_its_forward_again_and_makes_its_tensors_all_the_same():
    plain, tiled, both = work(), work("tiling=mlp"), work("tiling=mlp", "checkpoint=block")
    mlps = 12 * 2 * 768 * 3072  # c_fc's and c_proj's weights in 12 blocks
    assert tiled.flops - plain.flops == pytest.approx(2 * mlps * 8 * 1024, rel=1e-6)
    assert tiled.memory_bytes > plain.memory_bytes  # the slices' tensors, made twice
    assert both.flops - work("checkpoint=block").flops == pytest.approx(tiled.flops - plain.flops, rel=1e-6)
    assert seconds(plain, H100) < seconds(tiled, H100)
    # one slice is the untiled MLP: nothing runs again
    assert work("tiling=mlp", "tiling.chunks=1").flops == plain.flops


def test_the_chunked_loss_runs_its_head_again_and_the_fused_one_does_not():
    plain, chunked, fused = work(), work("loss=chunked"), work("loss=fused")
    head = 6 * 50257 * 768 * 8 * 1024
    assert chunked.flops - plain.flops == pytest.approx(head / 3, rel=1e-6)
    assert fused.flops == plain.flops


def test_activation_offload_adds_the_host_links_time():
    plain, offloaded = work("precision=bf16"), work("precision=bf16", "offload=activations")
    assert plain.link_bytes == 0 and offloaded.link_bytes > 0
    assert offloaded.flops == plain.flops
    link = offloaded.link_bytes / (H100.link_gbs * 1e9 * hardware.LINK_EFFICIENCY)
    assert parts(offloaded, H100)["device"] - parts(plain, H100)["device"] == pytest.approx(link, rel=1e-9)
    # A slower link, a slower step.
    slow = dataclasses.replace(H100, link_gbs=H100.link_gbs / 2)
    assert seconds(offloaded, slow) > seconds(offloaded, H100) == pytest.approx(seconds(plain, H100) + link)


def test_optimizer_offload_moves_the_step_to_the_host():
    plain, offloaded = work("precision=bf16"), work("precision=bf16", "offload=optimizer")
    assert plain.step_bytes > 0 and plain.step_host_bytes == plain.step_link_bytes == 0
    assert offloaded.step_bytes == 0 and offloaded.step_host_bytes > 0 and offloaded.step_link_bytes > 0
    assert seconds(offloaded, H100) > seconds(plain, H100)


def test_a_batch_twice_as_large_is_twice_the_compute():
    small, large = work("batch_size=8"), work("batch_size=16")
    assert large.flops == 2 * small.flops and large.memory_bytes == 2 * small.memory_bytes
    # Accumulation: the same micro-step, twice.
    twice = work("batch_size=16", "accumulation=x2")
    assert (twice.micro_steps, twice.flops) == (2, small.flops)
    # Where the device bounds the step, its time follows, less the optimizer step's fixed share.
    split_small, split_large = parts(small, H100), parts(large, H100)
    assert split_small["device"] > split_small["host"]
    step = small.step_bytes / (H100.memory_gbs * 1e9 * hardware.HBM_EFFICIENCY)
    assert split_large["device"] - step == pytest.approx(2 * (split_small["device"] - step), rel=0.05)


def test_bf16_on_tensor_cores_is_faster_than_fp32_and_an_h100_than_an_a100():
    fp32, bf16 = work(), work("precision=bf16", "model.pad_vocab_to=64")
    assert seconds(bf16, H100) < seconds(fp32, H100) / 3
    assert seconds(bf16, hardware.device("a100")) > seconds(bf16, H100)


def test_an_unaligned_16_bit_head_is_slower_until_padded():
    unaligned, padded = work("precision=bf16"), work("precision=bf16", "model.pad_vocab_to=64")
    assert unaligned.unaligned_flops > 0 and padded.unaligned_flops == 0
    assert seconds(unaligned, H100) > seconds(padded, H100)
    assert work().unaligned_flops == 0  # fp32 runs on the CUDA cores: no alignment to break


@pytest.mark.parametrize("name, device", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA GeForce RTX 3090", "rtx-3090"),
    ("h100-sxm", "h100-sxm"), ("rtx-3090", "rtx-3090"),
])
def test_a_device_is_found_by_the_name_a_gpu_reports_or_by_its_own(name, device):
    assert hardware.device(name).name == device


def test_every_card_has_bandwidths_and_peaks():
    for d in [*hardware.DEVICES, hardware.CPU]:
        assert d.memory_gbs > 0 and d.peak_tflops("fp32") and d.peak_tflops("bf16"), d.name
    assert hardware.device("h100-pcie").peak_tflops("bf16") == 756.0  # its own row, not the SXM's
    assert hardware.device("rtx-3090").peak_tflops("bf16", override=100) == 100


@pytest.mark.parametrize("name", ["NVIDIA L40S", "Tesla V100-SXM2-16GB", "Mystery GPU", ""])
def test_an_unknown_card_has_no_step_time(name):
    assert hardware.device(name) is None  # "l4" is a whole word: not the L40S
    spec = compose_spec(["model=gpt-nano", "device=cuda"])
    assert device_of(spec, name or None) is (None if name else hardware.device(hardware.PLANNED))
    if name:
        assert step_time_s(spec, name) is None


def test_the_card_is_gpu_model_else_the_one_in_sight_else_an_h100():
    plan = ["model=gpt-nano", "device=cuda"]
    assert device_of(compose_spec(plan), None).name == "h100-sxm"
    assert device_of(compose_spec(plan), "NVIDIA L4").name == "l4"
    assert device_of(compose_spec([*plan, "gpu_model=rtx-4090"]), "NVIDIA L4").name == "rtx-4090"
    assert device_of(compose_spec(["model=gpt-nano", "device=cpu"]), "NVIDIA L4") is hardware.CPU
    on = {name: step_time_s(compose_spec([*BIG, f"gpu_model={name}"])) for name in ("h100-sxm", "l4")}
    assert 0 < on["h100-sxm"] < on["l4"]


@pytest.mark.parametrize("value", ["H100", "a100-80gb", "cpu"])
def test_a_gpu_model_no_table_has_is_refused_naming_the_key_and_the_choices(value):
    error = unknown_key([f"gpu_model={value}"])
    assert error.startswith(f"gpu_model='{value}' must be one of ")
    assert all(d.name in error for d in hardware.DEVICES)
    assert unknown_key(["gpu_model=h200"]) is None and unknown_key(["gpu_model=null"]) is None


def test_a_plan_on_a_machine_without_a_gpu_records_its_step_time(tmp_path):
    proc = run_cli(["-m", *BIG, "gpu_model=null,a100"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]["gpu_model"]: r for r in results_under(tmp_path)}
    assert set(rows) == {None, "a100"} and all(r["status"] == "predicted" for r in rows.values())
    times = {k: r["prediction"]["step_time_s"] for k, r in rows.items()}
    assert all(isinstance(t, float) and t > 0 for t in times.values())
    assert times["a100"] > times[None]  # null plans for an H100 SXM
    assert rows[None]["run_id"] != rows["a100"]["run_id"]  # two plans, two rows in a report


def test_gpu_model_is_in_run_id_only_when_set_so_earlier_results_keep_theirs():
    from ablate.results import run_id
    from ablate.schema import identity

    config = {"batch_size": 8, "seq_len": 64, "out_dir": "outputs"}
    assert run_id(identity({**config, "gpu_model": None})) == run_id(identity(config))
    assert run_id(identity({**config, "gpu_model": "a100"})) != run_id(identity(config))


def test_a_point_predicted_to_take_minutes_here_says_so_before_its_first_step():
    import io

    from ablate.console import Progress
    from ablate.outcome import _say_if_long, predicted

    def said(overrides):
        spec = compose_spec(["device=cpu", *overrides])
        stream = io.StringIO()
        _say_if_long(spec, predicted(spec), Progress("p", stream), on_gpu=False)
        return stream.getvalue()

    line = said(["model=gpt2", "batch_size=16", "seq_len=1024", "steps=50"])  # GPU-sized, on a CPU
    assert line.startswith("p  predicted: ") and "s a step on this CPU and a peak of 20,172 MiB" in line
    assert "for its 52 steps; predict_only=true plans it in seconds" in line  # warm-up steps counted
    assert said(["model=gpt-nano"]) == ""  # seconds: nothing to say


def test_a_point_is_sized_once_for_its_memory_and_its_time_and_a_changed_one_again():
    """The analytic model and the step-time model read one sizing of the same spec (its options
    built once); a spec changed by `replace` (the batch search's) is sized anew."""
    from ablate.predict.analytic import analytic, sized

    spec = compose_spec(BIG)
    analytic(spec)
    first = sized(spec)
    work_of(spec)
    assert sized(spec) is first  # the step-time model read the memory model's sizing
    bigger = spec.replace(batch_size=16)
    assert sized(bigger) is not first and sized(bigger)[1].b == 2 * first[1].b
    # going back to the first spec sizes it again, and gives its own (smaller) peak
    assert analytic(bigger).peak_mib > analytic(spec).peak_mib
