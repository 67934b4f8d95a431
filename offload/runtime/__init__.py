"""Stage 4: the mechanism, no policy: ledger, tiers, links, aligned/CXL/NVMe storage, the
executor, the chunk store, swapping, the resident cache and the trace follower."""
