"""Decoding one or many requests: ``engine`` (the front: a target, its cache and policy),
``batch`` (the one step loop), ``generation`` (a request's propose -> verify -> commit state),
``drafting`` (every request's drafts at once), ``policy`` and ``costs`` (how far to draft),
``stops`` (stop strings and EOS), ``stats``."""
