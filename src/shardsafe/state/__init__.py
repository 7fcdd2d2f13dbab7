"""User state <-> flat tensors and typed values, both directions: flattening modules, optimizers,
DDP/FSDP1/FSDP2 models, DTensors and Stateful objects for a save (``flatten``, also in two steps for
a background save: ``capture`` at the call, the encoding after it; ``layout``, ``fsdp1``,
``per_rank``), and restoring them in place on load (``restore``, ``restore_optim``, ``fsdp1_load``,
``nodes``; ``rest``: which unrequested entries a load reads and returns; ``rng``: ``RNGState``, the
process's random generators as an entry kept per rank). The engine plans the reads
from the destination boxes ``restore`` hands it.

Layer: may import format, storage, coord, knobs, errors (never the engine); imported by the engine,
the fabric strategies and the public package."""
