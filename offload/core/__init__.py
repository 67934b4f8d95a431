"""Stage 1: errors, byte sizes, parameter specs and chunk packing. No torch at import."""
