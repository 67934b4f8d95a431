#!/bin/sh
# Inside the guest (chroot over the host's root): load the CXL stack and turn every CXL
# Type-3 device into system RAM on its own CPU-less NUMA node:
#   cxl_acpi/cxl_pci/cxl_mem -> pmem region (one per device and window) -> nvdimm region
#   -> devdax namespace -> kmem (daxctl system-ram).
# QEMU 7.2 has no volatile CXL memory and kernel 6.1 cannot create a RAM region, hence pmem.
# Usage: guest.sh DEVICES nodes|interleave  (interleave: one region across all devices)
set -u
want=$1
layout=${2:-nodes}
t0=$(cut -d' ' -f1 /proc/uptime)
echo "guest.sh: start at uptime $t0 s, kernel $(uname -r)"
for m in cxl_acpi cxl_pci cxl_port cxl_mem cxl_pmem libnvdimm nd_pmem dax_pmem device_dax kmem; do
    modprobe "$m" || echo "guest.sh: modprobe $m failed"
done
# the CXL ports enumerate asynchronously: wait for every memdev
i=0
while [ "$(ls -d /sys/bus/cxl/devices/mem* 2>/dev/null | wc -l)" -lt "$want" ] && [ $i -lt 60 ]; do
    sleep 1; i=$((i + 1))
done
sleep 2
# region DECODER WAYS MEMDEV...: create a pmem region; cxl create-region exits 0 even when it
# made nothing ("created 0 regions"), so read what it says
region() {
    dec=$1 ways=$2; shift 2
    said=$(cxl create-region -m -d "$dec" -t pmem -w "$ways" -g 256 "$@" 2>&1)
    case "$said" in *"created 1 region"*) return 0 ;; esac
    echo "guest.sh: no region on $dec with $*: $(echo "$said" | grep -v '^ \|^{\|^}' | tr '\n' ' ')"
    return 1
}
made=0
if [ "$layout" = interleave ]; then
    # targets in the window's order: host bridge cxl.1 (bus 0x0c) first, then cxl.2 (0x20);
    # a memdev's sysfs path names its bridge (pci0000:0c/...), so sorting the paths does it
    mems=$(for m in $(ls /sys/bus/cxl/devices | grep -E '^mem[0-9]+$'); do
               echo "$(readlink -f /sys/bus/cxl/devices/$m) $m"; done | sort | cut -d' ' -f2 | tr '\n' ' ')
    if region decoder0.0 "$want" $mems; then
        echo "guest.sh: one $want-way region on decoder0.0 with $mems"; made=$want
    fi
fi
[ "$layout" = interleave ] || for dec in $(ls /sys/bus/cxl/devices | grep -E '^decoder0\.[0-9]+$'); do
    for mem in $(ls /sys/bus/cxl/devices | grep -E '^mem[0-9]+$'); do
        if region "$dec" 1 "$mem" >/dev/null; then
            echo "guest.sh: region on $dec with $mem"; made=$((made + 1)); break
        fi
    done
done
[ "$made" -eq "$want" ] || { echo "guest.sh: made $made of $want regions"; ls /sys/bus/cxl/devices; exit 1; }
for r in $(ls /sys/bus/nd/devices | grep -E '^region[0-9]+$'); do
    ndctl create-namespace -r "$r" -m devdax -f >/dev/null || { echo "guest.sh: namespace on $r failed"; exit 1; }
done
daxctl reconfigure-device --mode=system-ram all -f >/dev/null || { echo "guest.sh: kmem failed"; exit 1; }
echo "guest.sh: CXL online at uptime $(cut -d' ' -f1 /proc/uptime) s"
for n in /sys/devices/system/node/node*; do
    echo "guest.sh: $(basename $n) cpus=[$(cat $n/cpulist)] $(grep MemTotal $n/meminfo | sed 's/.*MemTotal: *//') distance=$(cat $n/distance)"
done
