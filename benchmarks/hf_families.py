"""Every causal LM family in the installed transformers, at toy size, through ablate on the CPU.

    python benchmarks/hf_families.py [--only llama,gpt_oss ...] [--results DIR]

For each model_type that AutoModelForCausalLM knows, a 2-layer model of hidden size 64 and a
128-token vocabulary (each size key the family's config has, set small: ablate/models/hf_toy.py) is built as
`model=hf +model.config.model_type=<type>` builds it, then trained 3 steps plain, with block and
selective-op recompute and with the chunked loss, and its memory predicted the way a run predicts
it (analytic, else the trace) and measured with MemTracker on the real step. Writes
`<results>/cpu/hf_families.md`: one row per family, saying what worked and, for what did not, the
first line of why. No GPU, no download: the models are random, built from their configs.

What "works" means here: trains (finite losses that fall over 3 steps of AdamW on one batch of
ablate's synthetic Markov-chain data), block and ops recompute and the chunked loss give the plain run's losses (rel
1e-5), and the prediction is within 5% of the measured peak.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` without installing the project
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from ablate.build import build_model, build_optimizer, check_config  # noqa: E402
from ablate.data import Synthetic  # noqa: E402
from ablate.measure import traced_step  # noqa: E402
from ablate.models.hf_toy import toy_overrides  # noqa: E402
from ablate.outcome import predicted  # noqa: E402
from ablate.schema import register  # noqa: E402
from ablate.spec import RunSpec  # noqa: E402
from ablate.techniques import Invalid  # noqa: E402
from ablate.train import train_step  # noqa: E402

BASE = ["device=cpu", "batch_size=4", "seq_len=16", "data.vocab_size=128", "data.train_samples=32",
        "optimizer=adamw", "warmup_steps=2"]
VARIANTS = {"block": ["checkpoint=block"], "ops": ["checkpoint=ops"], "chunked": ["loss=chunked", "loss.chunks=3"]}
TIMEOUT_S = 300  # one family, all of its runs


def spec_of(overrides: list[str]) -> RunSpec:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return RunSpec.of(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def train(overrides: list[str], steps: int = 3) -> tuple[list[float], float]:
    """(losses, MemTracker's peak of the traced step in MiB) of the point, on the CPU."""
    spec = spec_of([*BASE, *overrides])
    t = check_config(spec, "cpu")
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(t, cpu)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")
    data = Synthetic(vocab_size=128, train_samples=32).load(spec.seq_len)  # a Markov chain: there is a signal
    batches = [data.train_batch(0, spec.batch_size)] * (steps + 1)  # one batch again: its loss must fall
    losses = [train_step(model, optimizer, scaler, t, b, cpu).item() for b in batches[:steps]]
    trace = traced_step(lambda: train_step(model, optimizer, scaler, t, batches[-1], cpu), model, optimizer, cpu)
    return losses, trace.peak_mib


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


class Timeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    def fire(*_):
        raise Timeout(f"more than {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def survey(model_type: str) -> dict:
    """One family's row: what worked, and the first reason for what did not."""
    row = {"family": model_type}
    try:
        keys = toy_overrides(model_type)
    except Exception as exc:  # noqa: BLE001  (a config transformers cannot make with its defaults)
        return {**row, "builds": "config", "why": f"transformers' defaults: {first_line(exc)}"}
    try:
        plain, peak = train(keys)
    except Invalid as exc:  # a run's invalid row: ablate says why it cannot train this family
        return {**row, "builds": "invalid", "why": str(exc).splitlines()[0][:160]}
    except Exception as exc:  # noqa: BLE001  (a run's error row: a crash ablate did not foresee)
        return {**row, "builds": "error", "why": first_line(exc)}
    finite = all(map(torch.isfinite, torch.tensor(plain)))
    row.update(builds="yes", trains="yes" if finite and plain[-1] < plain[0] else f"no: {plain}")
    for name, extra in VARIANTS.items():
        try:
            got, _ = train([*keys, *extra])
            same = torch.allclose(torch.tensor(got), torch.tensor(plain), rtol=1e-5, atol=0)
            row[name] = "same" if same else f"differs: {got[-1]:.6f} vs {plain[-1]:.6f}"
        except Exception as exc:  # noqa: BLE001
            row[name] = first_line(exc)
    try:
        spec = spec_of([*BASE, *keys])
        with contextlib.redirect_stderr(None):
            pred = predicted(spec)
        row["predicted"] = f"{pred.method} {100 * (pred.peak_mib / peak - 1):+.1f}%" if pred else "none"
    except Exception as exc:  # noqa: BLE001
        row["predicted"] = first_line(exc)
    return row


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


COLUMNS = ["family", "builds", "trains", "block", "ops", "chunked", "predicted", "why"]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in COLUMNS) + " |")
    return "\n".join(lines)


def ok(row: dict) -> bool:
    pred = row.get("predicted", "")
    return (row.get("trains") == "yes" and all(row.get(v) == "same" for v in VARIANTS)
            and pred.split()[0] in ("analytic", "trace") and abs(float(pred.split()[1].rstrip("%"))) <= 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: every causal LM)")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    register()
    # the commit the code under test came from: read before the run, which takes a while
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "ablate"], cwd=ROOT, capture_output=True, text=True).stdout
    sha += " (with uncommitted changes under ablate/)" if dirty.strip() else ""
    names = args.only.split(",") if args.only else families()
    rows, start = [], time.time()
    for name in names:
        began = time.time()
        try:
            with deadline(TIMEOUT_S):
                row = survey(name)
        except Timeout as exc:
            row = {"family": name, "why": f"timeout: {exc}"}
        rows.append(row)
        print(f"{name:24s} {time.time() - began:5.1f} s  " + "  ".join(f"{k}={row.get(k, '')}" for k in COLUMNS[1:]
                                                                   if row.get(k)), flush=True)
    import transformers

    good = sum(map(ok, rows))
    ends = collections.Counter(r.get("builds", "timeout") for r in rows)
    built = [r for r in rows if r.get("builds") == "yes"]

    def tally(column: str, start: str) -> int:
        return sum(str(r.get(column, "")).startswith(start) for r in built)

    def near(method: str) -> int:
        return sum(ok({**r, "trains": "yes", **{v: "same" for v in VARIANTS}}) for r in built
                   if r.get("predicted", "").startswith(method))
    counts = ", ".join(f"{n} {what}" for what, n in ends.most_common())
    text = (f"# Every causal LM family of transformers at toy size, on the CPU\n\n"
            f"`{shlex.join(['python', 'benchmarks/hf_families.py', *sys.argv[1:]])}`: each family at 2 layers, "
            f"hidden 64, 128 tokens, batch 4 x 16, AdamW; its config's own defaults otherwise.\n"
            f"Machine: {platform.node()} ({platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs), "
            f"torch {torch.__version__}, transformers {transformers.__version__}, commit {sha}; "
            f"{time.time() - start:.0f} s.\n\n"
            f"How each build ended: {counts}. Of the {len(built)} built, {tally('trains', 'yes')} train, "
            f"block recompute keeps the losses of {tally('block', 'same')} and selective-op recompute of "
            f"{tally('ops', 'same')}; the chunked loss keeps them in {tally('chunked', 'same')} and refuses "
            f"{tally('chunked', 'Invalid')} (their logits are not the head's output alone, or their toy "
            f"copy could not be checked: ablate/models/hf_toy.py); {near('analytic')} are predicted within 5% by "
            f"the analytic model and {near('trace')} by the trace, {tally('predicted', 'none')} not at all. "
            f"**{good} of {len(rows)}** are whole: all of that, the chunked loss included. "
            f"`invalid`: ablate refuses the family with a reason (a run's invalid row); `error`: it crashed "
            f"(a run's error row); `config`: transformers cannot make the family's config at these sizes.\n\n"
            f"{table(rows)}\n")
    out = args.results / "cpu" / "hf_families.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"{good} of {len(rows)} families whole; wrote {out}")


if __name__ == "__main__":
    main()
