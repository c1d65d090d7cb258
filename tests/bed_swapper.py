"""The environment owner's swap of a directory for a link, driven by inotify, not by time.

``python -m tests.bed_swapper SWAP_ON TARGET DECOY ASIDE RESTORE_ON``: on the first open of SWAP_ON
(a sibling a walk lists just before TARGET), TARGET is moved to ASIDE and a link to DECOY put in its
place; on the first open of RESTORE_ON (the sibling listed just after) or of DECOY (a walk followed
the link), TARGET is put back. Prints "ready" once its watches are set, then "swapped" and "restored".
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

IN_OPEN = 0x20


def main(swap_on: str, target: str, decoy: str, aside: str, restore_on: str) -> int:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = libc.inotify_init1(0)
    watches = {
        libc.inotify_add_watch(fd, path.encode(), IN_OPEN): path for path in (swap_on, decoy, restore_on)
    }
    if fd < 0 or min(watches) < 0:
        return 1
    print("ready", flush=True)
    swapped = False
    while True:
        data = os.read(fd, 65536)
        offset = 0
        while offset < len(data):
            wd, _mask, _cookie, length = struct.unpack_from("iIII", data, offset)
            offset += 16 + length
            if watches.get(wd) == swap_on and not swapped:
                os.rename(target, aside)
                os.symlink(decoy, target, target_is_directory=True)
                swapped = True
                print("swapped", flush=True)
            elif watches.get(wd) in (decoy, restore_on) and swapped:
                os.unlink(target)
                os.rename(aside, target)
                print("restored", flush=True)
                return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
