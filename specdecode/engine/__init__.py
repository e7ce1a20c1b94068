"""Decoding one or many requests: ``generation`` (a request's propose -> verify -> commit state
and the solo loop), ``draft_length`` (adaptive K), ``stops`` (stop strings and EOS), ``stats``."""
