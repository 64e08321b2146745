"""text-lm: a byte-level transformer on the standard library's source, with flplatform."""
