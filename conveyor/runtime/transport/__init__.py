"""Moving bytes between ranks: the one transport contract and the transports that implement it.

What it holds: the contract, its failure board and the in-process transport
(:mod:`~conveyor.runtime.transport.transport`), what crosses a boundary
(:mod:`~conveyor.runtime.transport.wire`), the process-group, order-matched (NCCL), shared-memory
and hybrid transports, and the choice among them (:mod:`~conveyor.runtime.transport.choice`).

What it may import: torch, :mod:`conveyor.errors`, :mod:`conveyor.options` (the transfer record),
the schedule layer's posts, and :mod:`conveyor.runtime.lifecycle` (the pipeline's groups and
the health of its peers' processes). Never :mod:`conveyor.runtime.stage`: a transport moves
payloads whatever computed them (``tests/test_layers.py`` keeps that true).
"""
