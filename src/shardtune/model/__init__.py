"""Stage 1, the model before it is sharded: directory checks, meta build, LoRA injection, structure,
shard-only loading and the memory footprint."""
