"""Huge pages for the large CPU tensors the engine makes every cycle.

A cycle makes its largest tensors afresh: a pass's logits are rows x V float32 (16 requests of
smc-sd N=4 K=4 verify 320 positions: 320 x 49,152 x 4 bytes = 63 MB), and so are their
log-softmax and the draws' weights. glibc maps every block over its mmap threshold (32 MiB at
most) afresh and unmaps it when freed, so each cycle faults those pages in again, one 4 KiB page
at a time (15,360 faults for those logits), and the kernel zeroes each. With
`THP_MEM_ALLOC_ENABLE=1` torch aligns every CPU block of 2 MiB or more to 2 MiB and asks the
kernel for transparent huge pages there (madvise MADV_HUGEPAGE): the same block faults in 2 MiB
at a time. docs/batching.md has what that and the uncopied logits save per cycle
(`benchmarks/engine_overhead.py`, a 2-core Intel Xeon, one thread).

torch reads the variable once, at its first CPU allocation, so `import smc_sd` sets it
(`prefer_huge_pages`) before smc_sd imports torch. It changes nothing where the environment
already names it (the user's choice wins: `THP_MEM_ALLOC_ENABLE=0` turns it off), where torch has
allocated before smc_sd was imported, or where the kernel's transparent huge pages are `never`.
The cost: a block of 2 MiB or more is rounded up to whole huge pages of memory while it lives.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: the kernel's transparent huge page mode: always, madvise or never (the one in brackets)
KERNEL_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

#: torch's switch for 2 MiB-aligned, huge-page-advised CPU blocks of 2 MiB or more
TORCH_THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    """Set THP_MEM_ALLOC_ENABLE=1 unless the environment already sets it."""
    os.environ.setdefault(TORCH_THP_VARIABLE, "1")


def kernel_thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where the
    kernel does not say (another system, or no THP support). Huge pages are granted to torch's
    advised blocks in modes always and madvise."""
    try:
        selected = re.search(r"\[(\w+)\]", KERNEL_THP_MODE.read_text())
    except OSError:
        return None
    return selected.group(1) if selected else None
