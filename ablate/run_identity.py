"""A grid point's identity: `run_id`, the hash of its resolved config and of the contents of the
files it reads (a config.json, a dataset, a custom model's source), so that the same point on the
same inputs always gets the same id and an edited input another one (ablate/results.py re-exports
these; the job asks `run_id` before it looks for a finished result)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path


def run_id(config: dict) -> str:
    """12 hex digits of the hash of the resolved config, and of the files its input paths name
    (`inputs`): the same point on the same inputs always gets the same id, and an edited config.json
    or dataset another one, so that a rerun measures it instead of skipping it as done."""
    inputs = {key: fingerprint(path) for key, path in input_paths(config).items()}
    blob = json.dumps({**config, "_inputs": inputs} if inputs else config, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


# The config keys that name files a point reads (ablate/models/, ablate/data.py): group -> keys.
INPUT_KEYS = {"model": ("config_path", "init_from"), "data": ("path",)}
SMALL_FILE = 2**20  # bytes: hashed whole (a config.json); a larger file by its size and mtime


# The config keys that name a Python class as "pkg.module:Class" (model=custom's target): the file
# of its module is an input as a path is, so that an edited model is a new point.
MODULE_KEYS = {"model": ("target",)}


def input_paths(config: dict) -> dict[str, str]:
    """"group.key" -> path, for each input path the config sets, and the source of each module it names."""
    paths = {f"{group}.{key}": str(config[group][key]) for group, keys in INPUT_KEYS.items()
             for key in keys if isinstance(config.get(group), dict) and config[group].get(key)}
    for group, keys in MODULE_KEYS.items():
        for key in keys:
            value = config[group].get(key) if isinstance(config.get(group), dict) else None
            source = module_source(value) if isinstance(value, str) else None
            if source:
                paths[f"{group}.{key}"] = source
    return paths


def module_source(target: str) -> str | None:
    """The file that defines the module of `target` ("pkg.module:Class" or "pkg.module.Class"), or
    a package's folder (its files one level down), found by importlib without running that module
    (its parent packages are imported); None where no such file is found."""
    module = target.partition(":")[0] if ":" in target else target.rpartition(".")[0]
    try:
        spec = importlib.util.find_spec(module) if module else None
    except Exception:  # noqa: BLE001  (a parent package that fails to import, a name no module has)
        return None
    if spec is None or not spec.has_location or not spec.origin:
        return None
    return str(Path(spec.origin).parent) if spec.submodule_search_locations is not None else spec.origin


def fingerprint(path: str) -> str:
    """What identifies a file's contents cheaply: a small file's sha1, a large one's size and
    modification time (a tokens file of GBs is not read per point); a directory's files, one level
    down, each so; "missing" for nothing there."""
    p = Path(path).expanduser()
    if p.is_dir():
        return json.dumps({f.name: fingerprint(str(f)) for f in sorted(p.iterdir()) if f.is_file()})
    try:
        st = p.stat()
        if st.st_size <= SMALL_FILE:
            return hashlib.sha1(p.read_bytes()).hexdigest()
        return f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return "missing"
