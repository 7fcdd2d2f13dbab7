"""Benchmarks of shardsafe against torch.save, torch.distributed.checkpoint, Lightning Fabric and the
storage floors, on one state, in one run. Entry point: ``python bench/run.py`` (``make bench``)."""
