"""`python -m ablate --help`: one line for each option of each group and for each run key, taken
from where they are documented already (an option's file opens with a comment saying what it does;
a run key's comment sits beside it in ablate/schema.py), so the help cannot drift from them."""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from dataclasses import fields

from ablate.schema import CONF, GROUPS, OVERLAYS, RunKeys, options

WIDTH = 110  # a line of the help, at most


def _first_sentence(text: str) -> str:
    """The first sentence of a comment block, trimmed to fit one help line."""
    text = " ".join(text.split())
    match = re.match(r"(.+?)\.(\s|$)", text)
    line = match.group(1) if match else text
    room = WIDTH - 26
    if len(line) <= room:
        return line
    # Too long: end at the last clause that fits ("...: 1,235,814,400 p..." read as a number cut
    # off), else at the last whole word, never inside one.
    clause = max(line.rfind("; ", 0, room), line.rfind(": ", 0, room))
    if clause >= room // 2:
        return line[:clause]
    return line[:line.rfind(" ", 0, room - 3)].rstrip(",;:") + "..."


def option_line(group: str, option: str) -> str:
    """What an option does: the comment its file opens with (Hydra's `# @package` line skipped)."""
    lines = (CONF / group / f"{option}.yaml").read_text(encoding="utf-8").splitlines()
    comment = []
    for line in lines:
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            comment.append(line.lstrip("#").strip())
    return _first_sentence(" ".join(comment)) if comment else ""


def run_key_lines() -> dict[str, str]:
    """Each run key's comment in ablate/schema.py's RunKeys: the one beside it, else the block above."""
    source = inspect.getsource(RunKeys)
    names = {f.name for f in fields(RunKeys)}
    docs, above = {}, []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            if tok.line.strip().startswith("#"):  # a comment line of its own: belongs to the key below
                above.append(tok.string.lstrip("#").strip())
            continue
        if tok.type == tokenize.NAME and tok.string in names and tok.start[1] == 4 and tokens[i + 1].string == ":":
            inline = [t.string.lstrip("#").strip() for t in tokens[i:] if t.start[0] == tok.start[0]
                      and t.type == tokenize.COMMENT]
            docs[tok.string] = _first_sentence(" ".join(inline or above))
            above = []
    return docs


def text() -> str:
    """The groups, each option with its line, then the run keys with theirs."""
    out = ["== Configuration groups ==",
           "Pick one option per group (group=option), or sweep several with -m (group=a,b):", ""]
    for group in (*GROUPS, *OVERLAYS):
        out.append(f"{group}:")
        out += [f"  {option:<22}  {option_line(group, option)}".rstrip() for option in options(group)]
    out += ["", "== Run keys ==", "Set any with key=value (sweep with -m key=a,b); the whole config: --cfg job", ""]
    out += [f"  {key:<22}  {doc}".rstrip() for key, doc in run_key_lines().items()]
    return "\n".join(out)
