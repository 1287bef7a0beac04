"""DTensor ParallelStyles of our own: a leaf that imports nothing from shardforge, so model families' plans
(models/) and the appliers (parallel/) can both use them without a cycle."""
