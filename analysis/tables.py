"""The report's tables, as DataFrames of display strings (numbers already rounded, failures as
"OOM" / "invalid" / ... cells, never dropped rows). analysis/report.py prints and writes them."""
from __future__ import annotations

import math

import pandas as pd

from ablate.groups import REMOVABLE
from ablate.schema import GROUPS
from analysis.table_cells import (MEMORY, NOISE, delta, failed, filled, flops, memory_heading, mib, num,  # noqa: F401
                            spread, time_delta, trainable, within_noise)
from analysis.compare import BASELINE, do_nothing, set_away_from_default, spelled
from analysis.option_names import key_label, label, option_label

def setting_label(row: pd.Series, base: pd.Series, labels: list[str]) -> str:
    """'Baseline (batch size = 128)', '+ Gradient accumulation (32 × 4 = 128) + Block recompute'.
    A baseline away from a varied group's do-nothing option says so, 'Baseline (batch size = 8):
    DDP (2 processes)', or a reader of `parallel=fsdp,ddp`'s table could not tell what '+ FSDP'
    replaced."""
    if row.name == base.name:
        own = combination(row, labels)
        return f"Baseline (batch size = {row['batch_size']})" + (": " + " + ".join(own) if own else "")
    parts = changes(row, base, labels)
    return " ".join(p if p.startswith("− ") else "+ " + p for p in parts) if parts else "Baseline (repeat)"


def combination(row: pd.Series, labels: list[str]) -> list[str]:
    """The techniques `row` runs against every group's do-nothing option, one name each ("Pure
    bf16", "Block recompute"): [] for the plain run. Only its groups and their option keys among
    `labels` count: a card or a batch size is not a technique."""
    cols = [c for c in labels if c.split(".")[0] in BASELINE]
    return changes(row, pd.Series({**BASELINE, **{c: None for c in cols if "." in c}}), cols)


def changes(row: pd.Series, base: pd.Series, labels: list[str]) -> list[str]:
    """What `row` changes against `base`, one readable name per technique; a technique `row` drops
    (back to its group's do-nothing option) is "− " and the name of what `base` had."""
    parts, said = [], set()
    for group in {c.split(".", 1)[0] for c in labels if "." in c} & set(GROUPS):
        if str(row[group]) != str(base[group]) or any(str(row[c]) != str(base[c]) for c in labels
                                                        if c.startswith(group + ".")):
            said |= option_label(row, group, labels)[1]  # keys the option's own name says ("LoRA r=64")
    for col in labels:
        if str(row[col]) == str(base[col]) or ("." in col and _implied(row, base, col)):
            continue
        if col in said:
            group = col.split(".", 1)[0]
            name = option_label(row, group, labels)[0]
            if str(row[group]) == str(base[group]) and name not in parts:  # only its keys changed
                parts.append(name)
            continue
        if col in REMOVABLE and str(row[col]) == BASELINE[col]:  # "− Block recompute", not "+ checkpoint=none"
            parts.append("− " + changes(base, row, [col])[0])
        elif col == "accumulation":
            steps, batch = int(row.get("accumulation_steps") or 1), row["batch_size"]
            parts.append(f"Gradient accumulation ({batch // steps} × {steps} = {batch})" if batch % steps == 0
                         else f"Gradient accumulation ({steps} steps, batch size {batch})")  # an invalid row
        elif col == "parallel":
            world = row.get("env_world_size")
            world = world if pd.notna(world) else row.get("parallel.nproc")  # an invalid row never ran
            n = int(float(world)) if _number(world) else None
            name = label(col, row[col])
            parts.append(f"{name} ({n} process{'es' if n != 1 else ''})" if n else name)
        elif col == "checkpoint.types" and parts and parts[-1] == label("checkpoint", "layers"):
            parts[-1] += f" ({row[col].replace(',', ', ')})"  # "Layer-type recompute (layernorm, gelu)"
        elif col in GROUPS:
            parts.append(option_label(row, col, labels)[0])
        elif "." in col:
            parts.append(key_label(row, col))
        elif col == "compile":
            parts.append("torch.compile" if str(row[col]) == "True" else "no torch.compile")
        elif col == "gpu_memory_gib":
            parts.append(f"{float(row[col]):g} GiB card (emulated)" if _number(row[col]) else "the whole GPU")
        elif col == "alloc_conf":
            parts.append(f"PYTORCH_CUDA_ALLOC_CONF={row[col]}" if pd.notna(row[col]) else "default allocator settings")
        else:
            parts.append(f"{col.replace('_', ' ')} = {row[col]}")
    return parts


def _implied(row: pd.Series, base: pd.Series, col: str) -> bool:
    """An option key ("optimizer.lr") that the row's option already says: one the option lacks
    (null), or its own default on an option other than the base's (SGD's lr 0.1 is part of "+ SGD")."""
    if pd.isna(row[col]):
        return True
    if col == "checkpoint.types":  # the types qualify the name, default or not
        return False
    group = col.split(".")[0]
    other_option = str(row[group]) != str(base[group]) or pd.isna(base[col])  # null: against BASELINE
    return other_option and not set_away_from_default(row, col)


def not_a_ladder(df: pd.DataFrame, labels: list[str]) -> str | None:
    """Why these rows, in this order, are not a ladder (each adds to the row above), or None. A row
    that goes back to the first row's value of something the row above had changed drops it: "−
    Block recompute", but also SGD back to AdamW or batch size 16 back to 8 (which a label would
    call "+ AdamW", "+ batch size = 8"). Such rows are variants of a common base: a preset with
    `cumulative: false`, or a grid. Changing a value again (batch 64, then 128) is a rung."""
    rows = [row for _, row in df.iterrows()]
    for above, row in zip(rows, rows[1:]):
        back = [col for col in labels if str(row[col]) == str(rows[0][col]) != str(above[col])
                and not ("." in col and _implied(row, above, col))]
        if back:
            return (f"'{setting_label(row, above, labels)}' drops {changes(above, row, back[:1])[0]}, "
                    f"which the row above has")
    return None


def marks(row) -> str:
    """Where a row's figures come from: " (reused)", measured by an earlier sweep; " (on node7)", one of
    a run's measurements on several machines (load.one_per_machine)."""
    on = f" (on {row['measured_on']})" if pd.notna(row.get("measured_on")) else ""
    return (" (reused)" if pd.notna(row.get("reused_from")) else "") + on


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


def differ_in_training(df: pd.DataFrame) -> bool:
    """Whether the rows train different numbers of parameters (an adapter against full training):
    then a table says how many each trains; where they all train the same, it says nothing new."""
    return "trainable_params" in df and df["trainable_params"].dropna().nunique() > 1


def setting(df: pd.DataFrame, labels: list[str], base_i: int, ladder: bool = False) -> pd.DataFrame:
    """Setting (| Trainable) | GPU Memory Peak | Training Latency | Δ memory | Δ time (| Δ vs
    previous row), less the columns that no row has a value in; Trainable where the rows train
    different numbers of parameters."""
    base, memory = df.loc[base_i], memory_heading(df)
    runs = dict(df.iterrows())  # each row once: df.loc per row costs a millisecond
    order = list(df.index)
    rungs = "rung" in df and df["rung"].notna().all()  # a preset's rungs: in the order it lists them (docs/presets.md)
    if rungs and not ladder:
        order = [base_i, *df.index.drop(base_i)]
    elif not ladder:  # published tables open with the baseline, then one change, then two...; a ladder keeps its order
        order = [base_i, *sorted(df.index.drop(base_i), key=lambda i: len(changes(runs[i], base, labels)))]  # stable
    rows, prev_any = [], None
    prev = {}  # the last ok row and the last predicted one: a delta never mixes the two
    counts = differ_in_training(df)
    for row in map(runs.get, order):
        ok = row["status"] == "ok"
        # A ladder's row names what it adds to the row above; otherwise what differs from the baseline.
        ref = prev_any if ladder and prev_any is not None else base
        label = setting_label(row, ref, labels) if row.name != base.name else setting_label(row, base, labels)
        out = {"Setting": label + marks(row),
               **({"Trainable": trainable(row)} if counts else {}),
               memory: mib(row[MEMORY]) if ok else failed(row),
               "Training Latency (s)": num(row["train_latency_s"], ".2f") if ok else "",
               "Iteration p10–p90 (ms)": spread(row) if ok else "",
               "Δ memory vs baseline": memory_delta(row, base),
               "Δ time vs baseline": time_delta(row, base) if ok else ""}
        if ladder:
            last = prev.get(row["status"])
            out["Δ memory vs previous"] = memory_delta(row, last) if last is not None else ""
            out["Δ time vs previous"] = time_delta(row, last) if ok and last is not None else ""
        rows.append(out)
        if row["status"] in ("ok", "predicted"):
            prev[row["status"]] = row
        prev_any = row
    return filled(pd.DataFrame(rows), keep=["Setting", memory])  # a plan has no latencies


# A search's answer (find_batch's, find_seq's: the point the row's metrics are of), and where a
# measured search started (the predictor's answer, beside the probes' own): columns where any row has one.
SEARCHED = {"max_batch_size": "Max micro-batch", "predicted_max_batch_size": "Predicted max micro-batch",
            "max_seq_len": "Longest context", "predicted_max_seq_len": "Predicted longest context"}
# (column, heading, format) of the full table; memory in MiB, times as their names say.
FULL = (
    (MEMORY, "Peak allocated (MiB)", ",.1f"), ("peak_reserved_mib", "Peak reserved (MiB)", ",.1f"),
    ("nvml_peak_mib", "NVML peak (MiB)", ",.1f"), ("host_peak_rss_mib", "Host RSS (MiB)", ",.0f"),
    ("iter_time_ms", "Iteration p50 (ms)", ",.1f"), ("iter_time_ms_p10", "Iteration p10–p90 (ms)", None),
    ("tokens_per_s", "Tokens/s", ",.0f"), ("tflops", "TFLOP/s", ".2f"), ("mfu", "MFU", ".1%"), ("loss_final", "Final loss", ".4f"),
    ("eval_loss", "Eval loss", ".4f"),
)


def full(df: pd.DataFrame, labels: list[str], bases: int | pd.Series) -> pd.DataFrame:
    """Every varied column and every key metric; failures keep their row with status and reason.
    `bases`: the baseline row of every row (compare.baselines()), or one row for all."""
    if not isinstance(bases, pd.Series):
        bases = pd.Series(bases, index=df.index)
    base_loss = df.loc[bases.values, "loss_final"].set_axis(df.index)
    # an option key the row's option does not have: empty; a run key as typed (gpu_memory_gib 8, null)
    out = pd.DataFrame({c: df[c].map(lambda v: "" if pd.isna(v) else spelled(v)) if "." in c else df[c].map(spelled)
                        for c in labels}, index=df.index)
    for column, heading in SEARCHED.items():
        if column in df and df[column].notna().any():
            out[heading] = [num(v, ",.0f") for v in df[column]]
    if differ_in_training(df):  # an adapter's rows against full training's: what each trains
        out["Trainable"] = [trainable(r) for r in df.reindex(columns=["trainable_params", "params"]).to_dict("records")]
    ok = df["status"] == "ok"
    for column, heading, fmt in FULL:
        values = df[column] if column in df else pd.Series(float("nan"), index=df.index)
        if column == "tflops":
            heading, cells = flops(values.where(ok))
        elif column == "iter_time_ms_p10":
            cells = [spread(r) for r in df.reindex(columns=["iter_time_ms_p10", "iter_time_ms_p90"]).to_dict("records")]
        else:
            cells = [num(v, fmt) for v in values]
        out[heading] = [c if good else "" for c, good in zip(cells, ok)]
        if column == MEMORY:  # the first metric column says how a failed run ended
            out.loc[~ok, heading] = [failed(r) for _, r in df[~ok].iterrows()]
    out["Δ loss vs baseline"] = [delta(v, b) if good else "" for v, b, good in zip(df["loss_final"], base_loss, ok)]
    if df["predicted_peak_mib"].notna().any():
        out["Predicted peak (MiB)"] = [num(v, ",.1f") for v in df["predicted_peak_mib"]]
        out["Prediction error"] = [delta(p, m) if good else "" for p, m, good
                                   in zip(df["predicted_peak_mib"], df[MEMORY], ok)]
    out["Status"] = [(f"{r['status']}: {r['reason']}" if r["status"] != "ok" and isinstance(r["reason"], str)
                      and r["reason"] else r["status"]) + marks(r)  # a predicted row has no reason
                     for r in df.reindex(columns=["status", "reason", "reused_from", "measured_on"]).to_dict("records")]
    # On a CPU no reserved, NVML or MFU; in a predict_only plan no measurement, Δ loss or error.
    return filled(out, keep=labels)


PAIRED = (MEMORY, "iter_time_ms", "loss_final", "iter_time_ms_p10", "iter_time_ms_p90")  # what marginal compares


def marginal(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """For each varied column with a do-nothing value (do_nothing: a group's reference
    option, an option key's default, a run key off) and each other value it takes: the median
    change in memory, time and loss against the do-nothing value, over pairs of ok runs that are
    equal in every other varied column. "Against" names the do-nothing value ("fsdp" vs "ddp").
    A value never paired and never failing says nothing and gets no row (`optimizer.lr=1e-3,3e-4`
    where the default 6e-4 never ran; model.config keys set away from their file's values)."""
    ok = df[df["status"] == "ok"]
    # each run's figures as a dict, made once: a pandas row per pair took seconds over 1,000 runs
    runs_of = dict(zip(df.index, df[[c for c in PAIRED if c in df]].to_dict("records")))
    rows = []
    for col, (at_ref, against) in do_nothing(df, labels).items():
        others = [c for c in labels if c != col]
        same = lambda frame: [tuple(map(str, r)) for r in frame[others].itertuples(index=False)]  # noqa: E731
        base = ok[at_ref[ok.index]]
        refs = dict(zip(reversed(same(base)), reversed(base.index)))  # the first run of each kind
        values = df.loc[~at_ref & df[col].notna(), col].astype(str)
        for option in sorted(set(values), key=_natural):
            chosen = ~at_ref & (df[col].astype(str) == option)
            runs = ok[chosen[ok.index]]
            pairs = [[*(_pct(runs_of[i][m], runs_of[refs[k]][m]) for m in (MEMORY, "iter_time_ms", "loss_final")),
                      within_noise(runs_of[i], runs_of[refs[k]])]
                     for k, i in zip(same(runs), runs.index) if k in refs]
            if not pairs and len(runs) == chosen.sum():
                continue
            med = pd.DataFrame([p[:3] for p in pairs]).median() if pairs else pd.Series([float("nan")] * 3)
            noise = sum(p[3] for p in pairs) > len(pairs) / 2  # most pairs differ by less than their own spread
            rows.append({"Group": col, "Option": option, "Against": against, "Δ memory (median)": _signed(med.iloc[0]),
                         "Δ iteration time (median)": NOISE if noise and pd.notna(med.iloc[1]) else _signed(med.iloc[1]),
                         "Δ final loss (median)": _signed(med.iloc[2]), "Pairs": str(len(pairs)),
                         "Not ok": str(int(chosen.sum()) - len(runs))})
    return pd.DataFrame(rows)


def _natural(value: str):
    """Numbers in numeric order ("8.0" before "16.0"), then text."""
    return (0, float(value), "") if _number(value) else (1, 0.0, value)


def _number(value) -> bool:
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def _pct(value, base) -> float:
    return 100 * (value - base) / base if pd.notna(value) and pd.notna(base) and base else float("nan")


def _signed(value: float) -> str:
    return "" if pd.isna(value) else f"{value:+.1f}%"
