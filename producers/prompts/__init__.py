"""The prompts room: what a prompt is and where it comes from.

Dataset rows and their formats (``datasets``), the order they are sent in (``order``),
conversations regenerated turn by turn (``conversations``), which prompts already have
an answer (``resume``), and the prompt producer that publishes them (``producer``).
The dispatch room reads the vocabulary here but never the producer.
"""
