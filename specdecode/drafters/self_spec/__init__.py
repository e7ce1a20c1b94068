"""Self-speculation: the target drafts for itself with some of its layers skipped. ``drafter``
(the drafter), ``skip`` (the target run without those layers, sharing every tensor), ``layers``
(which layers: the stored calibration or a default) and ``calibrate`` (the search behind
``specdecode calibrate``)."""
