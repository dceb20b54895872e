"""`smc_sd.host_memory`: `import smc_sd` asks torch for huge pages under its large CPU tensors
(unless the environment already decides), so a fresh 64 MiB tensor faults in 2 MiB at a time
where the kernel grants transparent huge pages, and 4 KiB at a time where the user said no.

Each case runs in a fresh interpreter: torch reads the setting at its first CPU allocation.
"""

import os
import subprocess
import sys

from smc_sd.host_memory import kernel_thp_mode

# Imports smc_sd, then fills three fresh 64 MiB float32 tensors in turn; prints the setting and
# the minor page faults of the last two.
FRESH_BLOCK_FAULTS = """
import os, resource
import smc_sd, torch
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), sum(faults[1:]))
"""

#: 4 KiB pages in two 64 MiB blocks
PAGES = 2 * (64 << 20) // 4096


def fresh_blocks(**env) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    out = subprocess.run([sys.executable, "-c", FRESH_BLOCK_FAULTS], env=environment, capture_output=True, text=True, check=True, timeout=120)
    setting, faults = out.stdout.split()
    return setting, int(faults)


def test_import_asks_for_huge_pages():
    setting, faults = fresh_blocks()
    assert setting == "1"
    if kernel_thp_mode() in ("always", "madvise"):
        # 32 huge pages a block, and a few 4 KiB pages at its ends: not 16,384 small pages
        assert faults < PAGES // 8, faults
    else:
        assert faults >= PAGES * 0.9, faults


def test_the_users_setting_wins():
    setting, faults = fresh_blocks(THP_MEM_ALLOC_ENABLE="0")
    assert setting == "0"
    if kernel_thp_mode() != "always":
        # glibc maps every fresh 64 MiB block anew, unadvised: each of its small pages faults
        # (in mode always the kernel backs every region with huge pages, advised or not)
        assert faults >= PAGES * 0.9, faults
