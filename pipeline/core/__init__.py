"""The stage runner (hashing, meta.json, atomic writes), the config schema, device and dtype."""
