"""README.md does what it says, in at most 200 lines: each command of its tour runs as written (the
GPU-sized ones are plans), its "Will my model fit my GPU?" recipe runs as written on a
hand-written config.json, its groups table names every option under conf/, and every link in it
leads to a file. The plan tables the documentation shows (docs/planning.md) are the tables the tool
prints, and the measured demo table (docs/report.md) is the recorded page's."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import CONF, ROOT, results_under, run_report

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# Each tour command, as written, and how this file runs it: "plan" is GPU-sized and carries
# predict_only=true, "run" trains on the CPU (slow), "check" runs nothing.
TOUR = {
    "python -m ablate": "run",
    "python -m ablate -m optimizer=sgd,adamw": "run",
    "python -m ablate -m optimizer=sgd,adamw batch_size=4,8": "run",
    "python -m ablate model=gpt2 batch_size=16 seq_len=1024 device=cuda predict_only=true": "plan",
    "python -m ablate -m model=gpt2-xl parallel=fsdp,ddp parallel.nproc=8 device=cuda predict_only=true": "plan",
    "python -m ablate --help": "check",
    "python -m ablate --cfg job optimizer=sgd": "check",
    "python -m ablate optimizer=adamx": "check",
    "python -m ablate batch_sz=16 optimizer.lrr=1e-3": "check",
    "python -m ablate optimizer.lr=abc": "check",
    "python -m analysis.report outputs/": "run",
}


def section(heading: str) -> str:
    """The README's text under `## heading`, up to the next heading of that level."""
    return README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def bash_block(text: str) -> list[str]:
    """The lines of the first ```bash block in text, continuation lines joined."""
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return re.sub(r"\\\n\s*", "", block).splitlines()


def tour() -> list[tuple[str, str]]:
    """(command, its comment) per line of the tour's code block."""
    lines = [line.split("  #", 1) for line in bash_block(section("A short tour")) if line.startswith("python ")]
    return [(cmd.strip(), comment[0].strip() if comment else "") for cmd, *comment in lines]


def shell(command: str, out_dir, *extra: str) -> subprocess.CompletedProcess:
    """The command as a user types it, with `outputs/` (where results go by default) under out_dir."""
    args = command.split()[1:]
    if args[:2] == ["-m", "ablate"] and not {"--help", "--cfg"} & set(args):
        args.append(f"out_dir={out_dir}")
    args = [str(out_dir) if a == "outputs/" else a for a in args]
    return subprocess.run([sys.executable, *args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_readme_is_read_in_five_minutes():
    assert len(README.splitlines()) <= 200


def test_this_file_runs_every_tour_command():
    assert [c for c, _ in tour()] == list(TOUR)
    gpu_sized = {c for c, comment in tour() if "GPU-sized" in comment}
    assert gpu_sized == {c for c, how in TOUR.items() if how == "plan"}
    assert all("predict_only=true" in c for c in gpu_sized)


def test_the_tour_commands_that_train_nothing(tmp_path):
    comments = dict(tour())
    out = {c: shell(c, tmp_path) for c, how in TOUR.items() if how == "check"}
    helped = out["python -m ablate --help"]
    assert helped.returncode == 0 and "== Examples ==" in helped.stdout
    assert all(f"\n{group}:\n" in helped.stdout for group in ("optimizer", "checkpoint", "offload", "parallel"))
    cfg = out["python -m ablate --cfg job optimizer=sgd"]
    assert cfg.returncode == 0 and "optimizer:" in cfg.stdout and "momentum" in cfg.stdout
    typo = out["python -m ablate optimizer=adamx"]
    assert typo.returncode == 1 and "adamw" in typo.stderr and "sgd" in typo.stderr  # the valid options
    keys = out["python -m ablate batch_sz=16 optimizer.lrr=1e-3"]
    assert keys.returncode == 1 and "batch_size" in keys.stderr  # the closest key
    bad = out["python -m ablate optimizer.lr=abc"]
    quoted = re.search(r'"(.+)"', comments["python -m ablate optimizer.lr=abc"])[1]  # what the README says it prints
    assert bad.returncode == 1 and quoted in bad.stderr and not results_under(tmp_path)  # refused: nothing ran
    for n, command in enumerate(c for c, how in TOUR.items() if how == "plan"):
        plan = shell(command, tmp_path / f"plan{n}")
        assert plan.returncode == 0, (command, plan.stderr[-2000:])
        points = results_under(tmp_path / f"plan{n}")
        assert points and {p["status"] for p in points} == {"predicted"}, command


@pytest.mark.slow
def test_the_tour_trains_and_reports_as_written(tmp_path):
    """The tour's training commands in order into one outputs/: the grid reuses the points the
    earlier command measured, and the report reads them all."""
    runs = [c for c, how in TOUR.items() if how == "run"]
    done = {c: shell(c, tmp_path) for c in runs}
    for command, proc in done.items():
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
    assert done["python -m ablate -m optimizer=sgd,adamw batch_size=4,8"].stdout.count("[   skip]") == 2
    statuses = {(r["choices"]["optimizer"], r["config"]["batch_size"]): r["status"] for r in results_under(tmp_path)}
    assert len(statuses) == 4 and set(statuses.values()) == {"ok"}
    report = done["python -m analysis.report outputs/"].stdout
    assert report.startswith("# ablate report: 4 runs (4 ok)")  # a reused point's copies count once


# TinyLlama-1.1B's config.json, as a user would copy it (shape keys only: nothing is downloaded).
TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


@pytest.mark.slow  # the recipe's sweep: 16 s
def test_the_fit_recipe_answers_per_card_as_written(tmp_path):
    """README's recipe, its lines as written, on a hand-written TinyLlama config.json: the sweep's
    last lines and the report each open with a recommended combination per card, with its
    micro-batch × micro-steps and its peak under the card; the plan's table has the card as a column."""
    from analysis import compare, recommend
    from analysis.load import load

    lines = bash_block(section("Will my model fit my GPU?"))
    assert lines[0].startswith("mkdir -p my-model && cp ") and lines[0].endswith(" my-model/")
    commands = [line for line in lines if line.startswith("python ")]
    assert len(commands) == 2 and "predict_only=true" in commands[0] and "gpu_memory_gib=24,16" in commands[0]
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINYLLAMA))
    out = tmp_path / "out"
    plan = shell(commands[0].replace("model.config_path=my-model", f"model.config_path={model}"), out)
    assert plan.returncode == 0, plan.stderr[-2000:]
    summary = plan.stdout[plan.stdout.index(" results under "):].splitlines()
    assert summary[1] == "recommended, per card:"
    assert [line.split(":")[0].strip() for line in summary if re.match(r"  \d+ GiB card:", line)] == \
        ["24 GiB card", "16 GiB card"]
    assert not any(line.startswith("  oom:") for line in summary)  # the misfits are in the answer, not listed

    report = shell(commands[1], out)
    assert report.returncode == 0, report.stderr[-2000:]
    text = (out / "report" / "report.md").read_text()
    assert [line for line in text.splitlines() if line.startswith("## ")][:2] == ["## Recommended", "## Setting by card"]
    df = load([out])
    labels = compare.varied(df)
    answer = {row["Card"]: row for _, row in recommend.recommendation(df, labels).iterrows()}
    for card, gib in (("24 GiB card", 24), ("16 GiB card", 16)):
        row = answer[card]
        fits = df[(df["gpu_memory_gib"] == gib) & (df["status"] == "predicted")]
        assert row["Recommended"] in {recommend.named(r, labels) for _, r in fits.iterrows()}  # predicted to fit
        micro, steps = map(int, row["Micro-batch × steps"].split(" × "))
        assert micro * steps == 16  # the preset's batch, split by the micro-batch found to fit
        assert float(row["Peak (MiB)"].lstrip("~").split(" of ")[0].replace(",", "")) <= gib * 1024
        assert f"| {card} | {row['Recommended']} " in re.sub(r" +\|", " |", re.sub(r"\| +", "| ", text))
    by_card = text[text.index("## Setting by card"):text.index("## All runs")]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in by_card.splitlines()
             if line.startswith("|") and not re.match(r"\|[:-]", line)]
    assert table[0] == ["Setting", "24 GiB card", "16 GiB card"]  # the card is a column ...
    assert "GiB card (emulated)" not in text  # ... never a technique in a row's label
    assert len(table) == 1 + 6  # the preset's 6 combinations, once each


def test_the_groups_table_names_every_option_of_every_group():
    table = section("Groups and options")
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([a-z/]+)` \| (.+?) \|", table, re.M)}
    groups = sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*") if p.is_dir() and any(p.glob("*.yaml")))
    assert sorted(rows) == groups
    for group in groups:
        options = {p.stem for p in (CONF / group).glob("*.yaml")}
        assert set(re.findall(r"`([^`]+)`", rows[group])) == options, group


def test_every_link_in_the_readme_leads_to_a_file():
    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert targets, "the README links to no page"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= {t.split("/", 1)[1] for t in targets if t.startswith("docs/")}, "a docs page the README never links"


def prose_lines(text: str) -> set[str]:
    """Lines of running text long enough to be a sentence, outside code blocks and tables."""
    kept, code = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and not line.startswith(("|", "    ")) and len(line.strip()) >= 60:
            kept.add(line.strip())
    return kept


def test_no_paragraph_is_both_in_the_readme_and_a_docs_page():
    readme = prose_lines(README)
    shared = {page.name: sorted(readme & prose_lines(page.read_text())) for page in DOCS.glob("*.md")}
    assert not {k: v for k, v in shared.items() if v}, "README repeats a docs page: link to it instead"


def table_after(text: str, anchor: str) -> list[str]:
    """The lines of the first Markdown table after `anchor` in text."""
    rest = text.split(anchor, 1)[1]
    start = rest.index("\n|") + 1
    return [line for line in rest[start:].split("\n\n", 1)[0].splitlines() if line.startswith("|")]


def cells(table: list[str], drop: tuple[str, ...] = ()) -> list[list[str]]:
    """A table's cells, less the columns named in `drop`, and less the alignment row."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    keep = [i for i, name in enumerate(rows[0]) if name not in drop]
    return [[r[i] for i in keep] for r in rows if not set("".join(r)) <= set(":-")]


PLANNING = (DOCS / "planning.md").read_text()
# (docs/planning.md text just before the table, the sweep's command, the report's options, the
# report's heading, columns the page leaves out)
PLANS = [
    ("each marked `~`, and no latency columns,\nsince nothing ran:",
     "-m parallel=fsdp,ddp checkpoint=none,block device=cuda parallel.nproc=8 model=gpt2-xl batch_size=8 "
     "seq_len=1024 predict_only=true", ["--table", "setting"], "## Setting", ()),
    ("`python -m analysis.report <sweep dir> --table batch`:",
     "-m experiment=batch_scan predict_only=true device=cuda gpu_memory_gib=16", ["--table", "batch"],
     "## Batch size scan", ()),
    ("`predicted`, left out here):",
     "-m predict_only=true find_batch=true device=cuda model=gpt2-large precision=bf16 batch_size=64 seq_len=1024 "
     "checkpoint=none,block gpu_memory_gib=24,40,80", ["--table", "full"], "## All runs",
     ("Predicted peak (MiB)", "Status")),
]


@pytest.mark.parametrize("anchor,command,options,heading,drop",
                         [PLANS[0], *(pytest.param(*p, marks=pytest.mark.slow) for p in PLANS[1:])],
                         ids=["setting", "batch", "find_batch"])
def test_the_docs_plan_tables_are_what_the_tool_prints(tmp_path, anchor, command, options, heading, drop):
    sweep = subprocess.run([sys.executable, "-m", "ablate", *command.split(), f"hydra.sweep.dir={tmp_path}/s",
                            f"out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stderr
    report = run_report([f"{tmp_path}/s", *options], timeout=600)
    assert report.returncode == 0, report.stderr
    assert cells(table_after(PLANNING, anchor)) == cells(table_after(report.stdout, heading), drop)


def test_the_docs_demo_table_is_the_recorded_demo_report():
    """The demo's measured table cannot be rerun to the digit: it is the recorded page's."""
    recorded = (ROOT / "benchmarks" / "results" / "cpu-demo" / "report.md").read_text()
    page = (DOCS / "report.md").read_text()
    assert table_after(page, "From `make demo`") == table_after(recorded, "## Setting")
