"""Format v1: manifest, typed JSON values and safetensors data files (docs/format.md is the spec)."""
