"""What the process costs the machine, for the front ends' summaries."""
from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process. Linux: VmHWM of /proc/self/status (ru_maxrss would
    include the peak of the process that forked us, which it keeps across exec); elsewhere
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024
