"""The rank side (torch), inside each rank process: from a loader to the record of an epoch.

What a loader is made of (describe), how batches say where they came from (tagging) and how
their ids are read (ids), the recorder that records what reaches the training loop (recorder,
counting), and the walks that drive a loader as a training loop does (walk). It never imports
sharddemo.analysis: what crosses to the parent is the record of sharddemo.record."""
