"""Loading a checkpoint several times larger than --cpu-mem keeps the process's RSS within it:
weights stream tensor by tensor from the safetensors shards into chunks on the NVMe tier, through
the CLI's loader (cli.layout.iter_checkpoint: transformers' renaming, tied weights)."""

import json
import subprocess
import sys
import textwrap

from tests.tinyhf import make_tiny_llama_dir

CPU_MEM = 6 << 20

SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from tierwise.cli.layout import ModelLayout, iter_checkpoint
    from tierwise.cli.loading import build_meta_model
    from tierwise.offload import Budget, Engine

    model_dir, swap, cpu_mem = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = build_meta_model(AutoConfig.from_pretrained(model_dir))
    layout = ModelLayout.of(model)
    eng = Engine(model, budget=Budget(gpu="64M", cpu=cpu_mem, nvme=swap, chunk=512 << 10))
    def rss():  # anonymous (what the process holds) and file-backed (mapped shards, library code)
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith("Rss"))}
        return kb["RssAnon"] << 10, kb["RssFile"] << 10

    base, peak, done = rss(), [0, 0], threading.Event()

    def watch():
        while not done.is_set():
            peak[:] = map(max, peak, rss())
            time.sleep(0.001)

    t = threading.Thread(target=watch); t.start()
    eng.load_weights(iter_checkpoint(model, layout, model_dir))
    done.set(); t.join()
    peak[:] = map(max, peak, rss())  # before the checks below allocate
    anon, mapped = peak[0] - base[0], peak[1] - base[1]
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    mine = dict(eng.named_parameters_fp32())
    same = all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    print(json.dumps({"anon": anon, "mapped": mapped, "same": same,
                      "nvme": eng.homes.bytes.get("nvme", {}), "host_peak": eng.ledger.peaks()["host"]}))
    eng.close()
""")


def test_loading_a_checkpoint_bigger_than_cpu_mem_stays_within_it(tmp_path):
    model_dir = make_tiny_llama_dir(tmp_path / "m", vocab_size=512, hidden=256, layers=8, shard=True,
                                    tie=True)
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert weights > 3 * CPU_MEM  # several times larger than the host budget
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(tmp_path / "swap"), str(CPU_MEM)],
                         capture_output=True, text=True, timeout=300, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"]  # every weight arrived in its chunk, on NVMe
    assert res["nvme"].get("master", 0) > 2 * CPU_MEM
    assert res["host_peak"] <= CPU_MEM
    # Anonymous RSS grows by at most the host budget plus one tensor being read (the largest:
    # 512 KiB) and the allocator's slack. File-backed RSS (about 3 MiB here: library code first
    # run, the shard being read) is counted apart: summed with the anonymous part it came within
    # 5% of the bound in CI, but it is not memory the engine holds. The whole checkpoint mapped at
    # once would still fail the second bound.
    assert res["anon"] <= CPU_MEM + (4 << 20), res
    assert res["mapped"] <= weights // 3, res
