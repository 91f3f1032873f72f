"""The result's metrics, from what every rank of a run measured: memory at the worst rank, time at
the slowest, throughput and MFU/HFU from the model's FLOPs, the loss summary, parameters held."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ablate import measure
from ablate.hardware import flops_per_token, forward_flops_per_token, peak_tflops
from ablate.models import param_change
from ablate.spec import RunSpec

if TYPE_CHECKING:
    from ablate.build import Techniques
    from ablate.runner import Trained


def largest(values: list):
    """The largest of the values a rank or a phase reported, or None where none did."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def metrics(spec: RunSpec, t: Techniques, run: Trained, ranks: list[dict], eval_loss: float | None,
            loss_floor: float | None, gpu_name: str | None) -> dict:
    """The result's metrics on rank 0; `ranks` holds every rank's peaks, times, init peak and
    parameters held."""
    B, world, T = spec.batch_size, t.parallel.world_size, spec.seq_len
    seconds = max(sum(r["times_ms"]) for r in ranks) / 1e3  # the slowest rank sets the pace
    tokens = run.steps * B * world * T
    # Counted on the meta device, not on the (possibly sharded) model: the model the techniques
    # make, whose frozen weights make no gradient of their own.
    n_trained, n_frozen = t.model.flops_split(param_change(t))
    layers, width = t.model.dims()
    per_token = flops_per_token(n_trained, layers, width, T, n_frozen)
    tflops = per_token * tokens / seconds / world / 1e12 if seconds else None
    peak = peak_tflops(gpu_name, t.precision.compute_dtype, spec.peak_tflops)
    mfu = tflops / peak if peak and tflops is not None else None
    tail = run.losses[-max(1, run.steps // 10):]  # loss_final: mean of the last 10% of steps
    return {
        **{k: largest([r["peaks"][k] for r in ranks]) for k in run.peaks},  # OOM hits the worst rank
        "host_peak_rss_mib": largest([r["host_peak_rss_mib"] for r in ranks]),
        "init_peak_allocated_mib": largest([r["init_peak_mib"] for r in ranks]),
        "peak_allocated_by_phase_mib": _phase_peaks(ranks),
        "breakdown_mib": run.breakdown,
        **measure.percentiles(run.times_ms),
        "train_latency_s": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "samples_per_s": run.steps * B * world / seconds if seconds else None,
        "tflops": tflops,
        "mfu": mfu,
        # HFU counts the recomputed forward too (layers, tiled MLPs, the chunked loss's head), at the
        # forward's share of the model FLOPs: a third with nothing frozen, more where frozen weights
        # make no gradient of their own.
        "hfu": mfu * (1 + (t.checkpoint.recompute_fraction + t.loss.recompute_fraction + t.tiling.recomputed(T))
                      * forward_flops_per_token(n_trained + n_frozen, layers, width, T) / per_token)
        if mfu is not None else None,
        "compile_s": run.compile_s,
        "skipped_steps": run.skipped_steps,
        "traced_step_oom": run.traced_step_oom,  # true: no breakdown, the tracer's OOM, not training's
        "diverged_at_step": run.diverged_at,
        "loss_scale": run.loss_scale,
        "loss_first": run.losses[0] if run.losses else None,
        "loss_final": sum(tail) / len(tail) if tail else None,
        "eval_loss": eval_loss,
        "loss_floor": loss_floor,
        "losses": run.losses,
        **_counts(t, ranks),
        "per_rank": [{"rank": i, "host": r["host"], "peak_allocated_mib": r["peaks"]["peak_allocated_mib"],
                      "peak_reserved_mib": r["peaks"]["peak_reserved_mib"], "nvml_peak_mib": None}
                     for i, r in enumerate(ranks)] if world > 1 else None,
    }


def _phase_peaks(ranks: list[dict]) -> dict | None:
    """Each phase's allocator peak, the worst rank's; None where no rank measured one (a CPU)."""
    known = [r["phase_peaks"] for r in ranks if r.get("phase_peaks")]
    return {k: largest([p.get(k) for p in known]) for k in known[0]} if known else None


def _counts(t: Techniques, ranks: list[dict]) -> dict:
    """`params` and `trainable_params` of the whole model: rank 0's where every rank holds it all,
    the ranks' shards added up where FSDP shards it; null where a rank did not say."""
    held = [r.get("params") for r in ranks]
    if any(h is None for h in held):
        return {"params": None, "trainable_params": None}
    if not (t.parallel.shards_params or t.offload.shards_params):
        held = held[:1]
    return {"params": sum(h[0] for h in held), "trainable_params": sum(h[1] for h in held)}
