"""Developer tools: the inference simulator, the chaos harness, the demo, a
three-node test cluster, the independent oracle that grades runs, and a tiny
offline tokenizer.

They drive the product from outside (as a user or a fault would), so they may
import the application; the product never imports them (the layers contract in
``pyproject.toml``).
"""
