"""predict=trace: the real training step on fake tensors. On the CPU it must reproduce a real
traced step byte for byte; options it cannot follow raise Untraceable; it leaves nothing behind."""
from __future__ import annotations

import resource

import pytest
import torch
from hydra.utils import instantiate
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp._fully_shard import _fully_shard
from torch.optim import optimizer as torch_optim
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ablate import measure
from ablate.build import Techniques, build_model, build_optimizer, check_config
from ablate.models.gpt_module import GPTModule
from ablate.predict.trace import Untraceable, trace
from ablate.train import train_step
from tests.helpers import compose_config, compose_spec, hf_toy, results_under, run_cli

# Small enough to trace and run in about a second, big enough that activations (batch 8 x 64
# tokens through 6 blocks) rival the AdamW states, so both the backward and the step can peak.
SMALL = ["model=gpt-mini", "model.vocab_size=512", "batch_size=8", "seq_len=64", "device=cpu"]
XL_PARAMS = 1_557_611_200  # gpt2-xl, the tied lm_head counted once


def real_step(cfg) -> measure.Trace:
    """What a worker measures on the CPU: build for real, one step, then the traced second step."""
    t = check_config(cfg, "cpu")
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(t, device)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")
    B, T, V = cfg.batch_size, cfg.seq_len, t.model.vocab_size

    def step() -> torch.Tensor:
        batch = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
        return train_step(model, optimizer, scaler, t, batch, device)

    step()
    return measure.traced_step(step, model, optimizer, device)


def meta_model(overrides: list[str]) -> GPTModule:
    """The config's model on the meta device: shapes only."""
    return instantiate(compose_config(overrides)["model"]).meta_model


def n_params(overrides: list[str]) -> int:
    return meta_model(overrides).num_params()  # the tied lm_head counted once


@pytest.mark.parametrize("overrides", [
    ["optimizer=adamw"],
    ["optimizer=sgd", "checkpoint=block"],
    # the three slowest (10-13 s each) in `make test-slow`
    pytest.param(["optimizer=adafactor", "accumulation=x4"], marks=pytest.mark.slow),
    pytest.param(["optimizer=adamw_foreach", "precision=bf16_pure", "precision.init_on_device=true"],
                 marks=pytest.mark.slow),
    pytest.param(["precision=bf16", "checkpoint=ops", "optimizer.in_backward=true"], marks=pytest.mark.slow),
    ["optimizer=adamw8bit", "checkpoint=mlp"],
], ids=lambda o: ",".join(o))
def test_trace_is_the_real_cpu_step_byte_for_byte(overrides):
    if "optimizer=adamw8bit" in overrides:
        pytest.importorskip("bitsandbytes")
    cfg = compose_spec([*SMALL, *overrides])
    predicted, real = trace(cfg), real_step(cfg)
    # Fake tensors have the real shapes, dtypes and aliasing, so MemTracker sees the same
    # allocations in the same order: equal, not close (the same byte counts / 2**20).
    assert predicted.category_max_mib == real.category_max
    assert predicted.breakdown_mib == real.at_peak
    assert predicted.peak_mib == real.peak_mib
    assert predicted.steady_mib == real.after
    assert predicted.method == "trace"


@pytest.fixture(scope="module")
def single():
    return trace(compose_spec(SMALL))


def test_ddp_rank_is_a_single_process_plus_one_gradient_copy_of_buckets(single):
    ddp = trace(compose_spec([*SMALL, "parallel=ddp", "parallel.nproc=2"]))
    buckets = n_params(SMALL) * 4 / 2**20  # fp32 gradients, every parameter in some bucket
    assert ddp.peak_mib == pytest.approx(single.peak_mib + buckets, rel=1e-12)
    assert ddp.breakdown_mib["other"] == pytest.approx(single.breakdown_mib["other"] + buckets, rel=1e-12)
    assert {k: v for k, v in ddp.category_max_mib.items() if k != "other"} == \
        {k: v for k, v in single.category_max_mib.items() if k != "other"}


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_rank_holds_a_shard_of_the_states(single, nproc):
    fsdp = trace(compose_spec([*SMALL, "parallel=fsdp", f"parallel.nproc={nproc}"]))
    # gpt-mini's dim-0 sizes all divide by 4, so every AdamW state tensor is exactly 1/nproc of the
    # single process's; only the 0-d fp32 step counters (one per parameter tensor, on the host
    # device) are whole on every rank.
    steps = len(list(meta_model(SMALL).parameters())) * 4 / 2**20
    assert fsdp.steady_mib["optimizer"] == \
        pytest.approx((single.steady_mib["optimizer"] - steps) / nproc + steps, rel=1e-12)
    # The step's temporaries are torch's own: from 2.13 the foreach step on DTensor shards them
    # too. torch 2.11 keeps more (2.625 MiB per rank at nproc=2 against 1.875 MiB in one process,
    # seen on 2.11.0): bounded there by the single process's temporaries plus two blocks' fp32 weights.
    temporaries = fsdp.category_max_mib["optimizer"] - fsdp.steady_mib["optimizer"]
    single_temporaries = single.category_max_mib["optimizer"] - single.steady_mib["optimizer"]
    if torch.__version__ >= "2.13":
        assert temporaries == pytest.approx(single_temporaries / nproc, rel=1e-9)
    else:
        block_mib = sum(p.numel() for p in meta_model(SMALL).transformer.h[0].parameters()) * 4 / 2**20
        assert 0 < temporaries < single_temporaries + 2 * block_mib
    assert fsdp.category_max_mib["grads"] < single.category_max_mib["grads"] / nproc * 1.5
    # Parameters: the resident shard plus the block being all-gathered and the root's
    # unsharded embeddings, so more than 1/nproc but well under the whole model.
    assert single.category_max_mib["params"] / nproc < fsdp.category_max_mib["params"] \
        < single.category_max_mib["params"]
    assert fsdp.peak_mib < single.peak_mib
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.parametrize("overrides, named", [
    (["parallel=fsdp1", "parallel.nproc=2"], "parallel=fsdp1"),
    (["parallel=fsdp", "parallel.nproc=auto"], "parallel.nproc=auto"),
    (["offload=optimizer", "device=cuda"], "offload=optimizer"),
    (["peft=qlora", "precision=bf16_pure"], "peft=qlora"),
    (["parallel=ddp", "parallel.nproc=2", "parallel.gradient_as_bucket_view=true"],
     "parallel.gradient_as_bucket_view=true"),
])
def test_untraceable_options_are_named(overrides, named):
    with pytest.raises(Untraceable, match=f"^{named}: "):
        trace(compose_spec([*SMALL, *overrides]))


def test_flex_attention_is_named_untraceable():
    """torch.compile declines to compile FlexAttention under MemTracker's dispatch mode."""
    llama = ["model=llama3.2-1b", "model.config.num_hidden_layers=1", "data.vocab_size=128", "batch_size=1",
             "seq_len=64", "device=cuda"]
    assert Techniques.of(compose_spec(llama)).untraceable() is None
    with pytest.raises(Untraceable, match="^attention=flex: "):
        trace(compose_spec([*llama, "attention=flex"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_a_cuda_trace_without_a_visible_gpu_is_untraceable_not_wrong(device):
    # Without a GPU torch turns CUDA autocast off and picks the math SDPA kernel (on a CPU-only
    # build autograd on fake CUDA tensors even aborts the process): refuse instead.
    with pytest.raises(Untraceable, match=f"^device={device}: .*visible GPU"):
        trace(compose_spec([*SMALL, f"device={device}"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible GPU")
def test_a_cuda_trace_allocates_nothing_and_counts_fp32_params_exactly():
    # Counted as the allocator's requests, not its bytes: a CUDA tensor an earlier test in the same
    # process left behind can be freed inside the trace even with garbage collected first, which a
    # comparison of allocated bytes reads as the trace freeing memory.
    requests = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    p = trace(compose_spec(["model=gpt-nano", "batch_size=4", "seq_len=32", "device=cuda"]))
    # On CUDA MemTracker counts each tensor as the caching allocator stores it: rounded up to
    # 512-byte blocks (10,194,432 bytes for gpt-nano's 10,185,600: benchmarks/results/
    # NVIDIA-H100-80GB-HBM3/README.md).
    model = meta_model(["model=gpt-nano"])
    assert p.category_max_mib["params"] * 2**20 == sum(-(-q.numel() * 4 // 512) * 512 for q in model.parameters())
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == requests


def global_state() -> dict:
    """Everything trace() patches or registers process-wide, as comparable values."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return {"rng": torch.get_rng_state(), "swap": torch.utils.swap_tensors,
            "mesh": _fully_shard._init_default_mesh, "foreach": list(torch_optim._foreach_supported_types),
            "modes": list(_get_current_dispatch_mode_stack()), "dist": dist.is_initialized(),
            "module_hooks": [len(h) for h in (module._global_forward_pre_hooks, module._global_forward_hooks,
                                              module._global_backward_pre_hooks, module._global_backward_hooks)],
            "optimizer_hooks": [len(optimizer._global_optimizer_pre_hooks),
                                len(optimizer._global_optimizer_post_hooks)]}


def assert_same_state(before: dict, after: dict) -> None:
    assert torch.equal(after["rng"], before["rng"])  # fake random ops draw nothing
    assert {k: v for k, v in after.items() if k != "rng"} == {k: v for k, v in before.items() if k != "rng"}


def test_trace_leaves_no_global_state_behind_even_when_it_fails(monkeypatch):
    torch.manual_seed(1234)
    before = global_state()
    trace(compose_spec([*SMALL, "parallel=fsdp", "parallel.nproc=2"]))
    trace(compose_spec([*SMALL, "optimizer=adafactor"]))  # with _ValueReads
    assert_same_state(before, global_state())
    # A model failing as it is built, its parameters already made: inside the fake mode, the fake
    # process group and the patches.
    class BrokenGPT(GPTModule):
        def __init__(self, config):
            super().__init__(config)
            raise AssertionError("injected while the model is built")

    with monkeypatch.context() as m, pytest.raises(AssertionError, match="injected"):
        m.setattr("ablate.models.gpt.GPTModule", BrokenGPT)
        trace(compose_spec([*SMALL, "parallel=fsdp", "parallel.nproc=2"]))
    assert_same_state(before, global_state())

    # A step failing while traced: MemTracker and its hooks are active too.
    calls = []

    def second_step_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return train_step(*args)

    monkeypatch.setattr("ablate.predict.trace.train_step", second_step_fails)
    with pytest.raises(RuntimeError, match="injected"):
        trace(compose_spec([*SMALL, "parallel=fsdp", "parallel.nproc=2"]))
    assert len(calls) == 2
    assert_same_state(before, global_state())
    assert FakeTensor not in torch_optim._foreach_supported_types


@pytest.mark.slow  # 1.5B parameters through FakeTensorMode (25 s); the small traces run by default
def test_gpt2_xl_traces_in_seconds_without_allocating_it():
    cfg = compose_spec(["model=gpt2-xl", "batch_size=1", "seq_len=1024", "device=cpu"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    p = trace(cfg)  # 8-9 s on 2 busy cores, most of it FakeTensorMode's dispatch (no bound here: CI is shared)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss < 1024  # the params alone are 5.8 GiB
    assert p.category_max_mib["params"] * 2**20 == XL_PARAMS * 4
    assert p.breakdown_mib["optimizer"] == pytest.approx(2 * p.breakdown_mib["params"], abs=0.01)  # AdamW
    # At batch 1 the peak is the end of backward: params, AdamW's two states and the gradients
    # (16 bytes/param, 23,767 MiB) plus the tied wte gradient's (V, C) buffers (307 MiB each).
    # Measured: 24,381 MiB.
    state = XL_PARAMS * 16 / 2**20
    assert state < p.peak_mib < state + 1024


@pytest.mark.slow
def test_job_prediction_equals_what_the_run_then_measures(tmp_path):
    """predict=trace inside the real job, then the real run on 1 or 2 gloo ranks: on the CPU the
    worker's peak_allocated_mib is its traced step's peak, which the prediction must equal (FSDP's
    can sit a little above it: gloo frees some buffers late)."""
    proc = run_cli(["-m", "parallel=single,ddp,fsdp", "predict=trace", "batch_size=8",
                    f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["choices"]["parallel"]: r for r in results_under(tmp_path / "s")}
    assert sorted(rows) == ["ddp", "fsdp", "single"]
    for name, r in rows.items():
        assert r["status"] == "ok", r["reason"]
        assert r["prediction"]["method"] == "trace"
    peak = {name: (r["prediction"]["peak_mib"], r["metrics"]["peak_allocated_mib"]) for name, r in rows.items()}
    for name in ("single", "ddp"):
        assert peak[name][0] == pytest.approx(peak[name][1], rel=1e-12), name
    # FSDP on gloo: gloo's own thread sometimes drops a collective's buffer only after the main
    # thread's next allocation, so the run's peak can sit above the trace's (a synchronous fake
    # group). Measured on CPU: 2.5431 MiB (the prediction) in 10 of 12 runs, 2.5806 in 2, and
    # 2.7056 (+6.4%) in one more: hence the bound, 15% over the prediction.
    predicted, measured = peak["fsdp"]
    assert predicted * (1 - 1e-12) <= measured <= 1.15 * predicted
    # DDP's second step rebuilds its buckets in forward, so the run labels them activations; the
    # prediction labels them other (allocated at wrap time, as from the third step on).
    for name in ("single", "fsdp") if measured == pytest.approx(predicted, rel=1e-12) else ("single",):
        assert rows[name]["prediction"]["breakdown_mib"] == rows[name]["metrics"]["breakdown_mib"]


def test_a_grouped_query_family_is_traced_without_the_mask_its_real_step_never_makes():
    """A transformers model of fake tensors cannot tell that its position ids pack one sequence a
    row, so it made a (B, 1, T, T) mask and repeated grouped keys and values for every head, which
    the real step leaves to SDPA: Arcee's trace was 2.7% over MemTracker's real step."""
    pytest.importorskip("transformers")
    base = [*hf_toy("arcee"), "device=cpu", "batch_size=4", "seq_len=16"]
    cfg = compose_spec(base)
    assert trace(cfg).peak_mib == pytest.approx(real_step(cfg).peak_mib, rel=1e-4)
