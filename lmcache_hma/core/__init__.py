"""What both halves share and that touches no KV bytes: kinds, layout, keys, identity, object trailers, the hit rule, the step metadata."""
