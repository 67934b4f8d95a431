"""Boot Debian's kernel under QEMU with emulated CXL Type-3 memory and run a program inside.

The guest has no disk image: a busybox initramfs loads the 9p/overlay modules, mounts the
host's `/` read-only over virtio-9p (so the guest sees this project, Python and torch exactly
as installed here), puts a tmpfs overlay on top, chroots into it and runs `guest.sh`, which
brings the CXL memory online (cxl -> pmem region -> devdax -> kmem: a CPU-less NUMA node) and
then runs the given command. A second, writable 9p share (`out`) carries results back.

Two devices are two host bridges, each with its own fixed memory window (CFMWS): the kernel
makes one NUMA node per window, so the guest sees two CXL nodes. Each host bridge has a second,
empty root port: with a single one the kernel leaves the bridge's decoder unprogrammed and
every write to the memory is lost (see /work/shared/cxl-qemu.md).

Run by hand: `python -m tests.cxl_vm.harness --devices 2 -- python -m tests.cxl_vm.guest`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
DEVICE_MB = 512  # per CXL device; kmem onlines whole 128 MiB blocks after the devdax metadata
GUEST_MB = 2048


class Missing(Exception):
    """A tool or kernel image the harness needs is not installed (the tests skip)."""


def find_kernel() -> tuple[str, str]:
    """(vmlinuz path, kernel version) of the newest installed Debian kernel with its modules."""
    for vmlinuz in sorted(glob.glob("/boot/vmlinuz-*"), reverse=True):
        kver = vmlinuz.split("vmlinuz-", 1)[1]
        if os.path.isdir(f"/lib/modules/{kver}/kernel/drivers/cxl") and os.access(vmlinuz, os.R_OK):
            return vmlinuz, kver
    raise Missing("no readable kernel image with CXL modules under /boot and /lib/modules "
                  "(apt-get install linux-image-amd64; Debian's images are readable by root only)")


def check_tools() -> None:
    need = {"qemu-system-x86_64": "qemu-system-x86", "cxl": "ndctl", "ndctl": "ndctl",
            "daxctl": "daxctl", "busybox": "busybox-static", "cpio": "cpio", "modprobe": "kmod"}
    missing = sorted({pkg for tool, pkg in need.items() if shutil.which(tool) is None})
    if missing:
        raise Missing(f"missing Debian packages: {' '.join(missing)} (apt-get install them)")
    busybox = subprocess.run(["file", "-L", shutil.which("busybox")], capture_output=True, text=True)
    if busybox.returncode == 0 and "dynamically linked" in busybox.stdout:
        raise Missing("busybox is dynamically linked: install busybox-static")


INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
while read m; do insmod "$m" || echo "init: insmod $m failed"; done < /modules.list
mkdir -p /ro /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /ro || echo "init: 9p root failed"
mount -t tmpfs -o size=1g tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/ro,upperdir=/rw/upper,workdir=/rw/work /newroot || echo "init: overlay failed"
mkdir -p /newroot/cxlvm-out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /newroot/cxlvm-out
for d in proc sys dev; do mount --bind /$d /newroot/$d; done
mount -t tmpfs tmpfs /newroot/tmp
mount -t tmpfs tmpfs /newroot/run
# the checkout under test, at its host path (it may lie under /tmp, hidden by the tmpfs above,
# or on another filesystem than /)
R="$(cat /newroot/cxlvm-out/repo)"
mkdir -p "/newroot$R"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose repo "/newroot$R" || echo "init: 9p repo failed"
# the interpreter's prefixes the tmpfs mounts hide (a venv under /tmp), at their host paths too
while read tag path; do
    mkdir -p "/newroot$path"
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose "$tag" "/newroot$path" \
        || echo "init: 9p $tag failed"
done < /newroot/cxlvm-out/prefixes
# the guest's own deadline: a hung program still powers the VM off (no orphaned QEMU)
timeout -s KILL "$(cat /newroot/cxlvm-out/timeout)" chroot /newroot /bin/sh /cxlvm-out/run.sh \
    > /newroot/cxlvm-out/guest.log 2>&1
echo "init: guest exited with $?"
sync
echo o > /proc/sysrq-trigger
sleep 30
"""


#: What the guest mounts a tmpfs over (INIT): a host path below one is not seen through the root.
GUEST_TMPFS = ("/tmp", "/run")


def hidden_prefixes(prefixes: "tuple[str, ...] | None" = None) -> list[str]:
    """The interpreter's prefixes (a venv's and its base) that lie under the guest's tmpfs
    mounts, outside this checkout: each is shared into the guest at its host path, or the guest
    would find no Python there."""
    out = []
    for p in prefixes if prefixes is not None else (sys.prefix, sys.base_prefix):
        real = os.path.realpath(p)
        hidden = any(real == t or real.startswith(t + "/") for t in GUEST_TMPFS)
        inside = real == str(REPO) or real.startswith(str(REPO) + "/")
        if hidden and not inside and real not in out:
            out.append(real)
    return out


def build_initramfs(kver: str, dest: Path) -> Path:
    """A busybox initramfs with the 9p/overlay modules of `kver` (cached by kernel version
    and init script)."""
    tag = hashlib.sha1((INIT + " ".join(MODULES)).encode()).hexdigest()[:10]
    out = dest / f"cxlvm-initrd-{kver}-{tag}.cpio.gz"
    if out.exists():
        return out
    root = Path(tempfile.mkdtemp(prefix="cxlvm-initrd-", dir=dest))
    try:
        for d in ("bin", "proc", "sys", "dev", "lib/mod"):
            (root / d).mkdir(parents=True)
        shutil.copy2(shutil.which("busybox"), root / "bin/busybox")
        order: list[str] = []
        for mod in MODULES:
            deps = subprocess.run(["modprobe", "-S", kver, "--show-depends", mod],
                                  capture_output=True, text=True, check=True).stdout
            for line in deps.splitlines():
                parts = line.split()
                if parts[:1] != ["insmod"]:
                    continue  # "builtin X"
                src = parts[1]
                name = Path(src).name
                if f"/lib/mod/{name.removesuffix('.xz').removesuffix('.zst')}" in order:
                    continue
                dst = root / "lib/mod" / name
                shutil.copy2(src, dst)
                if name.endswith(".xz"):
                    subprocess.run(["xz", "-d", str(dst)], check=True)
                elif name.endswith(".zst"):
                    subprocess.run(["zstd", "-q", "-d", "--rm", str(dst)], check=True)
                order.append(f"/lib/mod/{name.removesuffix('.xz').removesuffix('.zst')}")
        (root / "modules.list").write_text("\n".join(order) + "\n")
        (root / "init").write_text(INIT)
        (root / "init").chmod(0o755)
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            find = subprocess.Popen(["find", "."], cwd=root, stdout=subprocess.PIPE)
            cpio = subprocess.Popen(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root,
                                    stdin=find.stdout, stdout=subprocess.PIPE)
            subprocess.run(["gzip", "-1"], stdin=cpio.stdout, stdout=f, check=True)
            find.wait(), cpio.wait()
        tmp.rename(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def qemu_command(*, vmlinuz: str, initrd: Path, work: Path, out: Path, devices: int,
                 interleave: bool = False, smp: int = 2) -> list[str]:
    """The QEMU line: q35 with CXL, `devices` Type-3 devices, each behind its own host bridge
    (two root ports each); each bridge its own fixed memory window, or (`interleave`) one
    window interleaved across all bridges."""
    cmd = ["qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(smp),
           "-nographic", "-no-reboot", "-M", "q35,cxl=on",
           "-m", f"{GUEST_MB}M,maxmem=16G,slots=4",
           "-object", f"memory-backend-ram,id=m0,size={GUEST_MB}M",
           "-numa", f"node,nodeid=0,cpus=0-{smp - 1},memdev=m0",
           "-kernel", vmlinuz, "-initrd", str(initrd),
           "-append", "console=ttyS0 panic=-1 quiet",
           "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
           "-virtfs", f"local,path={out},mount_tag=out,security_model=none",
           "-virtfs", f"local,path={REPO},mount_tag=repo,security_model=none,readonly=on,multidevs=remap"]
    for i, prefix in enumerate(hidden_prefixes()):
        cmd += ["-virtfs", f"local,path={prefix},mount_tag=prefix{i},security_model=none,readonly=on,multidevs=remap"]
    for i in range(devices):
        mem, lsa = work / f"cxl-mem{i}.raw", work / f"cxl-lsa{i}.raw"
        for path, size in ((mem, DEVICE_MB << 20), (lsa, 256 << 20)):
            with open(path, "wb") as f:
                f.truncate(size)  # sparse: pages cost host memory only once the guest writes
        cmd += ["-object", f"memory-backend-file,id=cxl-mem{i},share=on,mem-path={mem},size={DEVICE_MB}M",
                "-object", f"memory-backend-file,id=cxl-lsa{i},share=on,mem-path={lsa},size=256M",
                "-device", f"pxb-cxl,bus_nr={12 + 20 * i},bus=pcie.0,id=cxl.{i + 1}",
                "-device", f"cxl-rp,port=0,bus=cxl.{i + 1},id=rp{2 * i},chassis=0,slot={2 + 2 * i}",
                "-device", f"cxl-rp,port=1,bus=cxl.{i + 1},id=rp{2 * i + 1},chassis=0,slot={3 + 2 * i}",
                "-device", f"cxl-type3,bus=rp{2 * i},memdev=cxl-mem{i},lsa=cxl-lsa{i},id=cxl-pmem{i}"]
    # one -M for all windows: QEMU refuses cxl-fmw.* spread over several
    if interleave:
        cmd += ["-M", ",".join([f"cxl-fmw.0.targets.{i}=cxl.{i + 1}" for i in range(devices)]
                               + ["cxl-fmw.0.size=4G"])]
    else:
        cmd += ["-M", ",".join(f"cxl-fmw.{i}.targets.0=cxl.{i + 1},cxl-fmw.{i}.size=4G"
                               for i in range(devices))]
    return cmd


def run_guest(argv: list[str], *, devices: int, interleave: bool = False, timeout: float = 900,
              workdir: str | None = None) -> dict:
    """Boot a guest with `devices` CXL devices, run `argv` (in this repository, as root) after
    the memory is online, and return {"rc", "wall_s", "log", "result"}: `result` is the JSON
    the program wrote to $CXLVM_OUT/result.json (None if it wrote none)."""
    check_tools()
    vmlinuz, kver = find_kernel()
    cache = Path(workdir or tempfile.gettempdir())
    initrd = build_initramfs(kver, cache)
    work = Path(tempfile.mkdtemp(prefix="cxlvm-", dir=cache))
    out = work / "out"
    out.mkdir()
    (out / "timeout").write_text(f"{max(int(timeout) - 60, 60)}\n")
    (out / "repo").write_text(f"{REPO}\n")
    (out / "prefixes").write_text("".join(f"prefix{i} {p}\n" for i, p in enumerate(hidden_prefixes())))
    (out / "run.sh").write_text(
        f"cd {shlex.quote(str(REPO))}\n"
        f"export CXLVM_OUT=/cxlvm-out CXLVM_DEVICES={devices} PYTHONDONTWRITEBYTECODE=1 "
        f"PYTHONPATH={shlex.quote(str(REPO / 'tests' / 'devtree'))}\n"  # tierwise = this checkout

        f"/bin/sh {shlex.quote(str(HERE / 'guest.sh'))} {devices} "
        f"{'interleave' if interleave else 'nodes'} || exit 3\n"
        f"{shlex.join(argv)}\n"
        f"echo \"guest: program exited with $?\"\n")
    cmd = qemu_command(vmlinuz=vmlinuz, initrd=initrd, work=work, out=out, devices=devices,
                       interleave=interleave)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(work / "console.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:  # timed out or interrupted: never leave QEMU running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    log = (out / "guest.log").read_text(errors="replace") if (out / "guest.log").exists() else ""
    console = (work / "console.log").read_text(errors="replace")
    result = None
    if (out / "result.json").exists():
        result = json.loads((out / "result.json").read_text())
    report = {"rc": rc, "wall_s": round(wall, 1), "kernel": kver, "devices": devices,
              "log": log, "console_tail": console[-4000:], "result": result, "work": str(work)}
    for raw in work.glob("*.raw"):
        raw.unlink()  # the device files: what the guest wrote there is host memory or disk
    if rc is not None and result is not None:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1, choices=(1, 2))
    p.add_argument("--interleave", action="store_true",
                   help="one window and region interleaved across the devices (one node)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("argv", nargs="*", default=["python", "-m", "tests.cxl_vm.guest"])
    args = p.parse_args()
    # SIGTERM as an exception, so that run_guest's cleanup kills QEMU before we go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    argv = [sys.executable if a == "python" else a for a in args.argv]
    report = run_guest(argv, devices=args.devices, interleave=args.interleave, timeout=args.timeout)
    print(report["log"])
    if report["result"] is None:
        print(report["console_tail"], file=sys.stderr)
    print(json.dumps({k: report[k] for k in ("rc", "wall_s", "kernel", "devices", "result")}, indent=1))
    return 0 if report["result"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
