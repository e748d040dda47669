"""Text: tokenizers and chat templates."""
