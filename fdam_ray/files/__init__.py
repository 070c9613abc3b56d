"""Leaves about files and folders: where outputs go (local folders, storage URIs, ``ray job submit`` working
directories), who writes a run folder now, and the versions a run ran under."""
