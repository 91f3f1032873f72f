"""The report's tables, as DataFrames of display strings (numbers already rounded, failures as
"OOM" / "invalid" / ... cells, never dropped rows). analysis/report.py prints and writes them."""
from __future__ import annotations

import math

import pandas as pd

from ablate.schema import GROUPS, option_defaults
from analysis.load import RUN_KEYS, text

# The do-nothing option of each group: a run's label lists only what differs from these.
BASELINE = {"optimizer": "adamw", "precision": "fp32", "accumulation": "none", "checkpoint": "none",
            "offload": "none", "parallel": "single"}
# What a grid without a group's do-nothing option is compared against, in order of preference: a
# `parallel=fsdp,ddp` sweep asks how FSDP does against DDP, a `precision=bf16,bf16_pure` one what
# pure bf16 saves over AMP.
FALLBACK = {"parallel": ("ddp",), "precision": ("tf32", "bf16"),
            "optimizer": ("adamw_foreach", "adamw_fused", "adamw_forloop")}
NAMES = {
    ("checkpoint", "block"): "Block recompute", ("checkpoint", "every2"): "Recompute every 2nd block",
    ("checkpoint", "attention"): "Attention recompute", ("checkpoint", "mlp"): "MLP recompute",
    ("checkpoint", "ops"): "Selective op recompute", ("checkpoint", "layers"): "Layer-type recompute",
    ("optimizer", "adamw"): "AdamW", ("optimizer", "adamw_forloop"): "AdamW for-loop",
    ("optimizer", "adamw_foreach"): "AdamW foreach", ("optimizer", "adamw_fused"): "AdamW fused",
    ("optimizer", "sgd"): "SGD", ("optimizer", "adafactor"): "Adafactor", ("optimizer", "adamw8bit"): "8-bit AdamW",
    ("precision", "fp32"): "fp32", ("precision", "tf32"): "TF32", ("precision", "fp16"): "fp16 AMP",
    ("precision", "bf16"): "bf16 AMP", ("precision", "bf16_pure"): "Pure bf16",
    ("offload", "activations"): "Activation offload", ("offload", "optimizer"): "Optimizer offload",
    ("offload", "params"): "Parameter offload",
    # option keys ("group.key") a preset varies on their own
    ("optimizer.in_backward", "True"): "Optimizer step in backward",
    ("parallel.backward_prefetch", "pre"): "Backward prefetch (pre)",
    ("parallel.backward_prefetch", "post"): "Backward prefetch (post)",
    ("parallel.gradient_as_bucket_view", "True"): "Gradients as bucket views",
    ("parallel.sync_each_micro_step", "False"): "Gradient sync on the last micro-step only",
    ("parallel.sync_each_micro_step", "True"): "Gradient sync every micro-step",
}
MEMORY = "peak_allocated_mib"
# Run keys whose null (or false) is the plain run: a sweep over them is measured against it.
OFF_KEYS = ("compile", "alloc_conf", "gpu_memory_gib")
FOOTNOTE = ("GPU Memory Peak / Memory (MiB): the torch caching allocator's peak of allocated bytes over "
            "training (on CPU, the peak of live tensor bytes traced by torch's MemTracker); MiB = 2^20 bytes. "
            "Reserved adds cached free blocks; NVML is what the driver sees (CUDA context included). "
            "Iteration time: median of the measured steps. Training latency: all measured steps.")


def varied(df: pd.DataFrame) -> list[str]:
    """Group, run-key and GPU columns whose value differs between rows (at least `model`), and the
    option keys ("parallel.backward_prefetch") that differ between rows because a run set them:
    they differ between runs of the same option, or some run has one away from its option's
    default (leanest's `optimizer.in_backward: true` on adamw8bit, against a baseline adamw). An
    option's own defaults (sgd's lr 0.1 against adamw's 6e-4) are part of choosing the option."""
    cols = [c for c in (*GROUPS, *RUN_KEYS, "env_gpu_name") if c in df and df[c].astype(str).nunique(dropna=False) > 1]
    keys = [c for c in df.columns if c.split(".")[0] in GROUPS and "." in c and df[c].nunique() > 1]
    cols += [c for c in keys if (df.groupby(c.split(".")[0], dropna=False)[c].nunique() > 1).any()
             or any(_set_away_from_default(row, c) for _, row in df.iterrows())]
    return cols or ["model"]


def _set_away_from_default(row: pd.Series, col: str) -> bool:
    if col in ("parallel.nproc", "parallel.nodes"):  # the parallel label names the processes already
        return False
    group, key = col.split(".", 1)
    defaults = option_defaults(group, str(row[group]))
    return pd.notna(row[col]) and key in defaults and row[col] != text(defaults[key])


def num(value, fmt: str, unit: str = "") -> str:
    """A rounded number, or "" when it was not measured."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:{fmt}}{unit}"


def mib(value) -> str:
    """Memory as published tables print it: whole MiB, one decimal below 100 MiB (CPU-sized runs)."""
    return num(value, ",.0f" if value is not None and not pd.isna(value) and value >= 100 else ".1f")


def delta(value, base) -> str:
    """Signed change in percent: "+12.3%"."""
    if value is None or base is None or pd.isna(value) or pd.isna(base) or not base:
        return ""
    return f"{100 * (value - base) / base:+.1f}%"


def failed(row: pd.Series) -> str:
    """The cell a failed (or only predicted) run shows where a number would be."""
    if row["status"] == "predicted" and pd.notna(row.get("predicted_peak_mib")):
        return f"~{row['predicted_peak_mib']:,.0f} (predicted)"
    return "OOM" if row["status"] == "oom" else row["status"]


def references(df: pd.DataFrame, labels: list[str]) -> dict[str, str]:
    """Each varied group's reference option among the runs: its do-nothing option, else the first
    of its FALLBACK options present; a group with neither has no reference."""
    refs = {}
    for group in (g for g in labels if g in BASELINE):
        present = set(df[group].astype(str))
        ref = next((o for o in (BASELINE[group], *FALLBACK.get(group, ())) if o in present), None)
        if ref is not None:
            refs[group] = ref
    return refs


def baseline_index(df: pd.DataFrame, labels: list[str], baseline: dict[str, str] | None) -> int:
    """The row every delta is taken against: `--baseline key=value,...`, else the run with the most
    varied groups at their reference option (all of them, where such a run exists), then the most
    varied option keys at their option's default (`parallel.sync_each_micro_step=true,false` is
    measured against true) and run keys off (OFF_KEYS), then the ok runs, then the smallest batch:
    the first in row order."""
    if baseline:
        match = df
        for key, value in baseline.items():
            match = match[match[key].astype(str) == str(value)]
        if match.empty:
            raise ValueError(f"--baseline {baseline}: no run matches (varied: {', '.join(labels)})")
        return match.index[0]
    refs = references(df, labels)
    at_reference = sum((df[g].astype(str) == o).astype(int) for g, o in refs.items()) if refs else 0
    keys = [c for c in labels if "." in c and c.split(".")[0] in GROUPS]
    at_default = sum(df.apply(lambda row: not _set_away_from_default(row, c), axis=1).astype(int) for c in keys)
    at_default += sum((df[c].isna() | (df[c].astype(str) == "False")).astype(int) for c in labels if c in OFF_KEYS)
    score = pd.DataFrame({"refs": at_reference, "defaults": at_default, "ok": (df["status"] == "ok").astype(int)},
                         index=df.index)
    return score.sort_values(["refs", "defaults", "ok"], ascending=False, kind="stable").index[0]


def by_model(df: pd.DataFrame, labels: list[str]) -> list[tuple[str | None, pd.DataFrame, list[str]]]:
    """(model, its runs, the labels that vary within them) per model, in the order the models first
    appear: a delta between two models says nothing about a technique. One part (model None, the
    labels as given) when only one model ran."""
    if "model" not in df or df["model"].nunique() <= 1:
        return [(None, df, labels)]
    parts = []
    for model in df["model"].unique():
        part = df[df["model"] == model]
        rest = [c for c in labels if c != "model"]
        parts.append((model, part, [c for c in rest if part[c].astype(str).nunique() > 1] or rest or labels))
    return parts


def baselines(df: pd.DataFrame, labels: list[str], baseline: dict[str, str] | None) -> pd.Series:
    """Each row's baseline row (an index of df): one per model. `--baseline` picks it in every
    model that has a matching run, and must match some run."""
    if baseline:
        baseline_index(df, labels, baseline)  # raises if no run at all matches
    out = pd.Series(0, index=df.index)
    for _, part, part_labels in by_model(df, labels):
        try:
            out[part.index] = baseline_index(part, part_labels, baseline)
        except ValueError:  # this model has no run like that: its own default baseline
            out[part.index] = baseline_index(part, part_labels, None)
    return out


def setting_label(row: pd.Series, base: pd.Series, labels: list[str]) -> str:
    """'Baseline (batch size = 128)', '+ Gradient accumulation (32 × 4 = 128) + Block recompute'."""
    if row.name == base.name:
        return f"Baseline (batch size = {row['batch_size']})"
    parts = changes(row, base, labels)
    return "+ " + " + ".join(parts) if parts else "Baseline (repeat)"


def changes(row: pd.Series, base: pd.Series, labels: list[str]) -> list[str]:
    """What `row` changes against `base`, one readable name per technique."""
    parts = []
    for col in labels:
        if str(row[col]) == str(base[col]):
            continue
        if col == "accumulation":
            steps = int(row.get("accumulation_steps") or 1)
            parts.append(f"Gradient accumulation ({row['batch_size'] // steps} × {steps} = {row['batch_size']})")
        elif col == "parallel":
            world = row.get("env_world_size")
            world = world if pd.notna(world) else row.get("parallel.nproc")  # an invalid row never ran
            n = int(float(world)) if _number(world) else None
            parts.append(f"{str(row[col]).upper()} ({n} process{'es' if n != 1 else ''})" if n
                         else str(row[col]).upper())
        elif col == "checkpoint.types" and parts and parts[-1] == NAMES[("checkpoint", "layers")]:
            parts[-1] += f" ({row[col].replace(',', ', ')})"  # "Layer-type recompute (layernorm, gelu)"
        elif col in GROUPS or "." in col:
            parts.append(NAMES.get((col, row[col]), f"{col}={row[col]}"))
        elif col == "alloc_conf":
            parts.append(f"PYTORCH_CUDA_ALLOC_CONF={row[col]}" if pd.notna(row[col]) else "default allocator settings")
        else:
            parts.append(f"{col.replace('_', ' ')} = {row[col]}")
    return parts


def memory_delta(row: pd.Series, base: pd.Series) -> str:
    """Δ peak memory against `base` (the baseline, or a ladder's previous row): measured against
    measured, or, for a plan made with predict_only, predicted against predicted ("~-46.8%");
    never one against the other."""
    if row["status"] == "ok" and base["status"] == "ok":
        return delta(row[MEMORY], base[MEMORY])
    if row["status"] == "predicted" and base["status"] == "predicted":
        change = delta(row.get("predicted_peak_mib"), base.get("predicted_peak_mib"))
        return "~" + change if change else ""
    return ""


def setting(df: pd.DataFrame, labels: list[str], base_i: int, ladder: bool = False) -> pd.DataFrame:
    """Setting | GPU Memory Peak | Training Latency | Δ memory | Δ time (| Δ vs previous row)."""
    base = df.loc[base_i]
    if not ladder:  # published tables open with the baseline, then one change, then two...; a ladder keeps its order
        rest = sorted(df.index.drop(base_i), key=lambda i: len(changes(df.loc[i], base, labels)))  # stable
        df = df.loc[[base_i, *rest]]
    rows, prev_any = [], None
    prev = {}  # the last ok row and the last predicted one: a delta never mixes the two
    for _, row in df.iterrows():
        ok = row["status"] == "ok"
        # A ladder's row names what it adds to the row above; otherwise what differs from the baseline.
        ref = prev_any if ladder and prev_any is not None else base
        label = setting_label(row, ref, labels) if row.name != base.name else setting_label(row, base, labels)
        out = {"Setting": label,
               "GPU Memory Peak (MiB)": mib(row[MEMORY]) if ok else failed(row),
               "Training Latency (s)": num(row["train_latency_s"], ".2f") if ok else "",
               "Δ memory vs baseline": memory_delta(row, base),
               "Δ time vs baseline": delta(row["train_latency_s"], base["train_latency_s"]) if ok else ""}
        if ladder:
            last = prev.get(row["status"])
            out["Δ memory vs previous"] = memory_delta(row, last) if last is not None else ""
            out["Δ time vs previous"] = (delta(row["train_latency_s"], last["train_latency_s"])
                                         if ok and last is not None else "")
        rows.append(out)
        if row["status"] in ("ok", "predicted"):
            prev[row["status"]] = row
        prev_any = row
    return pd.DataFrame(rows)


def batch(df: pd.DataFrame, labels: list[str]) -> dict[str, pd.DataFrame]:
    """Batch Size | Memory (MiB) | GPU Usage % | TFLOP/s | Iteration Time (ms), one table per
    combination of the other varied columns (in the order the rows come: a ladder's rung order),
    rows up to and including the first OOM."""
    others = [c for c in labels if c != "batch_size"]
    tables = {}
    for key, part in (df.groupby(others, sort=False, dropna=False) if others else [((), df)]):
        key = key if isinstance(key, tuple) else (key,)
        title = ", ".join(f"{c}={v}" for c, v in zip(others, key)) or "all runs"
        rows = []
        for _, row in part.sort_values("batch_size").iterrows():
            ok = row["status"] == "ok"
            util = (f"{row['gpu_util_pct_mean']:.1f} +/- {row['gpu_util_pct_std']:.1f}"
                    if ok and pd.notna(row.get("gpu_util_pct_mean")) and pd.notna(row.get("gpu_util_pct_std")) else "")
            rows.append({"Batch Size": str(row["batch_size"]),
                         "Memory (MiB)": mib(row[MEMORY]) if ok else failed(row),
                         "GPU Usage %": util, "TFLOP/s": num(row["tflops"], ".2f") if ok else "",
                         "Iteration Time (ms)": num(row["iter_time_ms"], ".2f") if ok else ""})
            if row["status"] == "oom":
                break  # larger batches are OOM too: the first one says it
        tables[title] = pd.DataFrame(rows)
    return tables


# (column, heading, format) of the full table; memory in MiB, times as their names say.
FULL = (
    (MEMORY, "Peak allocated (MiB)", ",.1f"), ("peak_reserved_mib", "Peak reserved (MiB)", ",.1f"),
    ("nvml_peak_mib", "NVML peak (MiB)", ",.1f"), ("host_peak_rss_mib", "Host RSS (MiB)", ",.0f"),
    ("iter_time_ms", "Iteration p50 (ms)", ",.1f"), ("tokens_per_s", "Tokens/s", ",.0f"),
    ("tflops", "TFLOP/s", ".2f"), ("mfu", "MFU", ".1%"), ("loss_final", "Final loss", ".4f"),
    ("eval_loss", "Eval loss", ".4f"),
)


def full(df: pd.DataFrame, labels: list[str], bases: int | pd.Series) -> pd.DataFrame:
    """Every varied column and every key metric; failures keep their row with status and reason.
    `bases`: the baseline row of every row (baselines()), or one row for all."""
    if not isinstance(bases, pd.Series):
        bases = pd.Series(bases, index=df.index)
    base_loss = df.loc[bases.values, "loss_final"].set_axis(df.index)
    out = df[labels].fillna("").astype(str)  # an option key the row's option does not have: empty
    if "max_batch_size" in df and df["max_batch_size"].notna().any():  # find_batch's answer, which
        # is also the micro-batch the row's metrics are of
        out["Max micro-batch"] = [num(v, ".0f") for v in df["max_batch_size"]]
    ok = df["status"] == "ok"
    for column, heading, fmt in FULL:
        values = df[column] if column in df else pd.Series(float("nan"), index=df.index)
        cells = [num(v, fmt) if good else "" for v, good in zip(values, ok)]
        if column == MEMORY:  # the first metric column says how a failed run ended
            out[heading] = cells
            out.loc[~ok, heading] = [failed(r) for _, r in df[~ok].iterrows()]
        elif any(cells):  # not a column no run measured (on a CPU: reserved, NVML, MFU)
            out[heading] = cells
    out["Δ loss vs baseline"] = [delta(v, b) if good else "" for v, b, good in zip(df["loss_final"], base_loss, ok)]
    if df["predicted_peak_mib"].notna().any():
        out["Predicted peak (MiB)"] = [num(v, ",.1f") for v in df["predicted_peak_mib"]]
        out["Prediction error"] = [delta(p, m) if good else "" for p, m, good
                                   in zip(df["predicted_peak_mib"], df[MEMORY], ok)]
    out["Status"] = [f"{s}: {r}" if s != "ok" and isinstance(r, str) and r else s
                     for s, r in zip(df["status"], df["reason"])]  # a predicted row has no reason
    return out


def marginal(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """For each varied group and option: the median change in memory, time and loss against the
    group's reference option (references()), over pairs of ok runs that are equal in every other
    varied column. The rows name the reference ("fsdp vs ddp")."""
    rows = []
    for group, reference in references(df, labels).items():
        others = [c for c in labels if c != group]
        ok = df[df["status"] == "ok"]
        base = ok[ok[group] == reference].set_index(others) if others else ok[ok[group] == reference]
        for option in sorted(set(df[group]) - {reference}):
            runs = ok[ok[group] == option]
            pairs = []
            for _, run in runs.iterrows():
                key = tuple(run[c] for c in others) if len(others) > 1 else (run[others[0]] if others else None)
                try:
                    ref = base.loc[key] if others else base.iloc[0]
                except (KeyError, IndexError):
                    continue
                ref = ref.iloc[0] if isinstance(ref, pd.DataFrame) else ref
                pairs.append([_pct(run[m], ref[m]) for m in (MEMORY, "iter_time_ms", "loss_final")])
            failed_runs = int((df[group] == option).sum() - len(runs))
            med = pd.DataFrame(pairs).median() if pairs else pd.Series([float("nan")] * 3)
            rows.append({"Group": group, "Option": option, "Against": reference,
                         "Δ memory (median)": _signed(med.iloc[0]), "Δ iteration time (median)": _signed(med.iloc[1]),
                         "Δ final loss (median)": _signed(med.iloc[2]), "Pairs": str(len(pairs)),
                         "Not ok": str(failed_runs)})
    return pd.DataFrame(rows)


def _number(value) -> bool:
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def _pct(value, base) -> float:
    return 100 * (value - base) / base if pd.notna(value) and pd.notna(base) and base else float("nan")


def _signed(value: float) -> str:
    return "" if pd.isna(value) else f"{value:+.1f}%"
