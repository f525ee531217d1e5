"""Prefetch: the predictor (which experts a layer will route to), the prefetcher (native reader threads filling host staging) and the on/off switch of --prefetch auto."""
