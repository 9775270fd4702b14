"""What mla-doctor does to one host over its one connection: audit, patch/revert, the live run."""
