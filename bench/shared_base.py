"""The frozen base held once per node: the node's memory (sum of its processes' PSS, which splits
a shared page among its mappers) for LoRA over a bf16 base on 1 rank, on 2 ranks sharing the
base (/dev/shm) and on 2 ranks with a copy each (`Engine(share_base=False)`). gloo ranks on this
CPU; the same cases as tests/test_dist_lora.py, with a larger base.

    PYTHONPATH=tests/devtree python bench/shared_base.py [--layers 8 --hidden 512]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.dist_cases import spawn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    model = dict(layers=args.layers, hidden=args.hidden, vocab=64)

    def case(**kw):
        return {"kind": "engine", "data": "plain", "steps": 2, "grad_accum": 1, "lora": {}, "model": model,
                "pss": True, "engine": dict(base_dtype="bf16", chunk_bytes="2M") | kw}

    # each in fresh processes: nothing left over from another case
    rows = {"1 rank": spawn(1, [case()])[0], "2 ranks, a base each": spawn(2, [case(share_base=False)])[0],
            "2 ranks, shared base": spawn(2, [case()])[0]}
    base = rows["2 ranks, shared base"]["ranks_memory"][0]["shared_nbytes"]
    print(f"base {base / 2**20:.1f} MiB (bf16, host-homed)")
    print(f"{'':24} {'node PSS MiB':>13} {'per rank':>16} {'engines grew':>13} {'shm PSS MiB':>12}")
    for name, r in rows.items():
        mem = r["ranks_memory"]
        pss = [m["pss_kib"] / 1024 for m in mem]
        grew = sum(m["growth_kib"] for m in mem) / 1024
        shm = sum(m["shm_pss_kib"] for m in mem) / 1024
        print(f"{name:24} {sum(pss):13.1f} {' + '.join(f'{p:.1f}' for p in pss):>16} {grew:13.1f} {shm:12.1f}")
    for what in ("pss_kib", "growth_kib"):
        a, b = (sum(m[what] for m in rows[k]["ranks_memory"]) * 1024
                for k in ("2 ranks, a base each", "2 ranks, shared base"))
        print(f"{what}: a base each - shared = {(a - b) / 2**20:.1f} MiB = {(a - b) / base:.2f} base")


if __name__ == "__main__":
    main()
