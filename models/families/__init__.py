"""Model families: one description each, and the code that builds them."""
