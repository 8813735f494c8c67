"""Dataset readers, the prompt producer and the dispatcher."""
