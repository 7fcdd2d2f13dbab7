"""What a checkpoint is on storage, in one place: the names shardsafe writes and the rule for where a
save may go (``names``), which sibling checkpoints' files a manifest refers to and the checks of those
references (``refs``), the delete rule, which takes names only from a validated manifest or a save
id, less what a sibling refers to (``delete``), the gate every delete passes (``unlink``), which
leftovers of saves that never committed may go (``orphans``), and what a folder without a manifest
is, for the error that says so (``not_found``).

Layer: above format (it parses manifests) and storage (it lists and deletes through the Storage
interface); may import errors and knobs too. Imported by engine, manager, interop and cli."""
