"""`moectl validate --device cuda` on every 2-GPU layout of a tiny Qwen3-MoE checkpoint (issue 15).

One device call on a machine with 2 GPUs (no Ray, no pip install there: the command runs through
a bare typer app around `actors.validate.cli.validate_command`, as `moectl validate` does):

    python3 bench/validate_gpu.py $OUT          # writes $OUT/validate_gpu.json

Layouts: single, ep2, pp2, tp2, and ep2 with the symmetric-memory EP (`MOE_EP_TRANSPORT=symm`);
each in bfloat16 against transformers float32 on the CPU, layer by layer and op by op (exit 0
pass, 1 a divergence). `DEVICE=cpu` runs the single layout on the CPU (a dry run of the script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DRIVER = (
    "import typer; from actors.validate.cli import validate_command; a = typer.Typer(); "
    "a.command()(validate_command); a()"
)
LAYOUTS = [
    ("single", "single", {}),
    ("ep2", "ep2", {}),
    ("pp2", "pp2", {}),
    ("tp2", "tp2", {}),
    ("ep2_symm", "ep2", {"MOE_EP_TRANSPORT": "symm", "MOE_EP_SYMM_TOKENS": "256"}),
]


def main(out: Path) -> int:
    from tests.actors.checkpoints import make_tiny_checkpoint

    device = os.environ.get("DEVICE", "cuda")
    ckpt = make_tiny_checkpoint("qwen3_moe", Path("/tmp/validate_gpu_qwen3"))
    results = {}
    for name, layout, env in LAYOUTS if device == "cuda" else LAYOUTS[:1]:
        t = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, str(ckpt), "--layout", layout, "--device", device,
             "--dtype", "bfloat16", "--json"],
            capture_output=True, text=True, env={**os.environ, **env}, timeout=240, cwd=ROOT,
        )  # fmt: skip
        rep = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None
        results[name] = {
            "rc": proc.returncode,
            "s": round(time.time() - t, 1),
            "passed": rep.get("passed") if rep else None,
            "max_rel_err": rep.get("max_rel_err") if rep else None,
            "router_agreement": rep.get("router_agreement") if rep else None,
            "err": proc.stderr[-600:] if proc.returncode not in (0, 1) else "",
        }
        print(name, json.dumps(results[name]), flush=True)
    (out / "validate_gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
