"""A network cable in user space, for tests: two TAP devices, and every Ethernet frame that leaves one
comes out of the other, after a delay, perhaps dropped, or not at all while the cable is cut.

The kernel here has no netem, so latency and loss cannot come from `tc`. Run as
`python link_emulator.py TAP_A TAP_B`: it creates both devices (they live exactly as long as this
process, so nothing is left behind), prints `ready`, and then takes commands on stdin, one a line:
`delay MS` (each way), `loss PERCENT` (each way), `cut`, `mend`, `clear` (no delay, no loss, mended).
Frames are only ever written to the other TAP device: nothing reaches any other interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main(name_a: str, name_b: str) -> None:
    fd_a, fd_b = open_tap(name_a), open_tap(name_b)
    other = {fd_a: fd_b, fd_b: fd_a}
    delay_s, loss, cut = 0.0, 0.0, False
    due: list[tuple[float, int, int, bytes]] = []  # (when, order, destination, frame)
    order = itertools.count()
    rng = random.Random(0)
    print("ready", flush=True)
    commands = sys.stdin.fileno()
    while True:
        wait_s = max(0.0, due[0][0] - time.monotonic()) if due else 1.0
        readable, _, _ = select.select([fd_a, fd_b, commands], [], [], wait_s)
        for fd in readable:
            if fd == commands:
                line = os.read(commands, 4096).decode()
                if not line:
                    return  # the test is gone
                for command in line.split("\n"):
                    words = command.split()
                    if not words:
                        continue
                    if words[0] == "delay":
                        delay_s = float(words[1]) / 1000
                    elif words[0] == "loss":
                        loss = float(words[1]) / 100
                    elif words[0] in ("cut", "mend"):
                        cut = words[0] == "cut"
                    elif words[0] == "clear":
                        delay_s, loss, cut = 0.0, 0.0, False
                    print("ok", command, flush=True)
                continue
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if cut or (loss and rng.random() < loss):
                    continue
                heapq.heappush(due, (time.monotonic() + delay_s, next(order), other[fd], frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, destination, frame = heapq.heappop(due)
            # A device down or its queue full: the frame is lost, as on a cable.
            with contextlib.suppress(OSError):
                os.write(destination, frame)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
