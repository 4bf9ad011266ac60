"""The Mamba kernel on the inputs an engine hands it, against another revision's kernel, in one process.

A kernel's speed depends on its inputs' values (made-up decays can put half of its arithmetic on denormals), so
this script runs a real prefill first: an engine on a preset's checkpoint (one thread) prefills `--rows` tokens,
and the arguments of the first Mamba layer's kernel call are captured. Then, rounds alternated:

- `kernel`: `mamba_rows_` of this tree and of `--base` on those inputs (the states reset before each call), the
  min of three calls a round; the outputs and states of the two compared;
- `engine`: a prefill of `--rows` new tokens with each revision's compiled scan (`_scan_rows`) swapped into this
  tree's kernel, the scan's time summed over the layers and the prefill's wall time (when the two revisions' scans
  take the same arguments).

`--base` is a git revision; its `fused_mamba.py` is imported from a temporary file. Last line: JSON.

    .venv/bin/python benchmarks/mamba_kernel.py --base HEAD~1 --dtype bfloat16 --rows 512
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import engine_for, prefill_s  # noqa: E402

import hybridpd.engine.model.kernels.fused_mamba as this_kernel  # noqa: E402
import hybridpd.engine.model.layers.mamba2 as mamba2  # noqa: E402
from hybridpd.engine.host_memory import keep_freed_memory  # noqa: E402
from hybridpd.presets.checkpoints import write_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KERNEL_PATH = "hybridpd/engine/model/kernels/fused_mamba.py"


def load_kernel(revision: str, tmp: Path) -> ModuleType:
    """`fused_mamba.py` as of `revision`, imported as a module of its own (numba needs it in sys.modules)."""
    source = subprocess.run(["git", "show", f"{revision}:{KERNEL_PATH}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = tmp / "fused_mamba_base.py"
    path.write_text(source.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location("fused_mamba_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fused_mamba_base"] = module
    spec.loader.exec_module(module)
    return module


class Capture:
    """The arguments of the first kernel call with at least `rows` rows, and the slot's states before it."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.args: tuple | None = None
        self._call = mamba2.mamba_rows_
        mamba2.mamba_rows_ = self

    def __call__(self, proj, rows, caches, weights):
        if self.args is None and proj.shape[0] >= self.rows:
            slot = int(rows.slots[0])
            heads, head_dim, d_state = caches.state_shape
            ssm = caches.ssm[slot * caches.ssm_stride : slot * caches.ssm_stride + heads * head_dim * d_state]
            conv = caches.conv[slot * caches.conv_stride : (slot + 1) * caches.conv_stride]
            self.args = (proj.clone(), rows, caches, weights, slot, ssm.copy(), conv.copy())
        return self._call(proj, rows, caches, weights)

    def release(self) -> None:
        mamba2.mamba_rows_ = self._call

    def run(self, module: ModuleType) -> tuple[float, torch.Tensor, np.ndarray]:
        """One call of `module`'s kernel on the captured inputs, from the captured states -> (s, output, state).
        A revision whose kernel takes the gate apart (`mamba_rows_(gate, xbc_dt, ...)`) gets it as an array of its
        own, and xbc | dt_raw as another: the form every such revision reads."""
        proj, rows, caches, weights, slot, ssm, conv = self.args
        at_ssm, at_conv = slot * caches.ssm_stride, slot * caches.conv_stride
        caches.ssm[at_ssm : at_ssm + ssm.size] = ssm
        caches.conv[at_conv : at_conv + conv.size] = conv
        if "gate" in inspect.signature(module.mamba_rows_).parameters:
            inner = caches.state_shape[0] * caches.state_shape[1]
            handed = (proj[:, :inner].clone(), proj[:, inner:].clone())
        else:
            handed = (proj.clone(),)
        start = time.perf_counter()
        out = module.mamba_rows_(*handed, rows, caches, weights)
        return time.perf_counter() - start, out, caches.ssm[at_ssm : at_ssm + ssm.size].copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", required=True, help="the git revision whose kernel to compare against")
    parser.add_argument("--preset", default="granite-350m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=2048, help="the prefill's tokens (one chunk)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = load_kernel(args.base, Path(tmp))
        sides = {"this": this_kernel, "base": base}
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = engine_for(model_dir, args.dtype, 8, args.rows)
        capture = Capture(args.rows)
        prefill_s(engine, args.rows, seed=0)
        capture.release()
        if capture.args is None:
            sys.exit(f"no Mamba kernel call of {args.rows} rows was seen")
        _, out_this, state_this = capture.run(this_kernel)
        _, out_base, state_base = capture.run(base)
        kernel: dict[str, list[float]] = {side: [] for side in sides}
        for k in range(args.rounds):
            for side in (sides if k % 2 == 0 else reversed(list(sides))):
                kernel[side].append(min(capture.run(sides[side])[0] for _ in range(3)) * 1e3)

        scans = {side: module._scan_rows for side, module in sides.items()}
        swappable = (this_kernel._scan_rows.nopython_signatures == base._scan_rows.nopython_signatures)
        engine_figures: dict[str, Any] = {}
        if swappable:
            own_scan = this_kernel._scan_rows
            scan_s, wall_s = {side: [] for side in sides}, {side: [] for side in sides}
            spent = [0.0]

            def timed(scan):
                def call(*a):
                    start = time.perf_counter()
                    scan(*a)
                    spent[0] += time.perf_counter() - start
                return call

            try:
                for k in range(args.rounds):
                    for side in (sides if k % 2 == 0 else reversed(list(sides))):
                        this_kernel._scan_rows, spent[0] = timed(scans[side]), 0.0
                        wall_s[side].append(prefill_s(engine, args.rows, seed=1 + 2 * k + (side == "base")))
                        scan_s[side].append(spent[0])
            finally:
                this_kernel._scan_rows = own_scan
            engine_figures = {side: {"scan_s": [round(v, 3) for v in scan_s[side]],
                                     "prefill_s": [round(v, 3) for v in wall_s[side]]} for side in sides}
            engine_figures["scan_ratio_median"] = round(
                statistics.median(scan_s["this"]) / statistics.median(scan_s["base"]), 3)

    print(json.dumps({
        "preset": args.preset, "dtype": args.dtype, "rows": args.rows, "base": args.base, "rounds": args.rounds,
        "kernel_ms": {side: [round(v, 2) for v in kernel[side]] for side in sides},
        "kernel_ratio_median": round(statistics.median(kernel["this"]) / statistics.median(kernel["base"]), 3),
        "outputs_equal": bool(torch.equal(out_this, out_base)),
        "states_equal": bool(np.array_equal(state_this, state_base)),
        "engine": engine_figures or "the two scans take different arguments: not swapped",
    }))


if __name__ == "__main__":
    main()
