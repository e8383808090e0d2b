"""Run tiny-DiT scenarios in this process's vLLM-Omni and save their outputs (a lane helper).

``python tests/vllm_omni/scenario.py --out FILE dtype:backend ...`` runs each scenario paged
(``backend``: ``auto`` or a ``DIFFUSION_KV_BACKEND`` value) through vLLM-Omni's runner
(:mod:`tiny_dit`) and ``torch.save``s ``{scenario: {"output": tensor, "runner_module": str}}``.
The module-replacement tests run it without the patched copy on ``PYTHONPATH`` to get upstream's
own module's outputs for the same inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def run_scenario(name: str) -> dict[str, Any]:
    from tests.vllm_omni import tiny_dit

    dtype, backend = name.split(":", 1)
    previous = os.environ.pop("DIFFUSION_KV_BACKEND", None)
    if backend != "auto":
        os.environ["DIFFUSION_KV_BACKEND"] = backend
    try:
        result = tiny_dit.run(tiny_dit.Shape(dtype=DTYPES[dtype]), paged=True)
    finally:
        os.environ.pop("DIFFUSION_KV_BACKEND", None)
        if previous is not None:
            os.environ["DIFFUSION_KV_BACKEND"] = previous
    return {"output": result.output, "runner_module": type(result.hooks["backend"]).__module__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args()
    torch.save({name: run_scenario(name) for name in args.scenarios}, args.out)


if __name__ == "__main__":
    main()
