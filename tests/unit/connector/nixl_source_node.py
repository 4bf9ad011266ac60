"""A node-like source process for the NIXL tests: registers seeded group tensors and answers on stdin/stdout.

Run as `python nixl_source_node.py NAME SEED PAGE:BLOCKS [PAGE:BLOCKS ...]`. It prints one `@@ {json}` line with its
transport metadata (base64) and layouts, then reads commands, one per line:
- `collect N [LINGER_S]`: call get_notifs() (which drives progress) until N notifications came, then for
  LINGER_S more seconds, and print them as JSON;
- `quit`: close and exit.
Between commands it blocks on stdin: it is idle and does nothing to help a READ progress.
"""

from __future__ import annotations

import base64
import json
import sys
import time

import numpy as np
import torch

from hybridpd.connector.nixl_transport import NixlTransport

REPLY = "@@"  # marks our lines: NIXL logs to stdout too


def seeded_tensors(seed: int, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(-128, 128, size=shape, dtype=np.int8)) for shape in shapes]


def main() -> int:
    name, seed = sys.argv[1], int(sys.argv[2])
    shapes = [(int(b), int(p)) for p, b in (arg.split(":") for arg in sys.argv[3:])]
    torch.set_num_threads(1)
    transport = NixlTransport(name, progress_thread=False)
    transport.register(seeded_tensors(seed, shapes))
    layouts = [[x.base_addr, x.page_size_bytes, x.num_blocks] for x in transport.local_layouts()]
    print(REPLY, json.dumps({"metadata": base64.b64encode(transport.local_metadata()).decode(), "layouts": layouts}))
    sys.stdout.flush()
    for line in sys.stdin:
        command = line.split()
        if command[0] == "collect":
            want, notifs, deadline = int(command[1]), [], time.monotonic() + 30
            while len(notifs) < want and time.monotonic() < deadline:
                notifs += transport.get_notifs()
                time.sleep(0.001)
            linger_until = time.monotonic() + float(command[2]) if len(command) > 2 else 0.0
            while time.monotonic() < linger_until:
                notifs += transport.get_notifs()
                time.sleep(0.001)
            print(REPLY, json.dumps([[peer, msg.decode()] for peer, msg in notifs]))
            sys.stdout.flush()
        elif command[0] == "quit":
            break
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
