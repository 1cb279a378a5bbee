"""The run's bookkeeping: where it lives, its manifest from start to end, and the report it ends with.

`lifecycle` settles the run folder, starts the run and finishes it (what the flows call); finishing reads each
shard back through `status`, writes the markdown of `report` with the figures of `plots`, and ends the manifest.
One package, so that finishing may render the report while the stages stay independent of both.
"""
