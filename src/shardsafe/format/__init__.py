"""Format v3, reading v1 and v2 (docs/format.md is the spec): the manifest model (``model``) and its
validation (``manifest``), typed JSON values (``values``), walking typed trees (``walk``), strict JSON
text (``jsontext``), chunk tiling checks (``tiling``), sharding rules (``sharding``), safetensors data
files with their block checksums (``datafile``) and their index (``index``), finding a tensor's chunks
from its rule and the indexes (``resolve``), the save id grammar and data file names (``names``).

Layer: may import storage (data files are written and read through the Storage interface), knobs and
errors. Imported by catalog, state, engine and everything above. Nothing here knows about ranks
or modules."""
