"""Run by the zygote's test as `python -m tests.support.zygote_probe ACTION`: prints what a
forked launcher sees (argv, one variable, cwd, whether it leads its own session and process
group, a random number), then exits with status N (`exit N`) or sleeps until signalled."""

from __future__ import annotations

import json
import os
import random
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "probe": os.environ.get("ZYGOTE_PROBE"),
                      "cwd": os.getcwd(), "leader": os.getpgid(0) == os.getpid(),
                      "session": os.getsid(0) == os.getpid(), "random": random.random()}),
          flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    time.sleep(600)
