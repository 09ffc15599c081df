"""Foundations every folder may use: errors, axis letters and array types (``shapes``),
process set-up (``host``), hardware and architecture presets, meshes and sharding rules."""
