"""Cross-silo deployment: certificates and keys, the TLS SuperLink, the sites' SuperNodes."""
