"""Checkpoints: DCP save and load, the directories and manifests on disk, which checkpoints a run
may resume from."""
