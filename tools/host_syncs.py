"""Count what a training step asks of the host (object collectives, host reads of tensors), per schedule.

    .venv/bin/python tools/host_syncs.py      # every built-in schedule x transport, and dp=2 (about 2 min)

Trains every built-in schedule a few steps on 2 gloo ranks (and 1F1B and ZBV with replicas on 4)
with clipping and the non-finite check, and prints one row per schedule, transport and replica
kind: after the first step every count must be 0 but the reads a step is asked for (see
conveyor/testing/rigs/host_syncs.py; tests/runtime/test_host_syncs.py asserts it). It counts device-to-host
reads and object collectives, not host-to-device copies: a GPU's synchronisations are checked by
the GPU check's `world1-syncs` row.
"""

from __future__ import annotations

from conveyor.testing.rigs.host_syncs import main

if __name__ == "__main__":
    main()
