#!/usr/bin/env bash
# Download into ./.whl (run from the project root) the wheels that a Python 3.12 x86-64 GPU host
# without network needs besides torch, pandas, matplotlib, nvidia-ml-py, psutil, rich, tabulate, tqdm.
# Usage: benchmarks/wheels.sh [extra pip specs ...]
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dest" "$@"; }
get 'hydra-core>=1.3.2,<1.4' 'omegaconf>=2.3,<2.4' submitit hydra-submitit-launcher cloudpickle bitsandbytes torchao \
    galore-torch==1.0 apollo-torch==1.0.3 adam-mini==1.1.1 lomo-optim==0.1.1 "$@"  # the low-memory optimizers' packages
# The kernels extra (loss=liger, loss=cce, kernels=liger): pure Python; the Triton they need comes with the host's torch.
get liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# antlr4-python3-runtime 4.9.3 (needed by omegaconf 2.3) is published as source only: build its wheel here.
ls "$dest"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
du -sh "$dest"; ls "$dest"
