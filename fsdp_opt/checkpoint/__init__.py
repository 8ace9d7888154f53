"""Layer 5, checkpoints: names, the formats (full file, sharded folder, weights file), atomic writes, save, read,
load into shards, resume, disk room, export."""
