"""Configuration: the LMCache YAML and the adapter's ``hma_*`` keys (``settings``), ``remote_url`` (``remote_url``)."""
